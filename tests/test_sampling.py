"""Sampling parameters and talker/sub-talker logits processing (HF generate semantics)."""
import math

import pytest
import torch

from omnilab.config import GenerationDefaults
from omnilab.errors import InputError
from omnilab.sampling import SamplingParams, Warp, sample_rows, suppress_mask, talker_scores, warp_scores

EOS = 2150


def test_from_defaults_and_overrides():
    d = GenerationDefaults(max_new_tokens=8192, temperature=0.7)
    p = SamplingParams.from_defaults(d, top_k=None, subtalker_dosample=False, seed=3)
    assert p.temperature == 0.7 and p.top_k == 50 and p.max_new_tokens == 8192
    assert p.subtalker_do_sample is False and p.seed == 3 and p.min_new_tokens == 2
    with pytest.raises(InputError, match="temprature"):
        SamplingParams.from_defaults(d, temprature=1.0)


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=0.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(subtalker_temperature=-1.0), "subtalker_temperature"), (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(subtalker_top_p=1.5), "subtalker_top_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=101), r"max_new_tokens must be an integer in \[1, 100\]"),
    (dict(min_new_tokens=-1), "min_new_tokens"), (dict(seed=-5), "seed"), (dict(do_sample="yes"), "do_sample"),
    (dict(top_k=2.5), "top_k"),
])
def test_validate_names_field_and_range(kw, field):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{"max_new_tokens": 50, **kw}).validate(100)
    SamplingParams(max_new_tokens=50).validate(100)  # the defaults are valid


def test_talker_scores_suppression_min_tokens_and_penalty():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3072, generator=g)
    p = SamplingParams(repetition_penalty=2.0, min_new_tokens=2)
    hist = [[5, 7, 5], [9]]
    s = talker_scores(logits, hist, [p, p], EOS)
    allowed = ~suppress_mask(3072, EOS)
    assert torch.all(torch.isinf(s[:, 2048:][:, torch.arange(2048, 3072) != EOS]))
    assert allowed.sum() == 2049
    assert torch.isfinite(s[0, EOS]) and torch.isinf(s[1, EOS])  # row 1 generated 1 < 2 tokens
    for row, ids in enumerate(hist):
        for i in set(ids):  # penalised once: positive / 2, negative * 2
            v = logits[row, i]
            assert s[row, i] == (v * 2.0 if v < 0 else v / 2.0)
    untouched = [i for i in range(2048) if i not in (5, 7)]
    assert torch.equal(s[0, untouched], logits[0, untouched])  # nothing else (no prompt ids) penalised
    assert logits.dtype == torch.float32 and not torch.equal(s, logits)  # input not modified in place


def test_suppressed_ids_and_masked_eos_are_never_sampled():
    logits = torch.zeros(64, 3072)
    logits[:, 2048:] = 50.0  # control ids look very likely
    params = [SamplingParams(top_k=0, temperature=1.0, min_new_tokens=2)] * 64
    scores = talker_scores(logits, [[1]] * 64, params, EOS)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    toks = sample_rows(scores, [p.talker_warp for p in params], gens)
    assert int(toks.max()) < 2048
    scores = talker_scores(logits, [[1, 2]] * 64, params, EOS)  # EOS allowed after 2 tokens
    toks = sample_rows(scores, [p.talker_warp for p in params], gens)
    assert torch.all(toks == EOS)


def test_greedy_is_argmax_and_seeds_reproduce():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 2048, generator=g)
    greedy = Warp(False, 0.9, 50, 1.0)
    assert torch.equal(sample_rows(scores, [greedy] * 3, [None] * 3), scores.argmax(-1))
    w = Warp(True, 0.9, 50, 1.0)
    draw = lambda seed: sample_rows(scores, [w] * 3, [torch.Generator().manual_seed(seed + i) for i in range(3)])  # noqa
    assert torch.equal(draw(10), draw(10))
    assert not all(torch.equal(draw(10), draw(s)) for s in range(11, 15))
    top1 = Warp(True, 1.0, 1, 1.0)
    assert torch.equal(sample_rows(scores, [top1] * 3, [torch.Generator()] * 3), scores.argmax(-1))


def test_warpers_follow_hf_order():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    out = warp_scores(scores, Warp(True, 2.0, 3, 1.0))
    assert torch.allclose(out[0, :3], scores[0, :3] / 2.0) and torch.all(torch.isinf(out[0, 3:]))
    # top_p keeps the smallest set reaching p (the top token alone holds ~64% here)
    out = warp_scores(scores, Warp(True, 1.0, 0, 0.5))
    assert torch.isfinite(out[0, 0]) and torch.all(torch.isinf(out[0, 1:]))
    out = warp_scores(scores, Warp(True, 1.0, 0, 0.9))
    probs = torch.softmax(scores, -1)[0]
    kept = torch.isfinite(out[0])
    assert kept[:3].all() and probs[:2].sum() < 0.9 <= probs[:3].sum() + 1e-6
    assert math.isinf(float(out[0, 4]))
