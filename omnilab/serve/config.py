"""``ServeConfig``: what ``omnilab serve`` runs and every cap it enforces (one frozen record, printed at start)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from omnilab.errors import InputError
from omnilab.paths import cache_dir

DEFAULT_PORT = 8091  # vLLM-Omni's speech server port


@dataclass(frozen=True)
class ServeConfig:
    """Server settings. Caps answer 400/413/429 naming the cap when a request goes over it."""
    model: str | None = None                 # checkpoint dir or hub id; None = the embedded tiny checkpoint
    host: str = "127.0.0.1"                  # loopback unless told otherwise
    port: int = DEFAULT_PORT
    api_key: str | None = None               # Bearer key on every route but /health (None: open)
    backend: str = "vllm"                    # one Pipeline; vLLM batches concurrent requests continuously
    deploy_profile: str | None = "auto"
    deploy: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    threads: int | None = None               # talker threads (None: the deploy profile's)
    max_concurrency: int = 4                 # requests generating at once (the engine's batch)
    max_queue: int = 16                      # requests waiting for a slot; beyond: 429
    max_input_chars: int = 4096              # `input` (and a WebSocket utterance) length cap
    max_new_tokens: int = 2048               # cap on a request's max_new_tokens (frames, 80 ms each)
    max_upload_bytes: int = 10 * 1024 * 1024  # voice upload and decoded ref_audio cap
    max_ref_audio_s: float = 60.0            # reference clip length cap
    voices_dir: str | None = None            # uploaded voices, one safetensors file each (None: $OMNILAB_CACHE/voices)
    allowed_media_dir: str | None = None     # file:// ref_audio must lie under it (None: file:// refused)
    drain_timeout_s: float = 30.0            # SIGTERM: how long in-flight requests may finish
    ws_idle_timeout_s: float = 300.0         # WebSocket closed after this long without a message
    served_model_name: str | None = None     # the `model` id answered in /v1/models (None: from the checkpoint)

    def __post_init__(self):
        for name in ("max_concurrency", "max_input_chars", "max_new_tokens", "max_upload_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"{name} must be an integer >= 1; got {v!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InputError(f"max_queue must be an integer >= 0; got {self.max_queue!r}")
        if self.backend not in ("vllm", "eager"):
            raise InputError(f"backend {self.backend!r} is not known; accepted: vllm, eager")
        if not (0 <= self.port <= 65535):
            raise InputError(f"port must be in [0, 65535]; got {self.port}")

    def voices_path(self) -> Path:
        """The directory of uploaded voices (created 0700 on first use)."""
        if self.voices_dir is not None:
            return Path(self.voices_dir)

        return Path(cache_dir()) / "voices"

    def replace(self, **kw) -> "ServeConfig":
        return dataclasses.replace(self, **kw)
