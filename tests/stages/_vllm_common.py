"""Helpers shared by the vLLM stage tests (requests for every variant, eager reference, stepping)."""
from __future__ import annotations

import numpy as np
import torch

from omnilab.stages.eager import run_to_completion
from omnilab.requests import UserRequest
from omnilab.sampling import SamplingParams
from omnilab.stages.eager import EagerTalkerStage

VARIANTS = ("custom_voice", "voice_design", "base")
TEXT = "Hello world, this is a test."


def _ref_audio():
    return (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32), 24000


def user_requests(kind: str) -> list[UserRequest]:
    if kind == "custom_voice":
        return [UserRequest(text=TEXT, speaker="vivian", language="english"),
                UserRequest(text="Second one here.", speaker="eric", non_streaming_mode=False)]
    if kind == "voice_design":
        return [UserRequest(text=TEXT, instruct="A deep calm voice.", language="english"),
                UserRequest(text="Another sentence to say.", instruct="Bright.", non_streaming_mode=False)]
    return [UserRequest(text=TEXT, ref_audio=_ref_audio(), x_vector_only_mode=True),
            UserRequest(text="Clone me now please.", ref_audio=_ref_audio(), ref_text="Some reference words."),
            UserRequest(text="Clone me now please.", ref_audio=_ref_audio(), ref_text="Some reference words.",
                        non_streaming_mode=True)]


def greedy(model, n: int = 10) -> SamplingParams:
    return SamplingParams.from_defaults(model.generation, do_sample=False, subtalker_do_sample=False,
                                        max_new_tokens=n)


def eager_codes(model, preq, params) -> torch.Tensor:
    stage = EagerTalkerStage(model)
    stage.add_request("r", preq, params)
    return run_to_completion(stage.engine)["r"]["codes"]


def vllm_run(stage, preq, params, rid="r"):
    """-> (codes [T, 16], outputs)."""
    stage.add_request(rid, preq, params)
    outs = []
    while stage.has_unfinished():
        outs += [o for o in stage.step() if o.request_id == rid]
    frames = [o.codes for o in outs if o.codes is not None]
    return (torch.stack(frames) if frames else torch.empty(0, 16, dtype=torch.long)), outs


def first_difference(model, codes, hidden, other, params) -> str:
    """Where ``other`` parts from the greedy ``codes`` (``hidden``: the final-norm states that produced them): the
    frame, the codebook and the reference model's top-2 margin there (codebook 0: its greedy scores; 1..15: the
    predictor's logits, fed the reference's codes)."""
    from omnilab.sampling import Warp, talker_scores

    n = min(len(codes), len(other))
    k = next((k for k in range(n) if not torch.equal(codes[k], other[k])), None)
    if k is None:
        return f"{len(codes)} vs {len(other)} frames, equal on the first {n}"
    i = int((codes[k] != other[k]).nonzero()[0, 0])
    talker = model.talker
    if i == 0:
        w = talker.codec_head.weight  # quantized: the values the kernel multiplies by
        w = w.dequantize() if hasattr(w, "dequantize") else w.detach().float()
        scores = talker_scores((hidden[k] @ w.T)[None], [codes[:k, 0]], [params],
                               model.config.talker.codec_eos_token_id)[0]
    else:
        h = hidden[k][None].to(talker.dtype)
        warp = Warp(do_sample=False, temperature=1.0, top_k=0, top_p=1.0)
        _, logits = talker.code_predictor.generate(h, talker.embed_codec(codes[k, :1]).to(talker.dtype), warp,
                                                   return_logits=True, forced=codes[k, 1:][None])
        scores = logits[0, i - 1]
    top = scores.topk(2).values
    return (f"frame {k} codebook {i}: {int(codes[k, i])} -> {int(other[k, i])}, reference top-2 margin "
            f"{float(top[0] - top[1]):.3g}")
