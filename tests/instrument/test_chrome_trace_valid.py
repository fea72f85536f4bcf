"""Trace exports a user opens elsewhere: the Chrome-trace JSON loads whole in Perfetto (no
``slice_drop_overlapping_complete_event``), trace invariants hold in every placement (worker processes
included), and CSV/Parquet tables carry the run's metadata and read back.

The validator applies Perfetto's JSON import rules: times become integer ns as ``llround(us * 1000)``; on one
``(pid, tid)`` track, complete (``X``) events sorted by start must nest strictly (a slice that starts inside
another must end inside it; one that starts where another ends is a sibling)."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from _deps import need  # noqa: E402
import torch

from omnilab.instrument.hooks import Hooks, TimingHook
from omnilab.instrument.recorder import Recorder, clock
from omnilab.instrument.tables import META_KEY, read_meta, read_table, write_table
from omnilab.instrument.trace import SPAN_STAGES, Span, Trace
from omnilab.stages.base import FrameOutput

KW = dict(speaker="vivian", language="english", max_new_tokens=7, do_sample=False, subtalker_do_sample=False)
_NEEDS = {"X": ("name", "pid", "tid", "ts", "dur"), "i": ("name", "pid", "tid", "ts"),
          "C": ("name", "pid", "ts", "args"), "M": ("name", "pid", "args"),
          "b": ("name", "pid", "ts", "id", "cat"), "e": ("name", "pid", "ts", "id", "cat")}


def perfetto_problems(doc: dict) -> list[str]:
    """What Perfetto would drop or reject in a Trace Event JSON document (empty: it loads whole)."""
    bad: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, list) or not events:
        return ["no traceEvents list"]
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for e in events:
        ph = e.get("ph")
        if ph not in _NEEDS:
            bad.append(f"unknown phase {ph!r}: {e}")
            continue
        missing = [k for k in _NEEDS[ph] if k not in e]
        if missing:
            bad.append(f"{ph} event without {missing}: {e}")
            continue
        if not isinstance(e["pid"], int) or not isinstance(e.get("tid", 0), int) or not 0 <= e.get("tid", 0) < 2**32:
            bad.append(f"pid/tid not a uint32: {e}")
        if ph != "M" and (not isinstance(e["ts"], (int, float)) or e["ts"] < 0):
            bad.append(f"bad ts: {e}")
        if ph == "X":
            if not isinstance(e["dur"], (int, float)) or e["dur"] < 0:
                bad.append(f"negative or non-numeric dur: {e}")
                continue
            a = round(e["ts"] * 1000)  # Perfetto: llround(us * 1000)
            tracks.setdefault((e["pid"], e["tid"]), []).append((a, a + round(e["dur"] * 1000), e["name"]))
    for track, evs in tracks.items():
        stack: list[tuple[int, str]] = []
        for a, b, name in sorted(evs, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][0] <= a:
                stack.pop()
            if stack and b > stack[-1][0]:
                bad.append(f"track {track}: {name} [{a}, {b}] ns partially overlaps {stack[-1][1]} ending at "
                           f"{stack[-1][0]} ns")
            stack.append((b, name))
    return bad


def _span(name, t0, t1, rid="r", sid=0, parent=-1, pid=1, tid=1, **attrs):
    return Span(name, SPAN_STAGES[name], rid, t0, t1, pid, tid, span_id=sid, parent_id=parent, attrs=attrs)


def _old_export_overlaps(spans: list[Span]) -> bool:
    """The export before the fix (``ts`` and ``dur`` rounded apart): whether it made neighbours overlap."""
    t0 = min(s.start_s for s in spans)
    ev = [{"ph": "X", "name": s.name, "pid": s.pid, "tid": s.tid, "ts": round(1e6 * (s.start_s - t0), 3),
           "dur": round(1e6 * (s.end_s - s.start_s), 3)} for s in spans]
    return bool(perfetto_problems({"traceEvents": ev}))


# ---- the validator and the exporter on synthetic spans ------------------------------------------------
def test_validator_rejects_what_perfetto_drops():
    def x(ts, dur, tid=1):
        return {"ph": "X", "name": "s", "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    ok = {"traceEvents": [x(0, 10), x(0, 10), x(2, 3), x(5, 5), x(10, 1), x(3, 9, tid=2)]}
    assert perfetto_problems(ok) == []  # nested, equal, abutting, other track
    assert any("partially overlaps" in p for p in perfetto_problems({"traceEvents": [x(0, 10), x(9.999, 1)]}))
    assert any("negative" in p for p in perfetto_problems({"traceEvents": [x(0, -1)]}))
    no_dur = {"ph": "X", "name": "s", "pid": 1, "tid": 1, "ts": 0}
    assert any("without" in p for p in perfetto_problems({"traceEvents": [no_dur]}))


def test_rounding_edge_cases_no_longer_overlap():
    # t = 100 s; phases meet at offsets whose separately rounded ts + dur overshot the next ts by 1 ns
    t = 100.0
    cuts = [0.0, 0.6e-9, 1.0013e-6, 2.0019e-6, 3.0025e-6]
    spans = [_span("step", t, t + 4e-6, sid=1)]
    spans += [_span(ph, t + a, t + b, sid=2 + i, parent=1)
              for i, (ph, a, b) in enumerate(zip(("code_predictor", "input_prep", "talker_forward", "sampling"),
                                                 cuts, cuts[1:]))]
    assert _old_export_overlaps(spans)  # the overlap the old export produced
    assert perfetto_problems(Trace(spans).to_chrome_trace()) == []
    # many abutting and nested spans at random sub-ns offsets: none overlaps after export
    rng = np.random.default_rng(0)
    starts = t + np.cumsum(rng.uniform(1e-7, 3e-6, 400))
    rand = [_span("step", a, b, sid=i) for i, (a, b) in enumerate(zip(starts[::2], starts[1::2]))]
    rand += [_span("hop", a, b, sid=1000 + i) for i, (a, b) in enumerate(zip(starts[1::2], starts[2::2]))]
    rand += [_span("code_predictor", a, a + rng.uniform(0, 1) * (b - a), sid=2000 + i)
             for i, (a, b) in enumerate(zip(starts[::2], starts[1::2]))]
    assert _old_export_overlaps(rand)
    doc = Trace(rand).to_chrome_trace()
    assert perfetto_problems(doc) == []
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == len(rand)
    # dur comes from the rounded end: ts + dur of each phase is exactly the next phase's ts
    x = sorted((e for e in Trace(spans).to_chrome_trace()["traceEvents"] if e["ph"] == "X" and e["name"] != "step"),
               key=lambda e: e["ts"])
    assert all(round(1000 * (a["ts"] + a["dur"])) == round(1000 * b["ts"]) for a, b in zip(x, x[1:]))


def test_partially_overlapping_spans_go_to_their_own_lane():
    t = 5.0  # two requests' prefills recorded on one thread with overlapping times, and a shared step
    spans = [_span("step", t, t + 0.010, rid="a", sid=1), _span("step", t, t + 0.010, rid="b", sid=2),
             _span("prefill", t + 0.001, t + 0.006, rid="a", sid=3),
             _span("prefill", t + 0.004, t + 0.009, rid="b", sid=4),
             _span("hop", t + 0.010, t + 0.012, rid="a", sid=5)]
    doc = Trace(spans).to_chrome_trace()
    assert perfetto_problems(doc) == []
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(x) == 4 and next(e for e in x if e["name"] == "step")["args"]["request_ids"] == ["a", "b"]
    lanes = {e["tid"] for e in x} - {1}
    assert len(lanes) == 1 and min(lanes) > 2**22  # above every Linux tid
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "lane 1" in names[lanes.pop()]


# ---- worker phases: placed on the worker's clock, inside the request ---------------------------------
def _worker_out(rid, k, start_s=None, end_s=None, **ms):
    return FrameOutput(rid, k, torch.zeros(16, dtype=torch.long), False, None, 0, worker_pid=4242, worker_tid=4243,
                       worker_start_s=start_s, worker_end_s=end_s, **ms)


def test_worker_phases_sit_in_the_worker_window_and_inside_the_request():
    timing = TimingHook()
    rec = Recorder(Hooks(timing))
    for rid in ("a", "b"):
        rec.begin(rid, clock(), auto_end=True)
    ms = dict(input_prep_ms=1.0, talker_ms=2.0, predictor_ms=3.0, sampling_ms=9.0)  # more than the window
    windows = []
    for k in range(4):
        # the worker computes ahead: its 8 ms window ends before the client asks for the frame (exactly 8 ms, so
        # the 15 ms of reported phases are clipped however long a loaded host takes between the two clock reads)
        w0 = clock()[0]
        w1 = w0 + 0.008
        while clock()[0] < w1:
            pass
        windows.append((w0, w1))
        t = clock()
        outs = [_worker_out(r, k, w0, w1, prefill_ms=2.0 if k == 0 else 0.0, **ms) for r in ("a", "b")]
        if k == 3:
            for o in outs:
                o.finished, o.finish_reason = True, "length"
        rec.step(outs, t)
    assert not rec.is_open("a") and not rec.is_open("b")
    for tr in timing.traces:
        assert tr.check() == [], tr.check()
        assert perfetto_problems(tr.to_chrome_trace()) == []
        work = [s for s in tr.spans if s.pid == 4242]
        for k, (w0, w1) in enumerate(windows):
            mine = sorted((s for s in work if s.frame_index == k and s.name != "prefill"), key=lambda s: s.start_s)
            assert [s.name for s in mine] == ["input_prep", "talker_forward", "code_predictor", "sampling"]
            assert mine[0].start_s == w0 and all(w0 <= s.start_s <= s.end_s <= w1 for s in mine)
            assert mine[-1].attrs["reported_ms"] == 9.0  # clipped to the window, the reported figure kept
        prefill = next(s for s in work if s.name == "prefill")
        forward = next(s for s in work if s.name == "talker_forward" and s.frame_index == 0)
        assert prefill.start_s == forward.start_s and prefill.duration_ms == pytest.approx(2.0)
    both = Trace(timing.spans)
    assert both.check() == [] and perfetto_problems(both.to_chrome_trace()) == []


def test_worker_step_window_survives_the_float32_record():
    from omnilab.stages.vllm import payload

    for t in (0.25, 98765.4321, 123456.000001, 2.0**31 + 0.5):  # from a fresh boot to 68 years of uptime
        rec = payload.encode(3, torch.arange(16), {"talker_ms": 1.5, "worker_start_s": t, "worker_end_s": t + 0.004},
                             1, 1, 7)
        d = payload.decode(rec)
        assert abs(d["worker_start_s"] - t) < 1e-7 and abs(d["worker_end_s"] - (t + 0.004)) < 1e-7
        assert d["talker_ms"] == 1.5 and d["frame_index"] == 3 and d["codes"].tolist() == list(range(16))
    assert payload.decode(payload.encode(0, None, {}, 0, 0, 0))["worker_start_s"] is None  # not reported


def test_worker_phases_without_a_start_never_end_after_the_client_got_them():
    """The worker-mode bug: phases laid out from reported durations and pushed after the previous step's,
    so they ran past the step (and the request) when the durations outgrew the step interval."""
    timing = TimingHook()
    rec = Recorder(Hooks(timing))
    rec.begin("a", clock(), auto_end=True)
    for k in range(5):
        t = clock()
        out = _worker_out("a", k, input_prep_ms=4.0, talker_ms=4.0, predictor_ms=4.0, sampling_ms=4.0)
        out.finished, out.finish_reason = k == 4, "length" if k == 4 else None
        rec.step([out], t)
    tr = timing.traces[-1]
    assert tr.check() == [], tr.check()
    steps = {s.frame_index: s for s in tr.spans if s.name == "step"}
    for s in tr.spans:
        if s.pid == 4242:
            assert s.end_s <= steps[s.frame_index].end_s
    assert perfetto_problems(tr.to_chrome_trace()) == []


# ---- real runs: every placement ----------------------------------------------------------------------
def _exports_and_invariants(pipe, tmp_path):
    """One stream, three concurrent step-wise requests, a batch: every trace valid and consistent."""
    chunks = list(pipe.stream("Hello there.", **KW))
    traces = [("stream", chunks[-1].trace)]
    with pipe.hooks.using(TimingHook()) as (timing,):
        for text in ("One.", "Two, a bit longer.", "Three more words."):
            pipe.talker.start(text, **KW)
        while pipe.talker.has_unfinished():
            pipe.talker.step()
    assert len(timing.traces) == 3
    traces += [("three requests", t) for t in timing.traces] + [("three requests, one file", Trace(timing.spans))]
    with pipe.hooks.using(TimingHook()) as (timing,):
        res = pipe.generate(["One.", "Two, a bit longer.", "Three more words."], **KW)
    traces += [("batch", r.trace) for r in res] + [("batch, one file", Trace(timing.spans))]
    for what, tr in traces:
        assert tr.check() == [], (what, tr.check())
        path = tr.to_perfetto(tmp_path / "t.json")
        assert perfetto_problems(json.loads(path.read_text())) == [], what
    return traces


def test_eager_exports_load_whole(tiny_pipe, tmp_path):
    _exports_and_invariants(tiny_pipe, tmp_path)


def _vllm_pipe(tiny_ckpt, deploy):
    need("vllm")
    from omnilab.pipeline import Pipeline

    return Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="vllm", dtype="float32", deploy=deploy)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_inprocess_exports_load_whole(tiny_ckpt, tmp_path):
    with _vllm_pipe(tiny_ckpt, "inprocess") as pipe:
        _exports_and_invariants(pipe, tmp_path)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_workers_exports_load_whole_and_invariants_hold(tiny_ckpt, tmp_path):
    with _vllm_pipe(tiny_ckpt, "workers") as pipe:
        traces = _exports_and_invariants(pipe, tmp_path)
    stream = traces[0][1]
    workers = {s.pid for s in stream.spans} - {os.getpid()}
    assert workers, "worker processes' spans are missing"
    phases = [s for s in stream.spans if s.pid in workers and s.name == "code_predictor"]
    assert phases and all(s.attrs.get("worker") for s in phases)
    req = next(s for s in stream.spans if s.name == "request")
    assert all(req.start_s <= s.start_s <= s.end_s <= req.end_s for s in phases)  # the reported bug


# ---- CSV / Parquet carry the run's metadata ------------------------------------------------------------
def _same(a, b) -> bool:
    norm = lambda v: json.loads(json.dumps(v, default=str, sort_keys=True))  # noqa: E731
    return norm(a) == norm(b)


@pytest.fixture(scope="module")
def run_result(tiny_pipe):
    return tiny_pipe.generate("Tables keep their metadata.", **KW)


@pytest.fixture(scope="module")
def run_trace(run_result):
    return run_result.trace


def test_trace_meta_names_the_run(run_result, tiny_pipe, tmp_path):
    m = run_result.trace.meta
    assert m["backend"] == "eager" and m["dtype"] == "float32" and m["quantization"] == "none"
    assert m["checkpoint"] == str(tiny_pipe.model.path) and m["placement"]
    assert m["torch_threads"] >= 1 and "talker_threads" in m and "code2wav_threads" in m
    df = run_result.timings_frame()  # the CLI's timings table carries it too
    assert df.attrs["omnilab"] == m and len(df) == len(run_result.trace.spans)
    p = write_table(df, tmp_path / "timings.csv", df.attrs["omnilab"])
    assert _same(read_meta(p), m) and len(read_table(p)) == len(df)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tables_round_trip_with_metadata(run_trace, tmp_path, fmt):
    if fmt == "parquet":
        need("pyarrow")
    paths = getattr(run_trace, f"to_{fmt}")(tmp_path)
    assert paths[0].name == f"trace_spans.{fmt}"
    for p in paths:
        meta = read_meta(p)
        assert _same({k: v for k, v in meta.items() if k != "table"}, run_trace.meta) and meta["table"] in p.stem
    if fmt == "parquet":
        import pyarrow.parquet as pq

        raw = json.loads(pq.read_schema(paths[0]).metadata[b"omnilab"])
        assert raw["backend"] == "eager" and raw["checkpoint"] == run_trace.meta["checkpoint"]
    else:
        head = paths[0].read_text().splitlines()
        assert head[0].startswith("# ") and any(line == '# backend: "eager"' for line in head)
    df = read_table(paths[0])
    assert len(df) == len(run_trace.spans) and df.attrs[META_KEY]["dtype"] == "float32"
    back = Trace.read_tables(tmp_path)
    assert _same(back.meta, run_trace.meta) and back.check() == []
    assert [s.name for s in back.spans] == [s.name for s in run_trace.spans]
    a, b = back.metrics(), run_trace.metrics()
    for c in ("frames", "num_chunks", "finish_reason"):
        assert (a[c] == b[c]).all(), c
    for c in ("ttfa_ms", "wall_ms", "audio_ms", "talker_ms_per_frame"):
        assert a[c].tolist() == pytest.approx(b[c].tolist()), c
    assert all(math.isnan(x) or x >= 0 for x in df["cpu_ms"])
