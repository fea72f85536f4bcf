"""``omnilab bench`` on the tiny checkpoint: the CLI's modes, the JSON it writes, the figures' arithmetic, the probes."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

import pytest

from omnilab.bench import backends as be, drivers as drv, floors, memory, run as bench
from omnilab.bench.results import TABLE_COLUMNS, BenchResult, load_bench, table_keys

REPO = Path(__file__).resolve().parents[2]
FAST = ["--threads", "1", "--frames", "3", "--warmup-frames", "1", "--reference", "off"]


def _bench(argv: list[str], capsys) -> tuple[dict, list[str]]:
    """Run ``omnilab bench argv``; returns (the JSON it wrote, stdout lines)."""
    assert bench.bench_main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("results: ")  # the last line: one line, the JSON's path (no JSON on the terminal)
    d = json.loads(Path(out[-1][len("results: "):]).read_text())
    assert d["command"] == "omnilab bench " + shlex.join(argv)  # the command line is in the file
    return d, out


def _printed_columns(out: list[str], rows: list[dict]) -> list[tuple]:
    header = next(ln for ln in out if ln.startswith("config "))
    heads = [h.strip() for h in header.split(" | ")]
    n = max((r.get("n_streams") or 0) for r in rows)
    cols = [c for c in TABLE_COLUMNS
            if c[0].replace("N-stream", f"{n}-stream").replace("N / 1", f"{n} / 1") in heads]
    assert len(cols) == len(heads), (heads, n)
    return cols


def test_prompt_set_is_shipped_and_comments_are_skipped(tmp_path):
    prompts = bench.load_prompts(bench.DEFAULT_PROMPTS)
    assert len(prompts) >= 20 and all(not p.startswith("#") and p.strip() == p for p in prompts)
    f = tmp_path / "p.txt"
    f.write_text("# comment\n\nOne.\n  Two.  \n")
    assert bench.load_prompts(f) == ["One.", "Two."]


def test_bytes_per_frame_counts_talker_and_15_predictor_passes(tiny_ckpt):
    b = floors.bytes_per_frame(tiny_ckpt("custom_voice"), 4)
    assert b["predictor_passes"] == 15
    assert b["talker_bytes_per_frame"] == pytest.approx(b["talker_decode_bytes"] + 15 * b["predictor_pass_bytes"])
    assert b["talker_decode_bytes"] > 0 and b["predictor_pass_bytes"] > 0
    assert floors.bytes_per_frame(tiny_ckpt("custom_voice"), 2)["talker_bytes_per_frame"] * 2 == b["talker_bytes_per_frame"]


class _Clock:
    """A fake ``perf_counter`` that advances 2^-7 s per call (binary fractions: differences are exact)."""
    TICK = 2.0 ** -7

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += self.TICK
        return self.t


def test_gemv_probes_report_bytes_over_seconds(monkeypatch):
    import torch

    # a probe matrix is the requested bytes rounded down to whole 4096-wide rows, at least one row
    row = floors.COLS * 4
    assert floors.gemv_matrix(10 * row + 5, torch.float32)[0].shape == (10, floors.COLS)
    assert floors.gemv_matrix(1, torch.float32)[0].shape == (1, floors.COLS)
    assert floors.gemv_matrix(10 * row, torch.bfloat16)[0].shape == (20, floors.COLS)

    monkeypatch.setattr(floors, "_clock", _Clock())
    small, large = floors.measure_gemv_bandwidth(mib=1, reps=3, threads=1), floors.measure_gemv_bandwidth(mib=2, reps=3, threads=1)
    assert small["bytes"] == 2**20 and large["bytes"] == 2 * small["bytes"]  # a larger matrix reads more bytes
    for bw in (small, large):
        assert bw["seconds"] == _Clock.TICK  # every timed mv took one tick
        assert bw["gbps"] == bw["bytes"] / bw["seconds"] / 1e9 == bw["gbps_median"]
    assert large["gbps"] == 2 * small["gbps"]  # same time, twice the bytes

    bpf = {"talker_decode_bytes": 8 * row + 100, "predictor_pass_bytes": 2 * row, "predictor_passes": 3}
    ff = floors.measure_frame_floor(bpf, reps=2, threads=1)
    assert ff["talker_bytes"] == 8 * row and ff["predictor_bytes"] == 3 * 2 * row  # 3 passes over one pass's matrix
    assert ff["talker_floor_ms"] == ff["predictor_floor_ms"] == 1e3 * _Clock.TICK  # clock read before, between, after
    assert ff["floor_ms"] == ff["talker_floor_ms"] + ff["predictor_floor_ms"]
    assert ff["talker_gbps"] == ff["talker_bytes"] / (ff["talker_floor_ms"] / 1e3) / 1e9
    assert ff["predictor_gbps"] == ff["predictor_bytes"] / (ff["predictor_floor_ms"] / 1e3) / 1e9

    monkeypatch.undo()  # the real clock: a real, ordered measurement
    bw = floors.measure_gemv_bandwidth(mib=8, reps=3, threads=1)
    assert 0 < bw["gbps_median"] <= bw["gbps"] and bw["bytes"] == 8 * 2**20


def test_configuration_names_parse_and_refuse_unknown():
    c = be.parse_config("vllm+torch-gemv+compiled")
    assert (c.base, c.compile_talker, c.compile_predictor, c.env) == ("vllm", True, False, {"OMNILAB_CPU_GEMV": "torch"})
    assert be.parse_config("vllm-compiled") == dataclasses.replace(be.parse_config("vllm+compiled"), name="vllm-compiled")
    w = be.parse_config("vllm-workers-inductor+avx2-kernels")
    assert w.workers and w.compile_predictor and w.env == {"OMNILAB_CPU_GEMV": "omnilab-avx2",
                                                            "OMNILAB_CPU_SNAKE": "omnilab-avx2"}
    assert be.parse_config("eager+int4").env == {"OMNILAB_QUANTIZATION": "int4"}  # quantized at load
    assert be.parse_config("vllm", compile_talker=True).compile_talker  # --compile on
    assert not be.parse_config("eager", compile_talker=True).compile_talker
    with pytest.raises(ValueError, match="unknown base 'vlm'.*accepted: eager, vllm, vllm-workers"):
        be.parse_config("vlm")
    with pytest.raises(ValueError, match=r"unknown suffix '\+fast'"):
        be.parse_config("eager+fast")
    with pytest.raises(ValueError, match="vllm bases only"):
        be.parse_config("eager+compiled")


def test_config_env_sets_modifiers_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("OMNILAB_CPU_GEMV", "torch")  # the user's own choice
    monkeypatch.delenv("OMNILAB_CPU_SNAKE", raising=False)
    with be.config_env(be.parse_config("eager+torch-snake")):
        assert os.environ["OMNILAB_CPU_SNAKE"] == "torch" and os.environ["OMNILAB_CPU_GEMV"] == "torch"
    assert "OMNILAB_CPU_SNAKE" not in os.environ and os.environ["OMNILAB_CPU_GEMV"] == "torch"
    with be.config_env(be.parse_config("eager+avx2-gemv")):
        assert os.environ["OMNILAB_CPU_GEMV"] == "omnilab-avx2"
    assert os.environ["OMNILAB_CPU_GEMV"] == "torch"


@pytest.mark.parametrize("argv, expect", [
    ([], {"mode": "same-process", "rounds": 1, "configs": ("eager", "vllm", "vllm-workers"), "concurrency": (1, 4),
          "chunks": (1, 25), "floor": True, "reference": "auto", "compile_talker": False}),
    (["--fresh", "--configs", "eager,vllm+compiled"], {"mode": "fresh", "configs": ("eager", "vllm+compiled")}),
    (["--interleave", "3", "--backends", "eager,vllm"], {"mode": "interleave", "rounds": 3}),
    (["--compile", "on", "--no-floor", "--chunks", "profile", "--reference", "off"],
     {"compile_talker": True, "floor": False, "chunks": (), "reference": "off"}),
    (["--variant", "base", "--ref-text", "Hi.", "--deploy-profile", "auto"],
     {"variant": "base", "ref_text": "Hi.", "ref_audio": None, "deploy_profile": "auto"}),
    ([], {"variant": "custom_voice", "deploy_profile": None, "instruct": be.DEFAULT_INSTRUCT}),
    (["--chunks", "1,2,4,25", "--concurrency", "1,2,4", "--requests", "6", "--talker-cpus", "0", "--code2wav-cpus", "1",
      "--code2wav-chunks", "--sample", "--wait-flag-pct", "5"],
     {"chunks": (1, 2, 4, 25), "concurrency": (1, 2, 4), "requests": 6, "talker_cpus": (0,), "code2wav_cpus": (1,),
      "code2wav_chunks": True, "sample": True, "wait_flag_pct": 5.0}),
])
def test_cli_parses_every_mode(argv, expect):
    cfg = bench.config_from_args(bench.parser().parse_args(argv))
    assert {k: getattr(cfg, k) for k in expect} == expect
    if cfg.chunks:
        assert cfg.schedule().sizes(40)[:2] == [cfg.chunks[0], cfg.chunks[1]]


@pytest.mark.parametrize("argv, message", [
    (["--fresh", "--interleave", "2"], "not allowed with argument"),
    (["--interleave", "2", "--configs", "eager,vllm-workers"], "in-process configurations only"),
    (["--configs", "eager,bogus"], "unknown base 'bogus'"),
    (["--concurrency", "0"], "concurrency"),
    (["--chunks", "25"], "FIRST,"),
    (["--rebuild"], "goes with --interleave"),
])
def test_cli_refuses_bad_arguments_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.bench_main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_lists_every_option_with_help_and_default():
    """Every option has help; every one that takes a value shows its default (a value or words), flags need none."""
    ap = bench.parser()
    text = ap.format_help()
    opts = [a for a in ap._actions if a.option_strings and a.dest != "help"]
    assert len(opts) >= 25
    for a in opts:
        assert a.help and a.option_strings[0] in text and "None" not in a.help
    valued = [a for a in opts if a.nargs != 0 and a.dest != "verbose"]
    assert text.count("(default:") == len(valued) + 1  # and -v, whose help names its default in words


def test_summarize_point_arithmetic():
    steps = [{"step_ms": 30.0, "rows": 2, "prefill": True, "talker_ms": 9.0, "predictor_ms": 20.0, "input_prep_ms": 0.1,
              "sampling_ms": 0.1, "cycle_ms": 0.0, "schedule_ms": 0.0}]
    steps += [{"step_ms": s, "rows": 2, "prefill": False, "talker_ms": 4.0, "predictor_ms": 15.0, "input_prep_ms": 0.1,
               "sampling_ms": 0.2, "cycle_ms": 0.0, "schedule_ms": 0.0} for s in (20.0, 21.0, 25.0)]
    pushes = [{"frames": 1, "ms": 6.0, "first": True}, {"frames": 1, "ms": 8.0, "first": True},
              {"frames": 3, "ms": 9.0, "first": False}, {"frames": 3, "ms": 9.0, "first": False}]
    run = drv.PointRun(2, [], steps, pushes, [40.0, 50.0], wall_s=0.5)
    p, reqs = drv.summarize_point(run)
    assert reqs == [] and p["frames"] == 8 and p["audio_s"] == pytest.approx(0.64)
    assert p["decode_step_ms"] == 21.0 and p["prefill_step_ms"] == 30.0  # medians, the prefill step apart
    assert (p["talker_forward_ms"], p["predictor_ms"]) == (4.0, 15.0)
    assert p["overhead_ms"] == 2.0 and p["overhead_pct"] == pytest.approx(100 * 2 / 21)  # in-process: the client's step
    assert p["first_chunk_ms"] == 7.0 and p["code2wav_ms_per_frame"] == pytest.approx(32 / 8)
    assert p["ttfa_ms"] == 45.0 and p["frames_per_s"] == 16.0
    assert p["talker_frames_per_s"] == pytest.approx(8 / 0.096) and p["steady_frames_per_s"] == pytest.approx(2e3 / 21)
    run.talker_in_worker = True  # a worker: the overhead is taken against the worker's cycle
    for s, cyc in zip(run.steps, (0.0, 22.0, 22.0, 30.0)):
        s["cycle_ms"] = cyc
    assert drv.summarize_point(run)[0]["overhead_ms"] == 3.0


def test_derive_ratios_and_ceiling():
    pt = lambda c, step, c2w, fps, tfps: {"concurrency": c, "decode_step_ms": step, "talker_forward_ms": 1.0,  # noqa: E731
                                          "predictor_ms": 2.0, "overhead_pct": 1.0, "overhead_ms": 0.1,
                                          "code2wav_ms_per_frame": c2w, "ttfa_ms": 9.0, "prefill_step_ms": 5.0,
                                          "first_chunk_ms": 3.0, "rtf_mean": 0.5, "frames_per_s": fps,
                                          "playback_start_ms_p50": 9.0, "stall_ms_p50": 0.0, "talker_frames_per_s": tfps,
                                          "steady_frames_per_s": 1e3 * c / step}
    r = be.derive({"points": [pt(1, 100.0, 20.0, 8.0, 9.0), pt(4, 125.0, 21.0, 20.0, 30.0)], "wait_pct": 3.0},
                  {"floor_ms": 80.0, "talker_floor_ms": 0.5, "predictor_floor_ms": 1.0})
    assert r["n_streams"] == 4 and r["speedup"] == 2.5 and r["talker_speedup"] == pytest.approx(30 / 9)
    assert r["steady_speedup"] == pytest.approx(3.2)  # 4 rows per 125 ms against 1 per 100 ms
    assert r["e2e_ceiling"] == pytest.approx(4 * (100 + 20) / (100 + 4 * 21))
    assert r["step_floor_ratio"] == 1.25 and r["talker_vs_floor"] == 2.0 and r["predictor_vs_floor"] == 2.0
    row = be.median_row("x", [r, {**r, "step_ms": 200.0}, {**r, "step_ms": 150.0}])
    assert row["runs"] == 3 and row["step_ms"] == 150.0 and row["step_ms_range"] == [100.0, 200.0]
    assert row["n_streams"] == 4 and isinstance(row["n_streams"], int)


def test_wait_pct_and_table_flag():
    a = {(1, 1): (100, 10), (1, 2): (50, 0), (1, 3): (5, 5)}
    b = {(1, 1): (400, 60), (1, 2): (250, 0), (1, 4): (999, 999)}  # tid 3 ended, tid 4 started: neither counts
    assert memory.wait_pct(a, b) == pytest.approx(100 * 50 / (500 + 50))
    assert memory.wait_pct(a, a) is None
    rows = [{"config": "quiet", "runs": 1, "step_ms": 140.0, "wait_pct": 4.0},
            {"config": "busy", "runs": 1, "step_ms": 150.0, "wait_pct": 30.0}]
    res = BenchResult(rows, None, None, {"settings": {"wait_flag_pct": 10.0}})
    lines = res.table().splitlines()
    assert lines[0].split(" | ")[:3] == ["config", "runs", "step ms"] and "RTF" not in lines[0]  # empty columns left out
    assert lines[2].rstrip().endswith("4") and lines[3].rstrip().endswith("30 !")
    assert res.noisy() == ["busy"] and "above 10 %" in lines[-1] and "busy" in lines[-1]


def test_process_sampler_sees_this_process():
    with memory.ProcessSampler(0.05) as m:
        x = bytearray(b"\x01") * (64 * 2**20)  # touched pages (a zeroed allocation may not be resident)
    s = m.summary()
    assert s["peak_rss_gib"] * 2**30 >= len(x) and any(k.endswith(":client") for k in s["peak_rss_gib_by_process"])
    with pytest.raises(ValueError, match="interval_s"):
        memory.ProcessSampler(0)


def test_interleaved_run_alternates_and_writes_one_row_per_configuration(tiny_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # --out defaults to ./omnilab-bench relative to the current directory
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "eager,eager+torch-gemv", "--interleave", "2",
            "--concurrency", "1,2", "--gemv-mib", "8", "--name", "il", *FAST]
    d, out = _bench(argv, capsys)
    assert (tmp_path / "omnilab-bench" / "il.json").is_file()
    assert [r["order"] for r in d["rounds"]] == [["eager", "eager+torch-gemv"], ["eager+torch-gemv", "eager"]]
    rows = d["rows"]
    assert [r["config"] for r in rows] == ["eager", "eager+torch-gemv"] and all(r["runs"] == 2 for r in rows)
    for col in _printed_columns(out, rows):  # every figure the table prints is in each row
        assert all(set(col[1]) <= set(r) for r in rows), col[0]
    assert rows[1]["gemv"].startswith("torch") and rows[0]["step_ratio"] == 1.0
    one = {(p["config"], p["round"]): p["decode_step_ms"] for p in d["summary"] if p["concurrency"] == 1}
    per_round = [one["eager+torch-gemv", r] / one["eager", r] for r in (1, 2)]  # paired within each round
    assert rows[1]["step_ratio"] == pytest.approx(sum(per_round) / 2) and rows[1]["step_ratio_range"] == sorted(per_round)
    pts = d["summary"]
    assert sorted((p["config"], p["concurrency"], p["round"]) for p in pts) == sorted(
        (c, n, r) for c in ("eager", "eager+torch-gemv") for n in (1, 2) for r in (1, 2))
    assert len(d["requests"]) == 2 * 2 * (1 + 2)
    assert all(1 <= q["frames"] <= 3 and q["finish_reason"] in ("length", "eos") for q in d["requests"])
    for r in rows:
        assert r["floor_ms"] > 0 and r["step_floor_ratio"] > 0 and r["n_streams"] == 2
        # the decode bandwidth at 2 streams: the step's weight bytes over the 2-row step (one read for both rows)
        assert r["n_effective_gbps"] == pytest.approx(r["decode_bytes_per_frame"] / (r["n_step_ms"] * 1e-3) / 1e9)
        # each part's bandwidth: its own bytes over its own share of the step; the parts add up to the frame
        assert r["decode_bytes_talker"] + r["decode_bytes_predictor"] == r["decode_bytes_per_frame"]
        for part in ("talker", "predictor"):
            assert r[f"{part}_gbps"] == pytest.approx(r[f"decode_bytes_{part}"] / (r[f"{part}_ms"] * 1e-3) / 1e9)
        assert 0 <= r["wait_pct"] <= 100 and r["pid"] == os.getpid()
    assert d["meta"]["peak_rss_gib_all_configs"] > 0 and d["meta"]["bandwidth"]["gbps"] > 0
    assert load_bench(tmp_path / "omnilab-bench" / "il.json").rows == rows


def test_same_process_run_measures_code2wav_chunks_and_memory(tiny_ckpt, tmp_path, capsys):
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "eager", "--concurrency", "1", "--no-floor",
            "--code2wav-chunks", "--out", str(tmp_path), *FAST]
    d, out = _bench(argv, capsys)
    (row,) = d["rows"]
    heads = next(ln for ln in out if ln.startswith("config "))
    assert "c2w 100f ms/frame" in heads and "floor ms" not in heads and "stream step" not in heads
    assert row["code2wav_100f_ms_per_frame"] > 0 and row["code2wav_1f_chunk_ms"] > 0
    assert row["peak_rss_gib"] > 0.05 and row["init_s"] > 0 and "floor_ms" not in row
    assert "bandwidth" not in d["meta"] and d["rounds"] == [{"round": 1, "order": ["eager"]}]


def test_fresh_mode_runs_the_configuration_in_a_subprocess(tiny_ckpt, tmp_path, capsys):
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "eager", "--fresh", "--concurrency", "1",
            "--no-floor", "--out", str(tmp_path), *FAST]
    d, _ = _bench(argv, capsys)
    (row,) = d["rows"]
    assert row["pid"] != os.getpid() and d["meta"]["children"]["eager"]["pid"] == row["pid"]
    assert row["step_ms"] > 0 and d["rounds"][0]["fresh_processes"]


def test_results_load_committed_files_and_never_replace_them(tmp_path):
    old = REPO / "data" / "bench" / "omnilab_bench_tiny_t1_address_local2.json"
    res = load_bench(old)
    assert res.rows and len(res.summary) > 0 and "<b>omnilab bench</b>" in res._repr_html_()
    with pytest.raises(FileExistsError, match="committed"):
        res.save(old.parent, old.stem)
    assert res.save(tmp_path, "copy").is_file()
    assert set(table_keys()) >= {"step_ms", "floor_ms", "wait_pct", "speedup"}


def test_concurrent_driver_streams_every_request(tiny_pipe):
    kw = dict(speaker="vivian", language="english", max_new_tokens=6, do_sample=False, subtalker_do_sample=False)
    texts = ["A.", "B, longer.", "C."]
    traces = drv.stream_requests(tiny_pipe, texts, [kw] * 3, concurrency=2)
    assert len(traces) == 3 and all(t.check() == [] for t in traces)
    ms = [t.request_metrics() for t in traces]
    assert all(m["frames"] == 5 and m["num_chunks"] >= 2 for m in ms)
    assert not tiny_pipe.talker.has_unfinished() and tiny_pipe.code2wav.num_sessions == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_in_process_row(tiny_ckpt, tmp_path, capsys):
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "vllm", "--concurrency", "1,2", "--no-floor",
            "--out", str(tmp_path), *FAST]
    d, _ = _bench(argv, capsys)
    (row,) = d["rows"]
    assert row["step_ms"] > 0 and 0 <= row["overhead_pct"] < 100 and row["speedup"] > 0
    assert "talker" in row["processes"][str(os.getpid())]


@pytest.mark.slow
@pytest.mark.reference
def test_reference_row(tiny_ckpt):
    from omnilab.bench import reference

    if not reference.reference_available():
        pytest.skip(".venv-ref not found")
    row = reference.reference_row(tiny_ckpt("custom_voice"), threads=1, frames=3)
    assert row["step_ms"] > 0 and row["code2wav_ms_per_frame"] == row["code2wav_25f_ms_per_frame"] > 0


def test_quantization_and_dtype_lists_expand_into_suffixed_configurations():
    assert be.expand(("vllm",), ("none", "int4"), ("auto", "float32")) == (
        "vllm+auto", "vllm+fp32", "vllm+int4+auto", "vllm+int4+fp32")
    assert be.expand(("eager", "vllm"), ("none", "int8")) == ("eager", "eager+int8", "vllm", "vllm+int8")
    assert be.expand(("eager",), (), ("bfloat16",)) == ("eager",)  # one dtype: --dtype as before, no suffix
    # `--dtype auto` alone runs the planner's dtype (it once ran the bench's float32 default, code2wav included)
    assert be.expand(("eager",), ("int4",), ("auto",)) == ("eager+int4+auto",)
    with pytest.raises(ValueError, match="accepted: quantization none, int8, int4"):
        be.expand(("eager",), ("int3",))
    c = be.parse_config("vllm+int4+auto")
    assert c.dtype == "auto" and c.dtype_arg("float32") is None and c.env == {"OMNILAB_QUANTIZATION": "int4"}
    assert be.parse_config("eager+bf16").dtype_arg("float32") == "bfloat16"
    assert be.parse_config("eager").dtype_arg("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="more than one dtype suffix"):
        be.parse_config("eager+fp32+bf16")


def test_stream_read_probe_reports_bytes_over_seconds(monkeypatch):
    monkeypatch.setattr(floors, "_clock", _Clock())
    sr = floors.measure_stream_read(mib=2, reps=3, threads=1)
    assert sr["bytes"] == 2 * 2**20 and sr["seconds"] == _Clock.TICK
    assert sr["gbps"] == sr["bytes"] / sr["seconds"] / 1e9 == sr["gbps_median"]


def test_decode_bytes_count_storage_and_predictor_passes(tiny_ckpt):
    from omnilab.checkpoint.load import load_model
    from omnilab.kernels.quant import quantization_choice

    ckpt = tiny_ckpt("custom_voice")
    fp32 = load_model(ckpt, dtype="float32").talker
    bpf = floors.bytes_per_frame(ckpt, 4)  # the file's shapes at 4 B per weight, norms included
    got = floors.decode_bytes_per_frame(fp32)
    stored = 2 if fp32.weight_storage.bf16 else 4  # bf16 storage halves what a step reads
    assert abs(got - bpf["talker_bytes_per_frame"] * stored / 4) < 0.01 * got  # norms: < 1 %
    int8 = load_model(ckpt, dtype="float32", quantization=quantization_choice("int8")).talker
    assert floors.decode_bytes_per_frame(int8) < 0.6 * got * 2 / stored  # ~1 B per weight + scales
    assert floors.decode_bytes_per_frame(None) is None
    parts = floors.decode_bytes_by_part(int8)  # the predictor's layers 15 times, its heads and the talker's once
    assert parts["talker"] + parts["predictor"] == floors.decode_bytes_per_frame(int8) and parts["predictor"] > parts["talker"]


def ref_b16(d):
    return d["meta"]["fidelity_bf16"]["c0_agreement"]


def test_quantization_and_dtype_rows_carry_points_and_fidelity(tiny_ckpt, tmp_path, capsys):
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "eager", "--quantization", "none,int8",
            "--dtype", "float32,bfloat16", "--interleave", "1", "--concurrency", "1", "--gemv-mib", "8",
            "--out", str(tmp_path), "--name", "q", *FAST]
    d, out = _bench(argv, capsys)
    names = [r["config"] for r in d["rows"]]
    assert names == ["eager+fp32", "eager+bf16", "eager+int8+fp32", "eager+int8+bf16"]
    assert d["stream_read_gbps"] > 0 and d["gemv_gbps"] > 0
    pts = {p["config"]: p for p in d["points"]}
    assert pts["eager+int8+bf16"]["quantization"] == "int8" and pts["eager+int8+bf16"]["dtype"] == "bfloat16"
    assert pts["eager+fp32"]["dtype_requested"] == "float32" and pts["eager+fp32"]["quantization"] == "none"
    for p in pts.values():
        assert p["effective_gbps"] > 0 and p["talker_ms_per_frame"] > 0 and p["ttfa_ms_p50"] > 0
        f = p["fidelity"]
        assert set(f) >= {"c0_agreement", "c0_kl_mean", "cp_agreement", "wave_snr_db"}
        assert 0 <= f["c0_agreement"] <= 1 and 0 <= f["cp_agreement"] <= 1 and f["c0_kl_mean"] >= 0
    ref = pts["eager+fp32"]["fidelity"]  # the reference's own numerics: identical by construction
    assert ref["c0_agreement"] == 1.0 and ref["cp_agreement"] == 1.0 and ref["c0_kl_mean"] < 1e-6
    assert d["meta"]["fidelity_bf16"] == pts["eager+bf16"]["fidelity"]  # bf16's figures beside every row
    header = next(line for line in out if line.startswith("config "))  # the table's header line
    assert "c0 agree" in header and "decode GB/s" in header and "wave SNR dB" in header
    assert "talker GB/s" in header and "predictor GB/s" in header
    # under the table: the streaming read the GB/s columns compare to, and bf16 compute's fidelity
    assert f"streaming read (x.sum()): {d['stream_read_gbps']:.1f} GB/s" in out
    assert f"bf16 compute, unquantized, on the same checkpoint: c0 agree {ref_b16(d):.3f}" in " ".join(out)


def test_voice_design_and_base_checkpoints_are_benched(tiny_ckpt, tmp_path, capsys):
    """VoiceDesign requests take the default --instruct (here through the vm-2core deploy profile); Base requests
    clone the generated reference clip; both end with the one-line path of the JSON."""
    common = ["--configs", "eager", "--concurrency", "1", "--no-floor", "--out", str(tmp_path), *FAST]
    d, out = _bench(["--model", str(tiny_ckpt("voice_design")), "--deploy-profile", "vm-2core", "--name", "vd",
                     *common], capsys)
    (row,) = d["rows"]
    assert row["variant"] == "voice_design" and row["deploy_profile"] == "vm-2core" and row["step_ms"] > 0
    assert d["meta"]["settings"]["instruct"] == be.DEFAULT_INSTRUCT
    assert out[-1] == f"results: {tmp_path / 'vd.json'}" and not any(ln.startswith("{") for ln in out)
    d, _ = _bench(["--model", str(tiny_ckpt("base")), "--name", "base", *common], capsys)
    (row,) = d["rows"]
    assert row["variant"] == "base" and row["deploy_profile"] is None and row["step_ms"] > 0
    assert all(q["frames"] >= 1 for q in d["requests"])
    wav, sr = be.reference_clip()
    assert sr == 24000 and wav.shape == (36000,) and 0.1 < float(abs(wav).max()) < 1.0


def test_request_voice_per_variant():
    from omnilab.config import Qwen3TTSConfig
    from omnilab.checkpoint.configs import config_json

    s = bench.BenchConfig(ref_text="A reference.", instruct="Low and slow.")
    cfgs = {v: Qwen3TTSConfig.from_dict(json.loads(config_json("tiny", v, None)))
            for v in ("custom_voice", "voice_design", "base")}
    assert be.voice_kwargs(cfgs["custom_voice"], s) == {"speaker": "vivian"}
    assert be.voice_kwargs(cfgs["voice_design"], s) == {"instruct": "Low and slow."}
    base = be.voice_kwargs(cfgs["base"], s)
    assert base["ref_text"] == "A reference." and base["ref_audio"][1] == 24000
    assert be.voice_kwargs(cfgs["base"], bench.BenchConfig(ref_audio="ref.wav")) == {"ref_audio": "ref.wav"}
    with pytest.raises(ValueError, match="variant='bass'; accepted: custom_voice, voice_design, base"):
        bench.BenchConfig(variant="bass")


def test_rebuild_interleaves_with_one_configuration_in_memory_at_a_time(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """--interleave N --rebuild: the same rounds and rows, each configuration built for its turn and closed after
    it (no two pipelines alive at once), init_s from every build; --rebuild without --interleave is refused."""
    from omnilab.pipeline import Pipeline

    live, most = [0], [0]
    real_init, real_close = Pipeline.__init__, Pipeline.close

    def init(self, *a, **k):
        real_init(self, *a, **k)
        live[0] += 1
        most[0] = max(most[0], live[0])

    def close(self):
        if not getattr(self, "_bench_closed", False):
            self._bench_closed = True
            live[0] -= 1
        return real_close(self)

    monkeypatch.setattr(Pipeline, "__init__", init)
    monkeypatch.setattr(Pipeline, "close", close)
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "eager,eager+torch-gemv", "--interleave", "2",
            "--rebuild", "--concurrency", "1", "--no-floor", "--fidelity", "off", "--out", str(tmp_path), *FAST]
    d, _ = _bench(argv, capsys)
    assert [r["order"] for r in d["rounds"]] == [["eager", "eager+torch-gemv"], ["eager+torch-gemv", "eager"]]
    assert [r["config"] for r in d["rows"]] == ["eager", "eager+torch-gemv"] and all(r["runs"] == 2 for r in d["rows"])
    assert most[0] == 1 and live[0] == 0 and all(r["init_s"] > 0 for r in d["rows"])
    assert d["rows"][1]["gemv"].startswith("torch") and "--rebuild" in " ".join(d["meta"]["notes"])


def test_reference_memory_counts_the_weights_and_reads_meminfo(tmp_path):
    """The bench skips the official pipeline (with a note) rather than let the OOM killer take the bench and its
    results: what it needs is 3 x the weight files + 2 GiB, what it has is MemAvailable."""
    from omnilab.bench.run import reference_memory

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "ck" / "speech_tokenizer").mkdir()
    (tmp_path / "ck" / "speech_tokenizer" / "model.safetensors").write_bytes(b"\0" * 24)
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000000 kB\n")
    need, have = reference_memory(tmp_path / "ck", str(info))
    assert need == 3 * 1024 + 2 * 2**30 and have == 1000000 * 1024
    assert reference_memory(tmp_path / "ck", str(tmp_path / "missing"))[1] == 0


def test_side_by_side_interleave_stops_with_a_clear_error_before_memory_runs_out(tiny_ckpt, tmp_path, monkeypatch,
                                                                                capsys):
    """--interleave without --rebuild builds every configuration in one process; a grid larger than the machine's
    memory was ended by the OOM killer with nothing written. Before each build after the first it compares
    MemAvailable with the largest configuration so far + 2 GiB and, short of it, stops with an error that names
    --rebuild; the configurations already built are closed. With room it builds them all."""
    from omnilab.bench import modes
    from omnilab.errors import InputError
    from omnilab.pipeline import Pipeline

    with pytest.raises(InputError, match=r"1 of 3 are in memory, the largest took 3\.0 GiB, and 4\.0 GiB is available"
                                         r".*5\.0 GiB that 'b' would need.*--rebuild"):
        modes.check_room("b", 1, 3, [3 * 2**30], available=4 * 2**30)
    modes.check_room("b", 1, 3, [2 * 2**30], available=4 * 2**30 + 1)  # room: no error
    modes.check_room("a", 0, 3, [], available=1)  # nothing built yet: nothing to go by
    modes.check_room("b", 1, 3, [3 * 2**30], available=0)  # MemAvailable unreadable: not a reason to stop

    live, closed = [], []
    real_init, real_close = Pipeline.__init__, Pipeline.close

    def init(self, *a, **k):
        real_init(self, *a, **k)
        live.append(self)

    def close(self):
        closed.append(self)
        return real_close(self)

    monkeypatch.setattr(Pipeline, "__init__", init)
    monkeypatch.setattr(Pipeline, "close", close)
    monkeypatch.setattr(modes, "mem_available_bytes", lambda: 2**30)  # 1 GiB left after the first build
    argv = ["--model", str(tiny_ckpt("custom_voice")), "--configs", "eager,eager+torch-gemv", "--interleave", "1",
            "--concurrency", "1", "--no-floor", "--fidelity", "off", "--out", str(tmp_path), *FAST]
    from omnilab.bench.run import bench_main

    with pytest.raises(InputError, match="--rebuild"):
        bench_main(argv)
    assert len(live) == 1 and live[0] in closed, "the first configuration was built, then closed; no second one"
