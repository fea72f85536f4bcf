"""``omnilab.quality.compare`` (omnilab/quality/run.py, report.py) on tiny random checkpoints.

Exact equalities below hold by construction, not by luck of one CPU's rounding: two pipelines loaded from one
file with one loader run the same kernels on the same values with the same shapes and threads in this process,
so their scores are the same bits; an all-zero head gives all-equal logits, whose argmax is id 0 on every CPU.
Quantized pipelines are checked only for what is sound on random weights (ranges, shapes, frame counts)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from _deps import need  # noqa: E402
import torch

from omnilab.errors import ConfigError, InputError
from omnilab.quality import QualityReport, ReferenceRun, compare, reference
from omnilab.quality.report import wilson_interval

from _quality_common import GEN, TEXTS, load_pipe, eos_pipe  # noqa: F401  (fixtures)

FRAMES = GEN["max_new_tokens"] - 1  # a length-limited greedy run yields max_new_tokens - 1 frames


def _assert_identical(rep: QualityReport, n: int):
    assert len(rep) == n and list(rep.rows["frames"]) == [FRAMES] * n
    for col in ("c0_agreement", "cp_agreement", "replay_agreement"):
        assert list(rep.rows[col]) == [1.0] * n, col
    assert list(rep.rows["c0_kl_mean"]) == [0.0] * n and list(rep.rows["c0_kl_max"]) == [0.0] * n
    assert all(cb == [1.0] * 15 for cb in rep.rows["cp_agreement_by_codebook"])
    assert all(math.isinf(v) and v > 0 for v in rep.rows["wave_snr_db"])  # same decoder, same codes
    assert rep.summary() == {"c0_agreement": 1.0, "c0_kl_mean": 0.0, "cp_agreement": 1.0,
                             "wave_snr_db": math.inf, "requests": n, "frames": n * FRAMES,
                             "c0_agreement_ci95": wilson_interval(n * FRAMES, n * FRAMES)}


def test_a_pipeline_compared_with_itself_agrees_exactly(tiny_pipe):
    rep = compare(tiny_pipe, tiny_pipe, TEXTS, **GEN)
    _assert_identical(rep, 2)
    assert list(rep.rows["text"]) == TEXTS and list(rep.rows["stop_agreement"]) == [None, None]
    assert "c0 agreement 1 (95 % 0.785-1.000)," in repr(rep) and "ref=eager float32" in repr(rep)
    html = rep._repr_html_()
    assert "<table>" in html and "c0_kl_mean" in html and "Hello world" in html
    assert rep.by_codebook().shape == (2, 15) and set(rep.seconds) == {"reference", "forcing", "decode", "total"}


def test_an_identical_second_load_agrees_exactly(tiny_pipe, load_pipe):
    _assert_identical(compare(tiny_pipe, load_pipe(), TEXTS[:1], **GEN), 1)


def test_base_icl_with_reference_codes_agrees_with_itself(load_pipe):
    pipe = load_pipe("base")
    wav = (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)
    rep = compare(pipe, pipe, TEXTS[:1], ref_audio=(wav, 24000), ref_text="Some reference words.",
                  max_new_tokens=GEN["max_new_tokens"])
    _assert_identical(rep, 1)  # the SNR decodes with the reference codes as prefix on both sides


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_against_fp32_gives_sound_values(tiny_pipe, load_pipe, method):
    test = load_pipe(quantization=method)
    rep = compare(tiny_pipe, test, TEXTS, **GEN)
    assert method in rep.test and len(rep) == len(TEXTS)
    assert list(rep.rows["frames"]) == [FRAMES] * len(TEXTS)  # the reference's frames, all scored
    for col in ("c0_agreement", "cp_agreement", "replay_agreement"):
        assert all(0.0 <= v <= 1.0 for v in rep.rows[col]), col
    assert all(0.0 <= v < math.inf for v in rep.rows["c0_kl_mean"])
    assert all(len(cb) == 15 and all(0.0 <= x <= 1.0 for x in cb) for cb in rep.rows["cp_agreement_by_codebook"])
    # quantization touches only the talker's decode matrices: code2wav has the same fp32 weights on both sides, but
    # the deploy profile may give it another thread count (fp32 sums in another order: ~1e-6 relative error, 109 dB
    # measured on "mid"), so a bound, not inf
    assert all(v > 60.0 for v in rep.rows["wave_snr_db"])
    s = rep.summary()
    assert s["c0_agreement"] == pytest.approx(float(np.mean(rep.rows["c0_agreement"])), abs=1e-12)


def test_a_broken_test_pipeline_scores_low(tiny_pipe, load_pipe):
    """Zeroed heads give all-equal logits, so the test's argmax is id 0 everywhere: agreement is then exactly the
    fraction of reference codes that are 0 (low), and KL(ref || uniform) > 0."""
    test = load_pipe()
    with torch.no_grad():
        test.model.talker.codec_head.weight.zero_()
        for head in test.model.talker.code_predictor.lm_head:
            head.weight.zero_()
    codes = torch.as_tensor(tiny_pipe.generate(TEXTS[0], do_sample=False, subtalker_do_sample=False, **GEN).codes)
    rep = compare(tiny_pipe, test, TEXTS[:1], **GEN)
    row = rep.rows.iloc[0]
    assert row["c0_agreement"] == float((codes[:, 0] == 0).double().mean()) < 0.5
    assert row["cp_agreement_by_codebook"] == [float(x) for x in (codes[:, 1:] == 0).double().mean(0)]
    assert row["cp_agreement"] < 0.5 and row["c0_kl_mean"] > 0.0


def test_teacher_forcing_scores_every_reference_frame_of_a_diverging_model(tiny_pipe, eos_pipe):
    free = eos_pipe.generate(TEXTS[0], do_sample=False, subtalker_do_sample=False, **GEN)
    assert free.finish_reason == "eos" and len(free.codes) == 2  # running free it stops after 2 frames
    rep = compare(tiny_pipe, eos_pipe, TEXTS[:1], **GEN)
    row = rep.rows.iloc[0]
    assert row["frames"] == FRAMES  # forced along all the reference's frames anyway
    # frames 0-1: EOS is masked (min_new_tokens), the scores are the reference's; from frame 2 on it picks EOS
    assert row["c0_agreement"] == 2 / FRAMES and row["c0_kl_max"] > 1.0
    assert row["cp_agreement"] == 1.0  # same code predictor, fed the reference's codes


def test_per_text_lists_and_raw_scores(tiny_pipe):
    rep = compare(tiny_pipe, tiny_pipe, TEXTS, speaker=["vivian", "ryan"], max_new_tokens=5, c0_scores="raw")
    assert rep.c0_scores == "raw" and list(rep.rows["frames"]) == [4, 4] and rep.summary()["c0_agreement"] == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(c0_scores="softmax"), "accepted: processed, raw"),
    (dict(do_sample=True), "do_sample=True.*accepted: False"),
    (dict(subtalker_do_sample=True), "subtalker_do_sample"),
    (dict(speaker=["vivian"]), "list of 1 values but there are 2 texts"),
])
def test_bad_arguments_name_the_value_and_the_accepted_ones(tiny_pipe, kwargs, match):
    with pytest.raises(InputError, match=match):
        compare(tiny_pipe, tiny_pipe, TEXTS, **{**GEN, **kwargs})


def test_empty_texts_and_mismatched_models_are_refused(tiny_pipe, load_pipe):
    with pytest.raises(InputError, match="texts is empty"):
        compare(tiny_pipe, tiny_pipe, [], **GEN)
    with pytest.raises(ConfigError, match="one model geometry.*voice_design"):
        compare(tiny_pipe, load_pipe("voice_design"), TEXTS, **GEN)


@pytest.mark.vllm
def test_a_vllm_reference_is_teacher_forced_through_its_client_modules(tiny_ckpt, tiny_pipe):
    """In-process vLLM runs the client's own Talker object, so forcing it equals forcing the eager load; its greedy
    codes equal eager's (tests/stages/test_vllm_talker.py), so the replay agreement is 1.0 as well."""
    need("vllm")
    from omnilab.pipeline import Pipeline

    with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="vllm", deploy_profile=None, dtype="float32",
                                  deploy=dict(max_model_len=256, block_size=32)) as vpipe:
        rep = compare(vpipe, tiny_pipe, TEXTS[:1], **GEN)
    assert rep.ref == "vllm float32"
    _assert_identical(rep, 1)


def test_one_reference_run_serves_several_comparisons(tiny_pipe, load_pipe):
    """``reference()`` once, then ``compare(run, test)``: the same report as ``compare(ref, test, texts)`` (same
    kernels, values and shapes in this process: the same bits), without running the reference again."""
    test = load_pipe(quantization="int8")
    run = reference(tiny_pipe, TEXTS, **GEN)
    assert isinstance(run, ReferenceRun) and len(run) == 2 and "2 texts" in repr(run)
    calls = []
    plain = tiny_pipe.generate
    tiny_pipe.generate = lambda *a, **k: calls.append(a) or plain(*a, **k)
    try:
        reused = compare(run, test)
        again = compare(run, tiny_pipe)
    finally:
        del tiny_pipe.generate
    assert calls == []  # the reference's greedy runs are not repeated
    direct = compare(tiny_pipe, test, TEXTS, **GEN)
    cols = [c for c in direct.rows.columns if c != "wave_snr_db"]
    assert reused.rows[cols].equals(direct.rows[cols]) and reused.test == direct.test
    np.testing.assert_array_equal(reused.rows["wave_snr_db"], direct.rows["wave_snr_db"])
    _assert_identical(again, 2)
    with pytest.raises(InputError, match="takes no texts or generation keywords"):
        compare(run, test, TEXTS)
    with pytest.raises(InputError, match="accepted: processed, raw"):
        reference(tiny_pipe, TEXTS, c0_scores="softmax", **GEN)


def test_the_agreement_interval_is_wilsons():
    """Worked values of the 95 % Wilson interval (p +- z sqrt(p(1-p)/n + z^2/4n^2), shifted by z^2/2n, over
    1 + z^2/n): 58 of 64 (the 0.906 two bench texts gave) spans 0.81-0.96, so it cannot show 0.97 either way;
    all of n is not the empty [1, 1]; the interval of failures mirrors the successes'."""
    lo, hi = wilson_interval(58, 64)
    assert lo == pytest.approx(0.8103, abs=1e-3) and hi == pytest.approx(0.9563, abs=1e-3)
    lo, hi = wilson_interval(256, 256)
    assert hi == 1.0 and lo == pytest.approx(256 / (256 + 1.96 ** 2), abs=1e-9)
    a, b = wilson_interval(250, 264), wilson_interval(14, 264)
    assert a[0] == pytest.approx(1 - b[1], abs=1e-12) and a[1] == pytest.approx(1 - b[0], abs=1e-12)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
