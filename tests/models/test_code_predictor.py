"""Code predictor: KV-cached generate == no-cache recomputation; batching; projection; seeded sampling."""
import time

import pytest
import torch

from omnilab.models import tiny
from omnilab.models.decoder import run_stack
from omnilab.models.talker import Talker, init_random_
from omnilab.sampling import Warp

GREEDY = Warp(False, 1.0, 0, 1.0)
SAMPLE = Warp(True, 0.9, 50, 1.0)


def make(hidden=64, seed=0):
    cfg = tiny.config(hidden=hidden)
    t = Talker(cfg)
    init_random_(t, torch.Generator().manual_seed(seed))
    return cfg, t.eval()


def inputs(t, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t.hidden_size, generator=g)  # final-norm hidden: unit RMS
    c0 = torch.randint(0, 2048, (b,), generator=g)
    return h, t.model.codec_embedding(c0)


@torch.inference_mode()
def nocache_reference(cp, h, c0_embed, codes):
    """Re-run the whole growing sequence at every step (no KV cache), teacher-forced on ``codes``."""
    seq = [h, c0_embed]
    logits = []
    for j in range(15):
        if j > 0:
            seq.append(cp.model.codec_embedding[j - 1](codes[:, j - 1]))
        x = cp.small_to_mtp_projection(torch.stack(seq, dim=1))
        hid = run_stack(cp.model.layers, cp.model.norm, cp.rope, x, None)
        logits.append(cp.lm_head[j](hid[:, -1]).float())
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("hidden", [64, 96])  # 96: talker width != predictor width -> projection
def test_kv_cached_generate_equals_nocache_recomputation(hidden):
    _, t = make(hidden)
    cp = t.code_predictor
    h, c0e = inputs(t, 3)
    codes, logits = cp.generate(h, c0e, GREEDY, return_logits=True)
    assert codes.shape == (3, 15) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < 2048
    ref = nocache_reference(cp, h, c0e, codes)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(codes, ref.argmax(-1))


def test_batched_generate_matches_single_rows_greedy():
    _, t = make(seed=3)
    cp = t.code_predictor
    h, c0e = inputs(t, 4, seed=1)
    batched = cp.generate(h, c0e, GREEDY)
    singles = torch.cat([cp.generate(h[i:i + 1], c0e[i:i + 1], GREEDY) for i in range(4)])
    assert torch.equal(batched, singles)


def test_sampling_uses_per_row_generators():
    _, t = make(seed=4)
    cp = t.code_predictor
    h, c0e = inputs(t, 2, seed=2)

    def run(seeds):
        return cp.generate(h, c0e, SAMPLE, [torch.Generator().manual_seed(s) for s in seeds])

    a, b = run([1, 2]), run([1, 2])
    assert torch.equal(a, b)
    c = run([1, 99])
    assert torch.equal(a[0], c[0])       # row 0 does not depend on row 1's generator
    assert not torch.equal(a[1], c[1])
    # per-row warps: a greedy row next to a sampling row gives the greedy answer
    mixed = cp.generate(h, c0e, [GREEDY, SAMPLE], [None, torch.Generator().manual_seed(5)])
    assert torch.equal(mixed[0], cp.generate(h[:1], c0e[:1], GREEDY)[0])


def test_sampling_time_is_added_to_the_callers_timings(monkeypatch):
    """``sampling_ms`` adds the time spent choosing the 15 codes (not the decoder passes) to what the caller's dict
    holds: each sampling call made 2 ms slower adds at least 15 x 2 ms, and the sum stays within the call's wall."""
    import omnilab.models.code_predictor as cp_mod

    inner, calls = cp_mod.sample_rows, []

    def slow_sampling(*a, **k):
        calls.append(1)
        time.sleep(0.002)
        return inner(*a, **k)

    monkeypatch.setattr(cp_mod, "sample_rows", slow_sampling)
    _, t = make()
    h, c0e = inputs(t, 1)
    timings = {"sampling_ms": 5.0}  # an earlier frame's figure: added to, not replaced
    t0 = time.perf_counter()
    t.code_predictor.generate(h, c0e, SAMPLE, [torch.Generator().manual_seed(0)], timings)
    wall_ms = 1e3 * (time.perf_counter() - t0)
    assert len(calls) == 15
    assert 15 * 2.0 <= timings["sampling_ms"] - 5.0 <= wall_ms


def test_batched_rows_use_the_gemv_kernel_and_do_not_depend_on_batch_mates(monkeypatch):
    """4 decoding rows run omnilab's GEMV kernel in every pass (the first pass has 2 positions per row: 8
    rows); a row's logits are then bitwise the same whoever its batch mates are."""
    from omnilab.kernels import gemv

    if gemv.gemv_choice().mode != "omnilab":
        pytest.skip(f"kernel not in use here: {gemv.gemv_choice().reason}")
    _, t = make(96)  # with the talker->predictor projection
    cp = t.code_predictor
    h, c0e = inputs(t, 5)
    rows = []
    real = gemv._call
    monkeypatch.setattr(gemv, "_call", lambda *a: rows.append(a[-1]) or real(*a))
    codes_a, logits_a = cp.generate(h[:4], c0e[:4], GREEDY, return_logits=True)
    assert rows and set(rows) == {4, 8}
    other = [0, 1, 2, 4]  # same first three rows, another fourth
    codes_b, logits_b = cp.generate(h[other], c0e[other], GREEDY, return_logits=True)
    assert torch.equal(logits_a[:3], logits_b[:3]) and torch.equal(codes_a[:3], codes_b[:3])
    assert not torch.equal(logits_a[3], logits_b[3])


@pytest.mark.slow
def test_compiled_mlps_over_bf16_stored_matrices_give_the_same_codes():
    """``compile_mlps`` (OMNILAB_CPU_INDUCTOR) on a predictor whose matrices are stored in bf16: the compiled
    MLPs call the same bf16-weight linear (one opaque op), so logits and codes are bitwise unchanged."""
    from omnilab.kernels import gemv_choice
    from omnilab.stages.vllm.runner import compile_mlps
    from omnilab.tuning.storage import talker_streamed_name

    if gemv_choice().mode != "omnilab":
        pytest.skip("no GEMV kernel here")
    _, t = make(seed=5)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if talker_streamed_name(name):
                p.data = p.data.bfloat16()
    cp = t.code_predictor
    h, c0e = inputs(t, 2, seed=2)
    codes, logits = cp.generate(h, c0e, GREEDY, return_logits=True)
    assert compile_mlps(cp) == len(cp.model.layers)
    got_codes, got_logits = cp.generate(h, c0e, GREEDY, return_logits=True)
    assert torch.equal(got_codes, codes) and torch.equal(got_logits, logits)
