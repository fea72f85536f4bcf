"""Teacher forcing: one pipeline's talker and code predictor replayed on another run's frames.

docs/quality.md#teacher-forcing defines it.

Contract of :func:`teacher_force` for one request:

- Inputs: a :class:`~omnilab.models.talker.Talker` (any dtype, quantized or not), its config, the request's
  :class:`~omnilab.models.prompt.PromptRequest` (token ids; the same object for every pipeline compared), the
  reference frames ``codes`` ``[T, 16]`` int64, the greedy :class:`~omnilab.sampling.SamplingParams` the
  reference ran with, and ``stop_step`` (also score the step after the last frame, where the reference
  chose EOS).
- The talker sees the reference history only: the prompt is prefilled, then frame ``t``'s input vector is
  ``embed_frame(codes[t]) + text_track(prompt, t)`` (:mod:`omnilab.models.frame`), whatever the talker itself
  would have chosen. So the result always has exactly T frames: a test model that would diverge (or stop)
  when running free is still scored on every reference frame.
- Frame t's codebook-0 scores are ``talker_scores`` of the logits given frames ``< t``, with the reference's
  c0 history ``codes[:t, 0]`` (repetition penalty, ``min_new_tokens`` EOS mask, ids >= 2048 but EOS
  suppressed): the scores greedy decoding takes the argmax of. ``raw=True`` keeps the fp32 logits instead.
- Codebooks 1..15: ``CodePredictor.generate(h_t, C(codes[t, 0]), greedy, forced=codes[t, 1:])``: the
  predictor's argmax for codebook i given the reference's codes 0..i-1 of that frame.
- The operations, their order and their shapes are the eager engine's (:mod:`omnilab.stages.eager`: prefill
  logits over all prompt rows, one single-row cache, one decode step per frame), so replaying an eager greedy
  run on its own model returns its own codes exactly: the argmax of each step sees the same bits.

Plain torch; no vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnilab.config import Qwen3TTSConfig
from omnilab.errors import InputError, UnsupportedError
from omnilab.models import frame
from omnilab.models.prompt import PromptRequest, build_prompt
from omnilab.sampling import SamplingParams, talker_scores

__all__ = ["Forced", "forcing_talker", "teacher_force"]


@dataclass(frozen=True, eq=False)
class Forced:
    """What :func:`teacher_force` returns for one request of T reference frames."""
    c0_scores: torch.Tensor          # [T, V] fp32: codebook-0 scores of frame t given frames < t
    cp_argmax: torch.Tensor          # [T, 15] int64: code predictor argmax of codebook i given codes 0..i-1
    stop_scores: torch.Tensor | None  # [V] fp32: scores after the last frame (None without stop_step)
    cp_top1_prob: torch.Tensor | None = None  # [T, 15] fp32: softmax probability of the predictor's argmax

    @property
    def frames(self) -> int:
        return self.c0_scores.shape[0]

    @property
    def argmax(self) -> torch.Tensor:
        """``[T, 16]`` int64: the model's own greedy pick at every forced position."""
        return torch.cat([self.c0_scores.argmax(-1, keepdim=True), self.cp_argmax], dim=1)


def forcing_talker(pipe: Any):
    """The pipeline's talker modules in this process (``pipe.model.talker``), which teacher forcing runs eagerly.

    ``backend="eager"`` always holds them; ``backend="vllm"`` in-process holds the very object its engine runs
    (the worker is handed the client's talker when dtype and quantization agree, else it loads the same file
    through the same loader). With ``deploy="workers"`` the talker lives only in the worker process, so this
    raises :class:`~omnilab.errors.UnsupportedError`."""
    model = getattr(pipe, "model", None)
    talker = getattr(model, "talker", None)
    if talker is None:
        raise UnsupportedError(
            f"teacher forcing needs the talker loaded in this process, but {pipe!r} runs it in a worker process "
            "(backend='vllm', deploy='workers'); accepted: backend='eager', or backend='vllm' with "
            "deploy='inprocess'")
    return talker


@torch.inference_mode()
def teacher_force(talker, cfg: Qwen3TTSConfig, preq: PromptRequest, codes: torch.Tensor, params: SamplingParams,
                  *, stop_step: bool = False, raw: bool = False) -> Forced:
    """Replay ``codes`` ``[T, 16]`` through ``talker`` (see the module docstring for the contract)."""
    codes = torch.as_tensor(codes, dtype=torch.long)
    if codes.ndim != 2 or codes.shape[1] != 16:
        raise InputError(f"codes must be [T, 16] (T frames of 16 codebooks), got {tuple(codes.shape)}")
    if params.do_sample or params.subtalker_do_sample:
        raise InputError("teacher forcing scores greedy decoding: params need do_sample=False and "
                         "subtalker_do_sample=False")
    n = codes.shape[0]
    eos = cfg.talker.codec_eos_token_id
    vocab = cfg.talker.vocab_size
    codes = codes.to(talker.codec_head.weight.device)
    prompt = build_prompt(talker, cfg, preq)
    cache = talker.new_cache(len(prompt) + n + 1)
    hidden = talker(prompt.embeds[None], [cache])[0]  # [L, H]
    logits = talker.logits(hidden)[-1:]  # all L rows, as the eager engine computes them; [1, V]
    h = hidden[-1]
    c0_scores = torch.empty(n, vocab, dtype=torch.float32)
    cp_argmax = torch.empty(n, 15, dtype=torch.long)
    cp_prob = torch.empty(n, 15, dtype=torch.float32)
    warp = params.subtalker_warp
    codec = talker.model.codec_embedding
    stop = None
    for t in range(n + (1 if stop_step else 0)):
        scores = logits.float() if raw else talker_scores(logits, [codes[:t, 0]], [params], eos)  # [1, V]
        if t == n:
            stop = scores[0]
            break
        c0_scores[t] = scores[0]
        picks, cp_logits = talker.code_predictor.generate(h[None], codec(codes[t:t + 1, 0]), warp, [None],
                                                          forced=codes[t:t + 1, 1:], return_logits=True)
        cp_argmax[t] = picks[0]
        cp_prob[t] = torch.softmax(cp_logits[0], dim=-1).amax(-1)  # [15]
        if t + 1 < n or stop_step:  # the next frame's (or the stop step's) logits, given frames <= t
            x = talker.embed_frame(codes[t:t + 1]) + frame.text_track(prompt, t)[None]  # [1, H]
            h = talker(x[:, None], [cache])[0, 0]  # [H]
            logits = talker.logits(h[None])  # [1, V]
    return Forced(c0_scores, cp_argmax, stop, cp_prob)
