"""Trace invariants on real runs, metric definitions on hand-made traces, exporters."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from _deps import need  # noqa: E402

from omnilab.instrument.hooks import Hooks, ThreadUsageHook, TimingHook
from omnilab.instrument.recorder import Recorder
from omnilab.instrument.tables import read_table
from omnilab.instrument.trace import (SPAN_COLUMNS, Span, SpanBuffer, Trace, playback_start_ms, request_metrics, rtf,
                           stall_ms, x_realtime)

KW = dict(speaker="vivian", language="english", max_new_tokens=9, do_sample=False, subtalker_do_sample=False)


def _span(name, t0, t1, rid="r", stage=None, frame=-1, n=0, sid=0, parent=-1, **attrs):
    from omnilab.instrument.trace import SPAN_STAGES

    return Span(name, stage or SPAN_STAGES[name], rid, t0, t1, 1, 1, frame, n, span_id=sid, parent_id=parent,
                attrs=attrs)


def hand_trace() -> Trace:
    """Request admitted at t=10 s; 4 talker steps of 100 ms; chunks of 1 and 3 frames delivered at
    +250 ms and +700 ms (80 ms and 240 ms of audio); request ends at +700 ms."""
    t = 10.0
    spans = [_span("request", t, t + 0.7, n=4, sid=1, frames=4, finish_reason="length"),
             _span("admission", t, t + 0.05, sid=2, parent=1)]
    for k in range(4):
        a = t + 0.05 + 0.1 * k
        spans.append(_span("step", a, a + 0.1, frame=k, n=1, sid=10 + k, parent=1))
        spans.append(_span("code_predictor", a, a + 0.06, frame=k, sid=20 + k, parent=10 + k))
    spans += [_span("code2wav_chunk", t + 0.2, t + 0.25, frame=0, n=1, sid=30, parent=1),
              _span("deliver", t + 0.25, t + 0.25, frame=0, n=1, sid=31, parent=1, audio_ms=80.0),
              _span("code2wav_chunk", t + 0.6, t + 0.7, frame=1, n=3, sid=32, parent=1),
              _span("deliver", t + 0.7, t + 0.7, frame=1, n=3, sid=33, parent=1, audio_ms=240.0)]
    return Trace(spans)


# ---- metric definitions ------------------------------------------------------------------------
def test_playback_start_and_stall_definitions():
    # buffered before each chunk: 0, 80, 480 -> arrival - buffered = 100, 120, 420
    arrival, audio = [100.0, 200.0, 900.0], [80.0, 400.0, 400.0]
    assert playback_start_ms(arrival, audio) == pytest.approx(420.0)
    assert stall_ms(arrival, audio) == pytest.approx(320.0)
    # a stream that keeps ahead never stalls: playback starts at TTFA
    assert playback_start_ms([50.0, 60.0], [80.0, 80.0]) == pytest.approx(50.0)
    assert stall_ms([50.0, 60.0], [80.0, 80.0]) == 0.0
    assert math.isnan(playback_start_ms([], []))


def test_rtf_and_x_realtime_are_inverse():
    assert rtf(2.0, 4.0) == 0.5 and x_realtime(2.0, 4.0) == 2.0
    assert rtf(1.0, 0.0) == math.inf and x_realtime(0.0, 1.0) == math.inf


def test_request_metrics_on_hand_made_trace():
    m = request_metrics(hand_trace().spans, "r")
    assert m["frames"] == 4 and m["num_chunks"] == 2
    assert m["ttfa_ms"] == pytest.approx(250.0)
    assert m["playback_start_ms"] == pytest.approx(700.0 - 80.0)
    assert m["stall_ms"] == pytest.approx(620.0 - 250.0)
    assert m["wall_ms"] == pytest.approx(700.0) and m["audio_ms"] == pytest.approx(320.0)
    assert m["rtf"] == pytest.approx(700 / 320) and m["x_realtime"] == pytest.approx(320 / 700)
    assert m["talker_ms_per_frame"] == pytest.approx(100.0)
    assert m["code2wav_ms_per_frame"] == pytest.approx((50 + 100) / 4)
    assert m["code_predictor_ms_per_frame"] == pytest.approx(60.0)
    assert m["step_ms_p50"] == pytest.approx(100.0) and m["finish_reason"] == "length"
    assert m["frames_per_s"] == pytest.approx(4 / 0.7)


def test_check_accepts_consistent_and_flags_broken_traces():
    assert hand_trace().check() == []
    t = hand_trace()
    steps = [s for s in t.spans if s.name == "step"]
    steps[-1].end_s += 0.5          # the last step sticks out of the request
    steps[0].end_s += 0.05          # the first overlaps the second
    bad = " ".join(t.check())
    assert "overlap" in bad and "outside the request" in bad
    t = hand_trace()
    next(s for s in t.spans if s.name == "code_predictor").start_s -= 1.0  # child before its parent
    assert any("sticks out of parent" in b for b in t.check())
    t = hand_trace()
    next(s for s in t.spans if s.name == "request").attrs["frames"] = 5
    assert any("5 frames" in b for b in t.check())


# ---- invariants on real runs -------------------------------------------------------------------
def _assert_consistent(trace: Trace, codes: np.ndarray, audio: np.ndarray, rid: str):
    assert trace.check() == []
    own = [s for s in trace.spans if s.request_id == rid]
    steps = sorted((s for s in own if s.name == "step" and s.num_frames), key=lambda s: s.start_s)
    assert [s.frame_index for s in steps] == list(range(len(codes)))  # one step per frame, in order
    assert [s.start_s for s in steps] == sorted(s.start_s for s in steps)
    chunks = [s for s in own if s.name == "code2wav_chunk"]
    assert sum(c.num_frames for c in chunks) == len(codes)
    delivered = sum(s.attrs["audio_ms"] for s in own if s.name == "deliver")
    assert delivered == pytest.approx(1e3 * len(audio) / 24000)
    # Nested, as Trace.check() claims: every span inside its parent and inside the request. All these spans
    # are stamped by this process's perf_counter (the eager pipeline has no worker clock), so the only
    # tolerance is float rounding of the laid-out phase ends: check()'s own 1 us.
    tol_s = 1e-6
    by_id = {s.span_id: s for s in trace.spans}
    req = next(s for s in own if s.name == "request")
    for s in own:
        assert s.end_s >= s.start_s - tol_s, s
        assert req.start_s - tol_s <= s.start_s and s.end_s <= req.end_s + tol_s, s
        if s is req or s.attrs.get("remote"):
            continue
        parent = by_id.get(s.parent_id)
        assert parent is not None and parent.request_id == rid, f"{s.name} span {s.span_id} has no parent"
        assert parent.start_s - tol_s <= s.start_s and s.end_s <= parent.end_s + tol_s, (s, parent)
        if s.name in ("prefill", "code_predictor", "input_prep", "talker_forward", "sampling"):
            assert parent.name == "step", f"phase {s.name} nested in {parent.name}, not its step"
    names = {s.name for s in own}
    assert {"request", "admission", "step", "prefill", "code_predictor", "talker_forward", "code2wav_chunk",
            "deliver"} <= names


def test_generate_stream_and_stepwise_traces_are_consistent(tiny_pipe):
    r = tiny_pipe.generate("Hello there.", **KW)
    assert r.trace is not None and r.trace.request_ids == [r.request_id]
    _assert_consistent(r.trace, r.codes, r.audio, r.request_id)
    m = r.trace.request_metrics()
    assert m["ttfa_ms"] == pytest.approx(r.ttfa_ms) and m["ttfa_ms"] <= m["wall_ms"]
    assert r.wall_s == pytest.approx(m["wall_ms"] / 1e3)

    chunks = list(tiny_pipe.stream("Hello there.", **KW))
    res = type(r).from_chunks(chunks)
    assert chunks[-1].trace is res.trace and all(c.trace is None for c in chunks[:-1])
    _assert_consistent(res.trace, res.codes, res.audio, res.request_id)
    m = res.trace.request_metrics()
    assert m["num_chunks"] == len(chunks) and m["ttfa_ms"] < m["wall_ms"]
    assert m["playback_start_ms"] >= m["ttfa_ms"] - 1e-9
    assert {"hop", "consumer"} <= {s.name for s in res.trace.spans}

    with tiny_pipe.hooks.using(TimingHook()) as (timing,):
        rid = tiny_pipe.talker.start("Hi.", **KW)
        n = 0
        while tiny_pipe.talker.has_unfinished():
            n += sum(o.codes is not None for o in tiny_pipe.talker.step().values())
    tr = timing.traces[-1]
    assert tr.request_ids == [str(rid)] and tr.check() == []
    assert tr.request_metrics()["frames"] == n and not tiny_pipe.recorder.is_open(rid)


def test_batched_requests_each_get_their_own_trace(tiny_pipe):
    with tiny_pipe.hooks.using(TimingHook()) as (timing,):
        rs = tiny_pipe.generate(["One.", "Two, a bit longer."], **KW)
    for r in rs:
        _assert_consistent(r.trace, r.codes, r.audio, r.request_id)
        assert r.trace.request_ids == [r.request_id]
    assert Trace(timing.spans).check() == []
    assert {s.attrs.get("batch") for s in timing.spans if s.name == "step"} >= {2}


def test_aborted_stream_ends_its_request(tiny_pipe):
    with tiny_pipe.hooks.using(TimingHook()) as (timing,):
        it = tiny_pipe.stream("Hello there, this will be cut.", **{**KW, "max_new_tokens": 40})
        next(it)
        it.close()
    tr = timing.traces[-1]
    assert tr.request_metrics()["finish_reason"] == "abort" and tr.check() == []


# ---- exporters ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampled_trace(tiny_pipe):
    with tiny_pipe.hooks.using(ThreadUsageHook(interval_s=0.02)):
        chunks = list(tiny_pipe.stream("Exporters need samples.", **KW))
    return chunks[-1].trace


def test_to_pandas_columns_and_dtypes(sampled_trace):
    df = sampled_trace.to_pandas()
    assert tuple(df.columns) == SPAN_COLUMNS and len(df) == len(sampled_trace.spans)
    for c in ("span_id", "parent_id", "pid", "tid", "frame_index", "num_frames"):
        assert df[c].dtype == np.int64, c
    for c in ("start_s", "end_s", "start_ms", "duration_ms", "cpu_ms"):
        assert df[c].dtype == np.float64, c
    for c in ("request_id", "stage", "name", "attrs"):
        assert pd.api.types.is_string_dtype(df[c]) or df[c].dtype == object, c
    assert (df["duration_ms"] >= 0).all() and df["start_ms"].min() >= 0
    json.loads(df["attrs"].iloc[0])
    th = sampled_trace.to_pandas("threads")
    assert {"t_s", "t_ms", "pid", "tid", "role", "thread", "cpu_ms", "wait_ms", "core", "affinity", "omp"} <= set(th.columns)
    assert len(th) and (th["cpu_ms"] >= 0).all()
    assert {"core", "busy"} <= set(sampled_trace.to_pandas("cores").columns)
    assert {"pid", "rss_mb", "peak_rss_mb"} <= set(sampled_trace.to_pandas("processes").columns)


def test_csv_and_dict_round_trip(sampled_trace, tmp_path):
    paths = sampled_trace.to_csv(tmp_path)
    assert {p.name for p in paths} >= {"trace_spans.csv", "trace_threads.csv", "trace_cores.csv"}
    back = read_table(tmp_path / "trace_spans.csv")  # after its '# key: value' metadata lines
    assert tuple(back.columns) == SPAN_COLUMNS and len(back) == len(sampled_trace.spans)
    assert back.attrs["omnilab"]["backend"] == "eager" and back.attrs["omnilab"]["table"] == "spans"
    again = Trace.from_dict(json.loads(json.dumps(sampled_trace.to_dict())))
    assert again.metrics().equals(sampled_trace.metrics()) and again.check() == []


def test_parquet_export(sampled_trace, tmp_path):
    need("pyarrow")
    paths = sampled_trace.to_parquet(tmp_path)
    assert len(pd.read_parquet(paths[0])) == len(sampled_trace.spans)  # plain pandas reads it as is


def _check_trace_events(doc: dict) -> list[dict]:
    ev = doc["traceEvents"]
    assert ev and all(e["ph"] in {"X", "B", "E", "i", "C", "M", "b", "e"} for e in ev)
    for e in ev:
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    # complete events on one thread must nest (Perfetto drops improperly nested slices)
    by_thread: dict = {}
    for e in sorted((e for e in ev if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])):
        stack = by_thread.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= e["ts"] + 1e-3:
            stack.pop()
        assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-3, e
        stack.append(e["ts"] + e["dur"])
    return ev


def test_perfetto_json_is_valid_trace_events(sampled_trace, tmp_path):
    p = sampled_trace.to_perfetto(tmp_path / "t.json")
    ev = _check_trace_events(json.loads(p.read_text()))
    names = {e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert any("pid" in n for n in names)  # process tracks are named
    assert {"b", "e", "C", "i"} <= {e["ph"] for e in ev}


def test_worker_spans_reach_the_trace_with_their_own_pid():
    buf = SpanBuffer()
    with buf.span("code2wav_chunk", "r", frame_index=0, num_frames=2):
        sum(range(1000))
    worker = buf.take()
    assert buf.take() == [] and worker[0]["stage"] == "code2wav"
    worker[0]["pid"] = 424242  # as if it came from another process
    timing = TimingHook()
    rec = Recorder(Hooks(timing))
    rec.begin("r", (worker[0]["start_s"] - 0.001, 0.0))
    rec.remote(worker)
    tr = rec.end("r", "eos")
    assert 424242 in {s.pid for s in tr.spans} and tr.check() == []
    m = tr.request_metrics()  # worker detail is reported separately, not counted twice
    assert m["code2wav_ms_per_frame"] == 0.0 and m["code2wav_compute_ms_per_frame"] > 0
    ev = _check_trace_events(tr.to_chrome_trace())
    assert any(e["pid"] == 424242 and e["ph"] == "X" for e in ev)
