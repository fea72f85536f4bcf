"""The frame recurrence: talker hidden + c0 -> one 16-code frame -> the talker's next input vector.

Written once here and called by both talker engines (:class:`omnilab.stages.eager.EagerTalkerEngine` and the
vLLM runner :class:`omnilab.stages.vllm.runner.TalkerCPUModelRunner`), so their codes agree by construction
(docs/model.md#talker-step).

Contract of :func:`next_frames` for B live rows (B may be 0):

- Inputs: ``hidden`` ``[B, H]`` (the talker's final-norm hidden state that produced c0, compute dtype),
  ``c0`` ``[B]`` int64 (the sampled codebook-0 ids), per row its :class:`~omnilab.models.prompt.Prompt`
  (``trailing`` ``[N, H]``, ``tts_pad`` ``[H]``), its frame index ``k`` (0 for the first frame after the
  prefill), its :class:`~omnilab.sampling.SamplingParams` (``subtalker_warp`` is used) and its
  ``torch.Generator`` (None = the global RNG).
- Code predictor: ``CodePredictor.generate(hidden, C(c0))`` with ``C = talker.model.codec_embedding``, over
  all B rows in one batch, or one row at a time with ``per_row=True`` (then a row's codes and draws do not
  depend on its batch mates bit for bit: a GEMM over 1 row rounds differently from one over several).
  Each row's generator is drawn 15 times, in code order; the caller has already made the talker draw
  for c0, so the reference order (talker, then 15 sub-talker draws) holds per request.
- Output :class:`FrameStep`: ``codes`` ``[B, 16]`` int64 (c0 then c1..c15); ``inputs`` ``[b, H]`` for the
  ``b`` rows selected by ``need_input`` (default all; ``input_rows`` lists them, in order): the talker
  input of the next decode step, ``embed_frame(frame k) + trailing[k]``, or ``+ tts_pad`` once the
  trailing text queue is used up (``k >= N``); timings in ms (``predictor_ms`` includes ``sampling_ms``).

Plain torch; no vLLM. The ops and their order are the reference's, so greedy codes match the official
implementation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from omnilab.models.prompt import Prompt
from omnilab.sampling import SamplingParams

if TYPE_CHECKING:
    from omnilab.models.talker import Talker

__all__ = ["FrameStep", "next_frames", "text_track"]


@dataclass(frozen=True, eq=False)
class FrameStep:
    """What :func:`next_frames` returns (see the module docstring)."""
    codes: torch.Tensor                # [B, 16] int64
    inputs: torch.Tensor               # [b, H] next talker input vectors of input_rows
    input_rows: tuple[int, ...]        # the b rows (indices into B) that have an input vector
    predictor_ms: float = 0.0          # code predictor, sampling included
    input_ms: float = 0.0              # frame embeddings + text track
    sampling_ms: float = 0.0           # sub-talker sampling inside the predictor


def text_track(prompt: Prompt, frame_index: int) -> torch.Tensor:
    """The text-track vector ``[H]`` added to frame ``frame_index``'s input: ``trailing[k]``, else ``tts_pad``."""
    return prompt.trailing[frame_index] if frame_index < prompt.trailing.shape[0] else prompt.tts_pad


@torch.inference_mode()
def next_frames(talker: "Talker", hidden: torch.Tensor, c0: torch.Tensor, prompts: Sequence[Prompt],
                frame_indices: Sequence[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], *, per_row: bool = False,
                need_input: Sequence[bool] | None = None) -> FrameStep:
    """One frame per row and its next talker input vector (see the module docstring for the contract)."""
    b = hidden.shape[0]
    if not (c0.shape == (b,) and len(prompts) == len(frame_indices) == len(params) == len(generators) == b):
        raise ValueError(f"next_frames: hidden has {b} rows but c0 {tuple(c0.shape)}, {len(prompts)} prompts, "
                         f"{len(frame_indices)} frame indices, {len(params)} params, {len(generators)} generators")
    rows = tuple(range(b)) if need_input is None else tuple(i for i in range(b) if need_input[i])
    if b == 0:
        return FrameStep(torch.empty(0, 16, dtype=torch.long), hidden.new_empty(0, talker.hidden_size), ())

    # 1. code predictor on (h, C(c0)) -> c1..c15
    t0 = time.perf_counter()
    warps = [p.subtalker_warp for p in params]
    gens = list(generators)
    timings: dict[str, float] = {}
    cp, codec = talker.code_predictor, talker.model.codec_embedding
    if per_row:
        rest = torch.cat([cp.generate(hidden[i:i + 1], codec(c0[i:i + 1]), warps[i:i + 1], gens[i:i + 1], timings)
                          for i in range(b)])
    else:
        rest = cp.generate(hidden, codec(c0), warps, gens, timings)
    codes = torch.cat([c0[:, None], rest], dim=1)  # [B, 16]
    predictor_ms = 1e3 * (time.perf_counter() - t0)

    # 2. next talker input: sum of the 16 codebook embeddings + the text track
    t0 = time.perf_counter()
    if rows:
        emb = talker.embed_frame(codes[list(rows)])  # [b, H]
        inputs = emb + torch.stack([text_track(prompts[i], frame_indices[i]) for i in rows])
    else:
        inputs = hidden.new_empty(0, talker.hidden_size)
    input_ms = 1e3 * (time.perf_counter() - t0)
    return FrameStep(codes, inputs, rows, predictor_ms, input_ms, timings.get("sampling_ms", 0.0))
