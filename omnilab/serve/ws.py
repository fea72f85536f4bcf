"""WebSocket ``/v1/audio/speech/stream``: text arrives in increments, each flush (``input.done``) is spoken as one
utterance, with vLLM-Omni's message types (session.config, input.text, input.done, session.close ->
audio.start, binary audio, audio.done, session.done, error)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from omnilab.serve.config import ServeConfig
from omnilab.serve.engine import Engine, concat
from omnilab.serve.responses import Resampler
from omnilab.serve.speech import ApiError, SpeechContext, encode, parse_speech, pcm16, wav_header

MESSAGE_TYPES = ("session.config", "input.text", "input.done", "session.close")


class _Reader:
    """Reads the client's messages into a queue while audio is being generated, so a disconnect is seen at once
    (the live request is cancelled in the engine) and messages sent ahead are kept in order."""

    def __init__(self, ws: WebSocket):
        self.ws, self.queue = ws, asyncio.Queue()
        self.live = None  # the Stream being spoken, cancelled on disconnect
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                self.queue.put_nowait(msg)
        except (WebSocketDisconnect, RuntimeError):
            pass
        if self.live is not None:
            self.live.cancel()
        self.queue.put_nowait(None)

    async def next(self, timeout_s: float):
        return await asyncio.wait_for(self.queue.get(), timeout=timeout_s)


async def serve_ws(ws: WebSocket, engine: Engine, ctx: SpeechContext, config: ServeConfig) -> None:
    await ws.accept()
    reader = _Reader(ws)
    conf: dict[str, Any] = {}
    stream_audio = False
    buf: list[str] = []
    utterance = 0
    try:
        while True:
            try:
                raw = await reader.next(config.ws_idle_timeout_s)
            except asyncio.TimeoutError:
                await ws.close(code=1000, reason=f"idle for {config.ws_idle_timeout_s:g} s")
                return
            if raw is None:  # the client went away
                return
            try:
                msg = json.loads(raw.get("text") or "")
            except ValueError:
                msg = None
            kind = msg.get("type") if isinstance(msg, dict) else None
            if kind is None:
                await _err(ws, "messages must be JSON text objects with a 'type'; accepted types: "
                               + ", ".join(MESSAGE_TYPES))
                continue
            if kind == "session.config":
                if buf:
                    await _err(ws, "session.config while text is buffered: send input.done first (no input is "
                                   "dropped silently)")
                    continue
                new = {k: v for k, v in msg.items() if k not in ("type", "stream_audio")}
                sa = msg.get("stream_audio", False)
                if not isinstance(sa, bool):
                    await _err(ws, f"stream_audio must be true or false; got {sa!r}")
                    continue
                try:
                    new.pop("input", None)
                    parse_speech({**new, "input": "x", "stream_format": None, "stream": None}, ctx)
                except ApiError as e:
                    await _err(ws, e.message)
                    continue
                conf, stream_audio = new, sa
            elif kind == "input.text":
                text = msg.get("text")
                if not isinstance(text, str):
                    await _err(ws, f"input.text needs a string 'text'; got {type(text).__name__}")
                    continue
                if sum(map(len, buf)) + len(text) > config.max_input_chars:
                    await _err(ws, f"the buffered utterance would pass {config.max_input_chars} characters "
                                   f"(--max-input-chars); send input.done to speak what is buffered")
                    continue
                buf.append(text)
            elif kind == "input.done":
                text, buf = "".join(buf), []
                if text.strip():
                    await _speak(ws, engine, ctx, conf, stream_audio, text, utterance, reader)
                await ws.send_json({"type": "session.done", "utterance_index": utterance,
                                    "total_sentences": 1 if text.strip() else 0})
                utterance += 1
            elif kind == "session.close":
                await ws.close(code=1000)
                return
            else:
                await _err(ws, f"unknown message type {kind!r}; accepted: {', '.join(MESSAGE_TYPES)}")
    except WebSocketDisconnect:
        return
    finally:
        reader.task.cancel()


async def _err(ws: WebSocket, message: str) -> None:
    await ws.send_json({"type": "error", "message": message})


async def _speak(ws: WebSocket, engine: Engine, ctx: SpeechContext, conf: dict, stream_audio: bool, text: str,
                 utterance: int, reader: _Reader) -> None:
    head = {"utterance_index": utterance, "sentence_index": 0}
    try:
        req = parse_speech({**conf, "input": text, "stream": None, "stream_format": None}, ctx)
        stream = await engine.open(req)
    except ApiError as e:
        await _err(ws, e.message)
        await ws.send_json({"type": "audio.done", **head, "total_bytes": 0, "error": True})
        return
    reader.live = stream
    fmt = req.response_format if not stream_audio or req.response_format in ("pcm", "wav") else "pcm"
    await ws.send_json({"type": "audio.start", **head, "sentence_text": text, "format": fmt,
                        "sample_rate": req.sample_rate})
    total, status, error = 0, "aborted", False
    try:
        parts, rs, first = [], Resampler(req.sample_rate), True
        while (chunk := await stream.next_chunk()) is not None:
            if stream_audio:
                data = pcm16(rs(chunk.audio, last=chunk.is_last))
                if first and fmt == "wav":
                    data = wav_header(req.sample_rate) + data
                first = False
                await ws.send_bytes(data)
                total += len(data)
            else:
                parts.append(chunk.audio)
        if not stream_audio:
            data = encode(concat(parts), fmt, req.sample_rate)
            await ws.send_bytes(data)
            total = len(data)
        status = "ok"
    except ApiError as e:
        error, status = True, "server_error"
        await _err(ws, e.message)
    except (WebSocketDisconnect, RuntimeError, OSError):
        stream.cancel()
        raise WebSocketDisconnect(1006)
    finally:
        reader.live = None
        await stream.close(status)
    await ws.send_json({"type": "audio.done", **head, "total_bytes": total, "error": error})
