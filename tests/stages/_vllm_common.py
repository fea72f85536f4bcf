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
