"""The FastAPI app of ``omnilab serve``: vLLM-Omni's speech routes over one ``Engine`` (docs/serving.md)."""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, Response

from omnilab.errors import InputError
from omnilab.serve.config import ServeConfig
from omnilab.serve.engine import Engine
from omnilab.serve.metrics import CONTENT_TYPE_LATEST
from omnilab.serve.page import PAGE_HTML
from omnilab.serve.responses import SpeechResponse, error_body
from omnilab.serve.speech import ApiError, SpeechContext, parse_speech, read_audio_bytes
from omnilab.serve.voices import VoiceStore
from omnilab.serve.ws import serve_ws

log = logging.getLogger("omnilab.serve")
OPEN_PATHS = ("/health",)
KEY_QUERY_PATHS = ("/", "/v1/audio/speech/stream")  # a browser cannot set headers there: ?api_key= accepted
BODY_SLACK_BYTES = 64 * 1024


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class AuthMiddleware:
    """Bearer ``api_key`` on every route but /health (HTTP and WebSocket); constant-time comparison."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if self.api_key is None or scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if given is None and scope["path"] in KEY_QUERY_PATHS:
            from urllib.parse import parse_qs

            given = (parse_qs(scope.get("query_string", b"").decode()).get("api_key") or [None])[0]
        if given is not None and hmac.compare_digest(given.encode(), self.api_key.encode()):
            return await self.app(scope, receive, send)
        msg = ("missing API key: send Authorization: Bearer <key>" if given is None
               else "invalid API key in Authorization: Bearer <key>")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": msg})
            return
        resp = _error(401, msg, headers={"www-authenticate": "Bearer"})
        await resp(scope, receive, send)


def speech_context(config: ServeConfig, engine: Engine, voice_clip) -> SpeechContext:
    """What parsing a request needs from this server (``voice_clip``: uploaded voice name -> clip or None)."""
    return SpeechContext(
        model_type=engine.model_type, model_names=_model_names(config, engine),
        max_input_chars=config.max_input_chars, max_new_tokens=config.max_new_tokens,
        max_upload_bytes=config.max_upload_bytes, allowed_media_dir=config.allowed_media_dir, voice_clip=voice_clip,
        default_voice=("vivian" if "vivian" in engine.speakers else (engine.speakers or [None])[0]))


def create_app(config: ServeConfig, engine: Engine | None = None) -> FastAPI:
    """The app; its lifespan builds the pipeline (unless ``engine`` is given ready) and closes it at shutdown."""
    engine = engine or Engine(config)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine.pipe is None:
            await anyio.to_thread.run_sync(engine.start)
        store = VoiceStore(config.voices_path(), reserved=tuple(engine.speakers))
        for name, why in store.skipped.items():
            log.warning("voice file %s not loaded: %s", name, why)
        state["voices"] = store
        state["ctx"] = speech_context(config, engine, store)
        log.warning("omnilab serve: %s (%s) on http://%s:%s", engine.model_name, engine.model_type, config.host,
                    config.port)
        try:
            yield
        finally:
            await _drain(engine, config.drain_timeout_s)
            await anyio.to_thread.run_sync(engine.close)

    app = FastAPI(title="omnilab speech server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine = engine
    app.state.serve = state
    app.add_middleware(AuthMiddleware, api_key=config.api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        engine.metrics.count("unavailable" if e.status == 503 else "client_error")
        return _error(e.status, e.message, e.param, headers={"retry-after": "5"} if e.status in (429, 503) else None)

    @app.get("/health")
    async def health():
        if engine.state == "ready":
            return {"status": "ok"}
        return JSONResponse({"status": engine.state, "error": engine.error}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": int(state.get("t0", time.time())),
            "owned_by": "omnilab", "task_type": _task_name(engine.model_type)}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/audio/voices")
    async def list_voices():
        store: VoiceStore = state["voices"]
        return {"voices": engine.speakers + store.names(), "uploaded_voices": [c.info() for c in store.all()],
                "languages": engine.languages, "task_type": _task_name(engine.model_type)}

    @app.post("/v1/audio/voices")
    async def upload_voice(request: Request):
        cap = config.max_upload_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cap + BODY_SLACK_BYTES:
            raise ApiError(413, f"the upload has {length} bytes; at most {cap} of audio (--max-upload-bytes)",
                           "audio_sample")
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise ApiError(400, f"POST /v1/audio/voices takes multipart/form-data (audio_sample, consent, name, "
                                f"ref_text, speaker_description); got content-type {ctype or 'none'!r}")
        body = await _read_body(request, cap + BODY_SLACK_BYTES, "audio_sample")
        form = await _parse_form(request, body)
        try:
            allowed = {"audio_sample", "consent", "name", "ref_text", "speaker_description"}
            unknown = sorted(set(form.keys()) - allowed)
            if unknown:
                raise ApiError(400, f"unknown form field(s) {unknown}; accepted: {', '.join(sorted(allowed))}")
            f = form.get("audio_sample")
            if f is None or isinstance(f, str):
                raise ApiError(400, "audio_sample is required: an audio file (wav, flac, ogg)", "audio_sample")
            raw = await f.read()
            if len(raw) > cap:
                raise ApiError(413, f"audio_sample has {len(raw)} bytes; at most {cap} (--max-upload-bytes)",
                               "audio_sample")
            fields = {}
            for k in ("consent", "name", "ref_text", "speaker_description"):
                v = form.get(k)
                if v is not None and not isinstance(v, str):
                    raise ApiError(400, f"{k} must be a text field, not a file", k)
                fields[k] = v
            for k in ("consent", "name"):
                if not fields[k]:
                    raise ApiError(400, f"{k} is required", k)
            wav, sr = read_audio_bytes(raw, "audio_sample")
            if len(wav) / sr > config.max_ref_audio_s:
                raise ApiError(400, f"audio_sample is {len(wav) / sr:.1f} s long; at most {config.max_ref_audio_s:g} s",
                               "audio_sample")
            audio = await anyio.to_thread.run_sync(_clip_24k, wav, sr)
            clip = state["voices"].add(fields["name"], audio, 24000, consent=fields["consent"],
                                       mime_type=f.content_type or "application/octet-stream", file_size=len(raw),
                                       ref_text=fields["ref_text"], speaker_description=fields["speaker_description"])
        finally:
            await form.close()
        return {"success": True, "voice": clip.info()}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str):
        state["voices"].delete(name)
        return {"success": True, "message": f"Voice {name!r} deleted successfully"}

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        body = await _read_body(request, config.max_upload_bytes * 4 // 3 + BODY_SLACK_BYTES, "ref_audio")
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON ({e.msg if hasattr(e, 'msg') else e}); send a JSON "
                                "object with at least \"input\"") from None
        req = await anyio.to_thread.run_sync(parse_speech, obj, state["ctx"])
        stream = await engine.open(req)
        return SpeechResponse(stream, req)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_ws(ws: WebSocket):
        await serve_ws(ws, engine, state["ctx"], config)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE_HTML)

    state["t0"] = time.time()
    return app


def _task_name(model_type: str) -> str:
    return {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}.get(model_type, model_type)


def _model_names(config: ServeConfig, engine: Engine) -> tuple[str, ...]:
    names = [engine.model_name]
    if config.model:
        names += [config.model, Path(str(config.model).rstrip("/")).name]
    return tuple(dict.fromkeys(names))


def _clip_24k(wav, sr: int):
    """The pipeline's own reference-audio reader: mono mix, finite check, resampling to 24 kHz."""
    from omnilab.audio import load_audio  # lazy: torch

    try:
        return load_audio(wav, sr=sr)
    except InputError as e:
        raise ApiError(400, f"audio_sample: {e}", "audio_sample") from None


async def _read_body(request: Request, cap: int, param: str) -> bytes:
    """The request body, refused with 413 as soon as it passes ``cap`` bytes."""
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > cap:
            raise ApiError(413, f"the request body passes {cap} bytes, the most this server reads "
                                f"(--max-upload-bytes {request.app.state.engine.config.max_upload_bytes})", param)
        parts.append(part)
    return b"".join(parts)


async def _parse_form(request: Request, body: bytes):
    """Parse multipart ``body`` (already read under the cap) with Starlette's parser."""
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def once():
        yield body
        yield b""
    try:
        return await MultiPartParser(request.headers, once(), max_files=2, max_fields=10).parse()
    except MultiPartException as e:
        raise ApiError(400, f"the multipart body cannot be read: {e.message}") from None


async def _drain(engine: Engine, timeout_s: float) -> None:
    """Shutdown: let in-flight requests finish for up to ``timeout_s``, then end the rest in the engine."""
    engine.state = "closed" if engine.state == "ready" else engine.state
    deadline = time.monotonic() + timeout_s
    while engine.live_streams() and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    for s in engine.live_streams():
        s.cancel()
