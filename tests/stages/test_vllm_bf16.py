"""Eager vs vLLM under bf16 compute, on the confident tiny checkpoint (docs/quality.md#eager-and-vllm-under-bf16).

In bf16 the two backends' kernels round differently (vLLM's paged attention and batched prefill against eager's).
On plain random weights, whose decisions are near-ties, free-running greedy codes part after a few frames; on a
confident checkpoint (docs/quality.md#confident-random-checkpoints) the decisions' margins are far above that
rounding, and the codes are identical: asserted for 3 texts x 16 frames, free running, and one step at a time
(``compare(vllm_pipe, eager_pipe)`` replays the eager talker and code predictor on the engine's frames:
``replay_agreement`` 1). A difference names its frame, codebook and the replayed top-2 margin. bf16 is forced
(``dtype="bfloat16"``), so the test runs on any x86 CPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from _deps import need  # noqa: E402

need("vllm")

from omnilab.pipeline import Pipeline  # noqa: E402
from omnilab.quality import compare, reference  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEXTS = ["Hello world, this is a test.", "Second one here.", "Sentence number 1 for the thread test."]
GEN = dict(speaker="vivian", language="english", max_new_tokens=17)  # 16 frames


def _first_difference(codes: np.ndarray, other: np.ndarray, forced) -> str:
    """The first differing frame and codebook, and the replayed reference's margin there."""
    n = min(len(codes), len(other))
    k = next((k for k in range(n) if not np.array_equal(codes[k], other[k])), None)
    if k is None:
        return f"{len(codes)} vs {len(other)} frames"
    i = int(np.flatnonzero(codes[k] != other[k])[0])
    if i == 0:
        top = forced.c0_scores[k].topk(2).values
        how = f"top-2 margin {float(top[0] - top[1]):.3g}"
    else:
        how = f"top-1 probability {float(forced.cp_top1_prob[k, i - 1]):.3g}"
    return f"frame {k} codebook {i}: {int(codes[k, i])} -> {int(other[k, i])}, vLLM's replayed {how}"


def test_bf16_eager_and_vllm_give_identical_greedy_codes(confident_tiny):
    ck = confident_tiny("custom_voice")
    with Pipeline.from_pretrained(ck, backend="eager", dtype="bfloat16", deploy_profile=None) as eager, \
            Pipeline.from_pretrained(ck, backend="vllm", dtype="bfloat16", deploy_profile=None,
                                     deploy=dict(max_model_len=256, block_size=32)) as vllm_pipe:
        assert str(eager.model.dtype) == str(vllm_pipe.model.dtype) == "torch.bfloat16"
        run = reference(vllm_pipe, TEXTS, **GEN)  # the engine's greedy frames, replayed
        for text, (res, _, _, forced) in zip(TEXTS, run.items):
            mine = eager.generate(text, do_sample=False, subtalker_do_sample=False, **GEN).codes
            assert res.codes.shape == (GEN["max_new_tokens"] - 1, 16)
            assert np.array_equal(mine, res.codes), f"{text!r}: {_first_difference(res.codes, mine, forced)}"
        rep = compare(run, eager)
    rows = rep.rows
    assert (rows["replay_agreement"] == 1.0).all(), rows[["text", "replay_agreement"]]
    assert (rows["c0_agreement"] == 1.0).all() and (rows["cp_agreement"] == 1.0).all()
