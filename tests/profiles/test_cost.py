"""The planner's cost model (profiles/cost.py): bytes per frame as the decode path reads them, an effective bandwidth
from the path timing or the prior, a fixed per-frame part, code2wav's dtype as the code2wav rule picks it."""
from __future__ import annotations

from pathlib import Path

import pytest

from omnilab.hardware import probe_hardware
from omnilab.profiles import ModelGeometry, plan
from omnilab.profiles.cost import FRAME_FIXED_MS, Bandwidth, CostModel
from omnilab.profiles.timing import PathTimes

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"


def hw(name: str):
    return probe_hardware(FIX / f"{name}.json")


# The figures the constants were fitted on (2-core Xeon, one grid run, 0.6B, 2 threads; docs/profiles.md#cost-model):
# path timing 20.5 GB/s at 1 row, eager frames 132 ms unquantized (bf16 storage, fp32 compute) and 45.3 ms with every
# part int4 (today's int4-all; its scales were fp32 then, 0.5 + 4/128 bytes a weight against 0.5 + 2/128 now: 3 %).
MEASURED_GBPS, MEASURED_NONE_MS, MEASURED_INT4_MS = 20.5, 132.0, 45.3


@pytest.mark.parametrize("quantization,want", [("none", MEASURED_NONE_MS), ("int4-all-g128", MEASURED_INT4_MS)])
def test_the_timing_calibrated_estimate_reproduces_its_calibration(quantization, want):
    """From the measured bandwidth the model gives the two measured frames back within 10 % (a model with the
    wrong bytes per weight, e.g. 4 for fp32 compute, or without the fixed part, misses one of them by 25 % or more)."""
    cost = CostModel.build(ModelGeometry.released(), hw("spr_amx_snc2"), "float32", quantization=quantization,
                           bandwidth=Bandwidth(MEASURED_GBPS, 2, "test timing"))
    assert cost.talker_ms(2) == pytest.approx(want, rel=0.10)
    assert cost.fixed_ms == FRAME_FIXED_MS and "test timing: 20.5 GB/s at 2 thread(s)" in cost.source


def test_bytes_follow_the_stored_weights_not_the_compute_dtype():
    g, h = ModelGeometry.released(), hw("vm2_avx2")
    fp32, bf16 = (CostModel.build(g, h, d) for d in ("float32", "bfloat16"))
    int8, int4, int4_all = (CostModel.build(g, h, "float32", quantization=q)
                            for q in ("int8", "int4-g128", "int4-all-g128"))
    assert fp32.talker_ms_1 == pytest.approx(bf16.talker_ms_1)  # both read the bf16-stored matrices
    assert int8.talker_ms_1 == pytest.approx(fp32.talker_ms_1 / 2)
    assert int4_all.talker_ms_1 == pytest.approx(fp32.talker_ms_1 * (0.5 + 2 / 128) / 2)  # fp16 scales
    # the int4 recipe: int4 talker, int8 predictor (its 15 passes are most of the bytes)
    talker, predictor, decoder = g.streamed_params_by_part()
    assert int4.talker_ms_1 == pytest.approx(fp32.talker_ms_1 * (talker * (0.5 + 2 / 128) + predictor + decoder)
                                             / (2 * (talker + predictor + decoder)))
    assert int4_all.talker_ms_1 < int4.talker_ms_1 < int8.talker_ms_1
    assert "3.32 GB/frame" in fp32.source and "prior" in fp32.source


def test_the_planner_uses_the_path_timing_bandwidth():
    """200 MB read in 10 ms at one row is 20.0 GB/s: the plan's talker estimate is the cost model's at that figure
    (and the reason quotes it); without a timing the plan falls back to the ISA prior."""
    from omnilab.profiles.cost import bandwidth_from_times

    h = hw("vm2_avx2")
    times = PathTimes({"fp32-kernel": {1: 10.0, 4: 12.0}}, {"fp32": 5.0}, 200_000_000, 64, 2)
    bw = bandwidth_from_times(times)
    assert (bw.gbps, bw.threads) == (pytest.approx(20.0), 2)
    p = plan(h, env={}, path_times=times)
    timed = CostModel.build(ModelGeometry.released(), h, p.dtype.value, bandwidth=bw)
    assert p.estimate.talker_ms_per_frame == pytest.approx(timed.talker_ms(p.threads("talker")), rel=1e-6)
    assert "GEMV kernel from DRAM: 20.0 GB/s at 2 thread(s)" in p.talker_threads.reason
    q = plan(h, env={})
    prior = CostModel.build(ModelGeometry.released(), h, q.dtype.value)
    assert q.estimate.talker_ms_per_frame == pytest.approx(prior.talker_ms(q.threads("talker")), rel=1e-6)
    assert q.estimate.talker_ms_per_frame != pytest.approx(p.estimate.talker_ms_per_frame, rel=0.01)


def test_code2wav_estimate_uses_code2wavs_own_dtype_rule():
    """On AMX code2wav runs bf16 under auto even when the talker plans fp32 compute; the estimate says so, and follows
    ``OMNILAB_CODE2WAV_DTYPE`` and an explicit float32 request as the code2wav choice does."""
    h = hw("spr_amx_snc2")
    auto = plan(h, env={})
    assert "code2wav (bfloat16)" in auto.talker_threads.reason
    assert "code2wav (float32)" in plan(h, env={"OMNILAB_CODE2WAV_DTYPE": "float32"}).talker_threads.reason
    assert "code2wav (float32)" in plan(h, env={}, overrides={"dtype": "float32"}).talker_threads.reason
    assert "code2wav (float32)" in plan(hw("vm2_avx2"), env={}).talker_threads.reason  # no native bf16


def test_a_code2wav_chunk_costs_its_frames_plus_a_fixed_part():
    """omnilab's stateful decoder recomputes nothing, so a chunk costs its frames plus a fixed part (the decoder's
    weights read once). Measured on a 2-core AVX2-only EPYC (fp32, 2 threads, 0.6B decoder): a 1-frame chunk
    117.5 ms, a 25-frame chunk 1382 ms (115.9 / 1465.8 in another run). The model gives that ratio within 20 % (the
    earlier recompute model, 12 conv frames per chunk, put it at 0.39 instead of 0.08) and keeps the 25-frame
    per-frame figures its rates were fitted on within 10 %: that EPYC's 55.3 ms, a Xeon's fp32 33.7 ms and AMX bf16
    17.1 ms (docs/profiles.md#cost-model)."""
    g = ModelGeometry.released()
    avx2 = CostModel.build(g, hw("vm2_avx2"), "float32")
    assert avx2.chunk_ms(1, 2) / avx2.chunk_ms(25, 2) == pytest.approx(117.5 / 1382, rel=0.20)
    assert avx2.code2wav_ms_per_frame(2) == pytest.approx(1382 / 25, rel=0.10)
    for c2w, want in (("float32", 33.7), ("bfloat16", 17.1)):
        cost = CostModel.build(g, hw("spr_amx_snc2"), "float32", code2wav_dtype=c2w)
        assert cost.code2wav_ms_per_frame(2) == pytest.approx(want, rel=0.10)
    # the first chunk of a plan is what its TTFA estimate waits for: now a frame and a bit, not 15 frames of work
    p = plan(hw("vm2_avx2"), env={})
    assert p.first_chunk_frames.value == 1
    assert p.estimate.ttfa_ms < 3 * (p.estimate.talker_ms_per_frame + p.estimate.code2wav_ms_per_frame)
