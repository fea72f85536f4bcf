"""ASGI responses for speech: a streamed body (raw audio or SSE events) and a gathered one, both watching the
connection so that a client that goes away ends its request in the engine at once (``Stream.cancel``)."""
from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
from starlette.responses import Response

from omnilab.serve.engine import Stream, concat
from omnilab.serve.speech import MEDIA_TYPES, SAMPLE_RATE, ApiError, SpeechRequest, encode, pcm16, wav_header


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class Resampler:
    """24 kHz chunks -> ``sample_rate`` without seams between chunks (soxr's streaming resampler)."""

    def __init__(self, sample_rate: int):
        self.rs = None
        if sample_rate != SAMPLE_RATE:
            import soxr

            self.rs = soxr.ResampleStream(SAMPLE_RATE, sample_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, audio: np.ndarray, last: bool = False) -> np.ndarray:
        if self.rs is None:
            return audio
        return self.rs.resample_chunk(np.ascontiguousarray(audio, dtype=np.float32), last=last)


class SpeechResponse(Response):
    """Runs one admitted ``Stream`` to the client: streamed (``stream_format`` audio / sse) or gathered. Status
    and headers are chosen as it runs (a gathered answer learns of an engine death before its status goes out)."""

    def __init__(self, stream: Stream, req: SpeechRequest):  # noqa: the base's body/headers are not used
        self.stream, self.req = stream, req
        self.background = None
        self.status_code = 200

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.Event()

        async def watch():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    self.stream.cancel()
                    return

        watcher = asyncio.create_task(watch())
        status = "aborted"
        try:
            if self.req.stream_format is None:
                status = await self._gathered(send, gone)
            else:
                status = await self._streamed(send, gone)
        except OSError:  # the client closed the connection under a send
            self.stream.cancel()
        finally:
            watcher.cancel()
            await self.stream.close(status)

    async def _gathered(self, send, gone: asyncio.Event) -> str:
        parts = []
        try:
            while (chunk := await self.stream.next_chunk()) is not None:
                parts.append(chunk.audio)
                if gone.is_set():
                    return "aborted"
        except ApiError as e:
            await _send_json(send, e.status, error_body(e.status, e.message, e.param))
            return "unavailable" if e.status == 503 else "client_error"
        if gone.is_set():
            return "aborted"
        body = encode(concat(parts), self.req.response_format, self.req.sample_rate)
        headers = {**self.stream.stats.headers(), "content-type": MEDIA_TYPES[self.req.response_format]}
        await _send_bytes(send, 200, headers, body)
        return "ok"

    async def _streamed(self, send, gone: asyncio.Event) -> str:
        req, st = self.req, self.stream.stats
        is_sse = req.stream_format == "sse"
        media = "text/event-stream" if is_sse else MEDIA_TYPES[req.response_format]
        headers = {"content-type": media, "cache-control": "no-cache", "x-request-id": st.request_id,
                   "x-omnilab-sample-rate": str(req.sample_rate)}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        rs = Resampler(req.sample_rate)
        first = True
        try:
            while (chunk := await self.stream.next_chunk()) is not None:
                if gone.is_set():
                    return "aborted"
                data = pcm16(rs(chunk.audio, last=chunk.is_last))
                if first and req.response_format == "wav":
                    data = wav_header(req.sample_rate) + data
                first = False
                if is_sse:
                    data = sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode(),
                                "response_format": req.response_format})
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except ApiError as e:
            if is_sse:
                await send({"type": "http.response.body", "more_body": False, "body": sse(
                    {"type": "speech.audio.error", "error": error_body(e.status, e.message, e.param)["error"]})})
            else:  # raw audio: the status is gone; end the body short and say why in a trailer-less way
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "unavailable" if e.status == 503 else "server_error"
        if gone.is_set():
            return "aborted"
        tail = b""
        if is_sse:
            tail = sse({"type": "speech.audio.done", "usage": st.usage(), "request_id": st.request_id,
                        "ttfa_ms": round(st.ttfa_ms, 1) if st.ttfa_ms is not None else None,
                        "rtf": round(st.rtf, 4) if st.rtf is not None else None,
                        "audio_duration_s": round(st.audio_s, 3)})
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return "ok"


async def _send_bytes(send, status: int, headers: dict[str, str], body: bytes) -> None:
    hdrs = [(k.encode(), v.encode()) for k, v in headers.items()] + [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send, status: int, obj: Any) -> None:
    headers = {"content-type": "application/json"}
    if status in (429, 503):
        headers["retry-after"] = "5"
    await _send_bytes(send, status, headers, json.dumps(obj).encode())
