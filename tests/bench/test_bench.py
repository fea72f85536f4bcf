"""``omnilab bench`` on the tiny checkpoint: outputs, metric consistency, floor inputs, prompts."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from omnilab.bench import drivers as drv, run as bench


def test_prompt_set_is_shipped_and_comments_are_skipped(tmp_path):
    prompts = bench.load_prompts(bench.DEFAULT_PROMPTS)
    assert len(prompts) >= 20 and all(not p.startswith("#") and p.strip() == p for p in prompts)
    f = tmp_path / "p.txt"
    f.write_text("# comment\n\nOne.\n  Two.  \n")
    assert bench.load_prompts(f) == ["One.", "Two."]


def test_bytes_per_frame_counts_talker_and_15_predictor_passes(tiny_ckpt):
    b = drv.bytes_per_frame(tiny_ckpt("custom_voice"), 4)
    assert b["predictor_passes"] == 15
    assert b["talker_bytes_per_frame"] == pytest.approx(b["talker_decode_bytes"] + 15 * b["predictor_pass_bytes"])
    assert b["talker_decode_bytes"] > 0 and b["predictor_pass_bytes"] > 0
    assert drv.bytes_per_frame(tiny_ckpt("custom_voice"), 2)["talker_bytes_per_frame"] * 2 == b["talker_bytes_per_frame"]


def test_gemv_probes_report_positive_bandwidth():
    bw = drv.measure_gemv_bandwidth(mib=8, reps=2, threads=1)
    assert bw["gbps"] > 0 and bw["gbps"] >= bw["gbps_median"] and bw["gemv_mib"] == pytest.approx(8, rel=0.01)
    ff = drv.measure_frame_floor({"talker_decode_bytes": 4e6, "predictor_pass_bytes": 1e6, "predictor_passes": 3},
                                 reps=1, threads=1)
    assert ff["floor_ms"] > 0 and ff["talker_gbps"] > 0 and ff["predictor_gbps"] > 0


def test_unknown_backend_kwarg_is_refused(tiny_ckpt):
    cfg = bench.BenchConfig(checkpoint=str(tiny_ckpt("custom_voice")), backend_kwargs={"eager": {"no_such": 1}})
    with pytest.raises(ValueError, match="no_such"):
        bench._make_pipeline("eager", tiny_ckpt("custom_voice"), cfg, [])


def test_bench_main_end_to_end(tiny_ckpt, tmp_path, capsys):
    rc = bench.bench_main(["--model", str(tiny_ckpt("custom_voice")), "--threads", "1", "--backends", "eager",
                           "--concurrency", "1,2", "--requests", "2", "--warmup", "0", "--max-new-tokens", "5",
                           "--gemv-mib", "8", "--reference", "off", "--out", str(tmp_path), "--name", "b",
                           "--sampler-interval", "0.02", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])  # ends with one JSON line
    assert line["bench"] == "stream_latency" and [p["concurrency"] for p in line["points"]] == [1, 2]
    assert any("TTFA p50 ms" in ln and "achieved/floor" in ln for ln in out)  # the table
    res = bench.load_bench(tmp_path / "b.json")
    s, r = res.summary, res.requests
    assert list(s["concurrency"]) == [1, 2] and (s["requests"] == 2).all()
    assert set(pd.read_csv(tmp_path / "b_summary.csv").columns) == set(s.columns)
    assert len(pd.read_csv(tmp_path / "b_requests.csv")) == 4
    for _, row in s.iterrows():
        assert row["frames"] == 8 and row["ttfa_ms_p50"] > 0
        assert row["playback_start_ms_p50"] >= row["ttfa_ms_p50"] - 1e-6
        # x-realtime is 1/RTF per request, so mean(RTF) * mean(1/RTF) >= 1 (Jensen), = 1 when all equal
        assert row["rtf_mean"] * row["x_realtime_mean"] >= 1.0 - 1e-9
        assert row["floor_ratio"] == pytest.approx(row["talker_compute_ms_per_frame"] / row["floor_ms_per_frame"])
        assert row["talker_compute_ms_per_frame"] == pytest.approx(row["talker_ms_per_frame"], rel=0.05)  # eager
        assert row["peak_rss_mb"] > 50 and 0 <= row["sampler_pct_of_step"] < 100
        assert json.loads(row["peak_rss_by_process"])
    assert (r["rtf"] * r["x_realtime"]).apply(lambda v: math.isclose(v, 1.0)).all()
    assert s["driver"].iloc[0] == "pipe.stream" and "step-wise" in s["driver"].iloc[1]
    assert res.meta["bytes_per_frame"]["predictor_passes"] == 15 and res.meta["bandwidth"]["gbps"] > 0
    assert "<table" in res._repr_html_() and "BenchResult" in repr(res)


def test_concurrent_driver_streams_every_request(tiny_pipe):
    kw = dict(speaker="vivian", language="english", max_new_tokens=6, do_sample=False, subtalker_do_sample=False)
    texts = ["A.", "B, longer.", "C."]
    traces = drv.stream_requests(tiny_pipe, texts, [kw] * 3, concurrency=2)
    assert len(traces) == 3 and all(t.check() == [] for t in traces)
    ms = [t.request_metrics() for t in traces]
    assert all(m["frames"] == 5 and m["num_chunks"] >= 2 for m in ms)
    assert not tiny_pipe.talker.has_unfinished() and tiny_pipe.code2wav.num_sessions == 0
