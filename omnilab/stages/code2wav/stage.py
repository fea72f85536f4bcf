"""The code2wav stage: offline decode and per-request streaming sessions with explicit state.

``Code2WavStage.decode(codes [T, 16]) -> audio`` decodes a whole utterance (the reference's
300-frame chunks with 25 frames of left context). ``open_session`` returns a ``Code2WavSession``
that turns successive code chunks into audio with exact decoder state carried between chunks,
so each chunk costs the same however long the utterance already is. ``prefix_codes`` (Base ICL
reference codes) are decoded first as context and their audio is dropped, as the reference does.

``Code2WavStage(decoder, threads=N)`` runs every decode on ``N`` torch threads (this process's count is
restored after each call): in-process, the deploy profile's ``code2wav_threads`` is applied this way.
``info()`` reports the pid and the threads the stage's calls run with (``pipe.check_profile()`` reads it).

``Code2WavStage(decoder, dtype=choice)`` sets the decoder's conv-decoder compute dtype first
(``Code2Wav.set_compute_dtype``; ``choice``: an ``omnilab.tuning.code2wav_dtype.Code2WavDtype`` or a torch dtype;
None leaves the decoder as given); ``info()["code2wav_dtype"]`` says which runs, ``info()["code2wav_conv"]`` the fp32
conv path (``OMNILAB_CODE2WAV_CONV``, read when the decoder is built).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Hashable

import numpy as np
import torch

from omnilab.config import CODEBOOK_SIZE, SAMPLES_PER_FRAME
from omnilab.errors import InputError
from omnilab.models.code2wav import Code2Wav
from omnilab.stages.code2wav.codes import codes_array


def _as_codes(codes, name: str = "codes", codebook_size: int = CODEBOOK_SIZE) -> torch.Tensor:
    """[T, 16] array-like -> LongTensor [1, 16, T] (``InputError`` for anything else: stages/code2wav/codes.py)."""
    return torch.from_numpy(codes_array(codes, name, codebook_size)).T[None].contiguous()


class Code2WavSession:
    """One request's streaming decoder. ``push(codes [F, 16]) -> float32 audio [F * 1920]``."""

    def __init__(self, stage: "Code2WavStage", request_id: Hashable, prefix_codes=None):
        self.stage = stage
        self.request_id = request_id
        self.state = stage.decoder.start_stream(1)
        self.frames_done = 0
        self.decode_ms: list[float] = []
        if prefix_codes is not None and len(prefix_codes):
            with stage.threads_context():
                stage.decoder.decode_chunk(self.state, _as_codes(prefix_codes, "prefix_codes", stage.codebook_size))

    @property
    def closed(self) -> bool:
        return self.state is None

    def push(self, codes) -> np.ndarray:
        if self.state is None:
            raise InputError(f"code2wav session {self.request_id!r} is closed")
        c = _as_codes(codes, "codes", self.stage.codebook_size)
        if c.shape[-1] == 0:
            return np.zeros(0, dtype=np.float32)
        t0 = time.perf_counter()
        with self.stage.threads_context():
            wav = self.stage.decoder.decode_chunk(self.state, c)[0, 0]
        self.decode_ms.append(1e3 * (time.perf_counter() - t0))
        self.frames_done += c.shape[-1]
        return wav.float().numpy().copy()

    def take_spans(self) -> list[dict[str, Any]]:
        return []  # decoded in this process: the pipeline records its own spans

    def close(self) -> None:
        if self.state is not None:
            self.state.free()
            self.state = None
            self.stage._sessions.pop(self.request_id, None)

    def __repr__(self) -> str:
        return f"Code2WavSession({self.request_id!r}, frames_done={self.frames_done}, closed={self.closed})"


class Code2WavStage:
    def __init__(self, decoder: Code2Wav, threads: int | None = None, dtype: Any = None):
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InputError(f"code2wav threads must be a positive integer or None; got {threads!r}")
        if dtype is not None:
            decoder.set_compute_dtype(getattr(dtype, "torch_dtype", dtype))
        self.decoder = decoder.eval().prepare()
        self.dtype = dtype
        self.threads = threads
        self._sessions: dict[Hashable, Code2WavSession] = {}

    @contextlib.contextmanager
    def threads_context(self):
        """Run the block on ``self.threads`` torch threads (None: this process's), then restore the count."""
        before = torch.get_num_threads()
        if self.threads is None or self.threads == before:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @property
    def codebook_size(self) -> int:
        return int(self.decoder.cfg.codebook_size)

    def processes(self) -> dict[int, str]:
        return {}  # runs in this process

    def take_spans(self) -> list[dict[str, Any]]:
        return []

    def info(self) -> dict[str, Any]:
        """``pid`` and ``torch_threads``: the threads this stage's decodes run with (in this process)."""
        return {"pid": os.getpid(), "torch_threads": self.threads or torch.get_num_threads(),
                "sessions": sorted(map(str, self._sessions)),
                "code2wav_dtype": str(self.decoder.compute_dtype).removeprefix("torch."),
                "code2wav_conv": self.decoder.conv_path.label}

    def decode(self, codes, prefix_codes=None) -> np.ndarray:
        """Whole-utterance decode of ``codes [T, 16]`` -> float32 audio ``[T * 1920]``."""
        c = _as_codes(codes, "codes", self.codebook_size)
        n_prefix = 0
        if prefix_codes is not None and len(prefix_codes):
            p = _as_codes(prefix_codes, "prefix_codes", self.codebook_size)
            n_prefix = p.shape[-1]
            c = torch.cat([p, c], dim=-1)
        if c.shape[-1] == 0:
            return np.zeros(0, dtype=np.float32)
        with self.threads_context():
            wav = self.decoder.decode(c)[0, 0]
        return wav[n_prefix * SAMPLES_PER_FRAME:].float().numpy().copy()

    def open_session(self, request_id: Hashable, prefix_codes=None) -> Code2WavSession:
        if request_id in self._sessions:
            raise InputError(f"a code2wav session for {request_id!r} is already open")
        s = Code2WavSession(self, request_id, prefix_codes)
        self._sessions[request_id] = s
        return s

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def close(self) -> None:
        for s in list(self._sessions.values()):
            s.close()
