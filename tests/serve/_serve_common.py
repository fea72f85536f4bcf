"""What the speech-server tests share: a uvicorn server on a free loopback port in a thread of this process (so
tests can look into its engine), its tiny configuration, the ``servers`` fixture, audio clips, slowed talker steps.

Test modules import the fixture (``from _serve_common import servers``): a ``tests/serve/conftest.py`` would
take the module name ``conftest`` from ``tests/conftest.py``, which other test modules import helpers from."""
from __future__ import annotations

import base64
import io
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
import uvicorn

from omnilab.serve import ServeConfig
from omnilab.serve.app import create_app

API_KEY = "test-key-123"
START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """``omnilab serve``'s app under uvicorn in a daemon thread; ``stop()`` shuts it down the way SIGTERM does."""

    def __init__(self, config: ServeConfig):
        self.config = config.replace(port=config.port or free_port())
        self.app = create_app(self.config)
        self.engine = self.app.state.engine
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.config.port,
                                                    log_level="warning", ws="websockets-sansio",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name=f"serve-{self.config.port}", daemon=True)

    def start(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended during start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not up within {START_TIMEOUT_S} s")
            time.sleep(0.05)
        return self

    def client(self, key: str | None = API_KEY, timeout_s: float = 120.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "the server thread did not end within 300 s"


def wait_idle(engine, timeout_s: float = 2.0) -> bool:
    """Wait until no request holds a slot or a talker request (a slot is freed just after the last byte)."""
    t0 = time.monotonic()
    while (engine.running or engine.pipe.talker.num_live) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.01)
    return not (engine.running or engine.pipe.talker.num_live)


def tiny_config(ckpt, tmp, **kw) -> ServeConfig:
    """Eager fp32, one thread (the test host is shared: OpenMP spinning on 2 busy cores costs seconds a frame)."""
    base = dict(model=str(ckpt), port=0, backend="eager", deploy_profile="none", dtype="float32", threads=1,
                api_key=API_KEY, max_input_chars=300, max_new_tokens=64, max_upload_bytes=400_000,
                max_concurrency=2, max_queue=2, voices_dir=str(tmp / "voices"), allowed_media_dir=str(tmp / "media"),
                served_model_name="tiny")
    base.update(kw)
    return ServeConfig(**base)


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    """``servers(variant) -> ThreadServer`` (eager, tiny), one per variant for the module; all stopped at its end."""
    made: dict[str, ThreadServer] = {}

    def get(variant: str = "custom_voice") -> ThreadServer:
        if variant not in made:
            tmp = tmp_path_factory.mktemp(f"serve-{variant}")
            (tmp / "media").mkdir()
            made[variant] = ThreadServer(tiny_config(tiny_ckpt(variant), tmp)).start()
        return made[variant]

    yield get
    for s in made.values():
        s.stop()


def clip_wav_bytes(seconds: float = 0.5, sr: int = 16000, fill: float | None = None) -> bytes:
    """A short WAV clip (a chirp; ``fill`` replaces every sample, e.g. NaN)."""
    t = np.arange(int(seconds * sr)) / sr
    wav = (0.3 * np.sin(2 * np.pi * (200 + 400 * t) * t)).astype(np.float32)
    if fill is not None:
        wav[:] = fill
    buf = io.BytesIO()
    sf.write(buf, wav, sr, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(raw).decode()


class SlowSteps:
    """Within ``with SlowSteps(engine, delay_s) as ends:`` every talker step takes ``delay_s`` more and appends
    its end time (``time.perf_counter()``) to ``ends``."""

    def __init__(self, engine, delay_s: float):
        self.talker, self.delay_s, self.ends = engine.pipe._talker, delay_s, []

    def __enter__(self) -> list[float]:
        orig = self.orig = self.talker.step

        def step(*a, **kw):
            out = orig(*a, **kw)
            time.sleep(self.delay_s)
            self.ends.append(time.perf_counter())
            return out

        self.talker.step = step
        return self.ends

    def __exit__(self, *exc) -> None:
        del self.talker.step  # the instance attribute goes; the class's method shows again
