"""Streaming support for code2wav: per-request state, chunk schedules, batched chunk decoding.

Contract:
- ``Code2WavState`` is the explicit state of one streaming request (or of ``batch_size`` requests
  that always advance together). It holds a fixed set of tensors whose shapes depend only on the
  decoder geometry and the batch size, never on how many frames were decoded, plus ``frames_done``.
  ``Code2Wav.decode_chunk`` advances it in place; ``reset()`` rewinds it to frame 0; ``free()``
  releases its tensors (a freed state can no longer be used).
- ``decode_chunks(model, states, codes)`` decodes one ready chunk for each of several states.
  States whose chunks have the same length are stacked along the batch dim and run as one batch
  (rows may be at different positions); the others run one by one. Results equal decoding each
  state alone, up to floating-point rounding.
- ``ChunkSchedule`` is plain Python (no torch): the sizes of successive chunks of one stream, by the one
  chunk rule in ``omnilab.profiles.cost`` (layer 1, plain Python; models may import it, profiles never
  import models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omnilab.errors import InputError
from omnilab.profiles.cost import check_chunks, chunk_frames, chunk_schedule


class Code2WavState:
    """State of one code2wav stream: conv left contexts and sliding-window KV caches.

    Attributes:
        batch_size: rows in every state tensor.
        frames_done: frames decoded so far (80 ms each); the next chunk starts at this position.
    """

    __slots__ = ("batch_size", "frames_done", "_buffers", "_owner")

    def __init__(self, buffers: dict[str, torch.Tensor], batch_size: int, owner: int, frames_done: int = 0):
        self._buffers = buffers
        self.batch_size = batch_size
        self.frames_done = frames_done
        self._owner = owner

    @property
    def is_freed(self) -> bool:
        return self._buffers is None

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Name -> tensor ``[B, ...]`` (read-only view for inspection; do not modify)."""
        self._check_live()
        return dict(self._buffers)

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every state tensor (constant for the life of the stream)."""
        self._check_live()
        return {k: tuple(v.shape) for k, v in self._buffers.items()}

    def num_bytes(self) -> int:
        self._check_live()
        return sum(v.numel() * v.element_size() for v in self._buffers.values())

    def reset(self) -> None:
        """Rewind to frame 0 (zero all state) without reallocating."""
        self._check_live()
        for v in self._buffers.values():
            v.zero_()
        self.frames_done = 0

    def free(self) -> None:
        """Release the state tensors; the stream is finished."""
        self._buffers = None

    def _check_live(self) -> None:
        if self._buffers is None:
            raise InputError("this Code2WavState was freed; start a new stream with Code2Wav.start_stream()")

    def __repr__(self) -> str:
        if self._buffers is None:
            return "Code2WavState(freed)"
        return (f"Code2WavState(batch_size={self.batch_size}, frames_done={self.frames_done}, "
                f"tensors={len(self._buffers)}, bytes={self.num_bytes()})")


def stack_states(states: Sequence[Code2WavState]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Concatenate the tensors of ``states`` along the batch dim.

    Returns ``(buffers, frames_done [sum B] long)``: per-row start positions.
    """
    for s in states:
        s._check_live()
    keys = states[0]._buffers.keys()
    buffers = {k: torch.cat([s._buffers[k] for s in states], dim=0) for k in keys}
    device = next(iter(buffers.values())).device
    frames_done = torch.tensor([s.frames_done for s in states for _ in range(s.batch_size)],
                               dtype=torch.long, device=device)
    return buffers, frames_done


def unstack_states(buffers: dict[str, torch.Tensor], states: Sequence[Code2WavState], frames: int) -> None:
    """Write stacked ``buffers`` back into ``states`` (each advanced by ``frames``)."""
    sizes = [s.batch_size for s in states]
    parts = {k: torch.split(v, sizes, dim=0) for k, v in buffers.items()}
    for i, s in enumerate(states):
        s._buffers = {k: p[i] for k, p in parts.items()}
        s.frames_done += frames


@torch.no_grad()
def decode_chunks(model, states: Sequence[Code2WavState], codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Decode one chunk per state; ``codes[i]`` is ``[B_i, 16, F_i]`` -> list of ``[B_i, 1, F_i * 1920]``.

    Chunks with equal ``F`` are batched together (states stacked); every state is advanced in place.
    """
    if len(states) != len(codes):
        raise InputError(f"decode_chunks: {len(states)} states but {len(codes)} code chunks")
    if len({id(s) for s in states}) != len(states):
        raise InputError("decode_chunks: the same state appears twice")
    out: list[torch.Tensor | None] = [None] * len(states)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(codes):
        groups.setdefault(int(c.shape[-1]), []).append(i)
    for n_frames, idx in groups.items():
        if len(idx) == 1 or n_frames == 0:
            for i in idx:
                out[i] = model.decode_chunk(states[i], codes[i])
            continue
        group = [states[i] for i in idx]
        for i in idx:
            model._check_state(states[i], codes[i])
        buffers, frames_done = stack_states(group)
        wav = model._decode_stream(torch.cat([codes[i] for i in idx], dim=0), buffers, frames_done)
        unstack_states(buffers, group, n_frames)
        for i, w in zip(idx, torch.split(wav, [s.batch_size for s in group], dim=0)):
            out[i] = w
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class ChunkSchedule:
    """Sizes (in frames) of successive streaming chunks: ``first_frames``, then ``ramp``, then
    ``steady_frames`` repeated. ``first_frames=0`` skips the first chunk (start with the ramp); no size is 0.
    The rule itself is :func:`omnilab.profiles.cost.chunk_schedule` (one copy, shared with the deploy profile).

    Example: ``ChunkSchedule(1, (2, 4, 8, 16), 25).sizes(60) == [1, 2, 4, 8, 16, 25, 4]``.
    """
    first_frames: int = 1
    ramp: tuple[int, ...] = ()
    steady_frames: int = 25

    def __post_init__(self):
        object.__setattr__(self, "ramp", tuple(int(r) for r in self.ramp))
        check_chunks(self.first_frames, self.ramp, self.steady_frames, InputError)

    def chunk_frames(self, index: int) -> int:
        """Size of chunk number ``index`` (0-based) of an unbounded stream."""
        return chunk_frames(self.first_frames, self.ramp, self.steady_frames, index)

    def sizes(self, total_frames: int) -> list[int]:
        """Chunk sizes covering ``total_frames``; the last chunk is cut short to fit."""
        if total_frames < 0:
            raise InputError(f"ChunkSchedule.sizes: total_frames must be >= 0, got {total_frames}")
        return chunk_schedule(self.first_frames, self.ramp, self.steady_frames, total_frames)
