"""Hook protocol, composition, the recorder's span layout, and the thread sampler."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from omnilab.instrument.hooks import FunctionHook, Hook, Hooks, ProgressHook, ThreadUsageHook, TimingHook, as_hooks
from omnilab.instrument.recorder import Recorder, clock
from omnilab.stages.base import FrameOutput
from omnilab.instrument.sampler import ThreadSampler, cpu_list

KW = dict(speaker="vivian", language="english", max_new_tokens=6, do_sample=False, subtalker_do_sample=False)


class Log(Hook):
    def __init__(self, tag, log):
        self.tag, self.log = tag, log

    def start(self):
        self.log.append((self.tag, "start"))

    def stop(self):
        self.log.append((self.tag, "stop"))

    def on_span(self, span):
        self.log.append((self.tag, span.name))

    def on_request_end(self, trace):
        self.log.append((self.tag, "end", trace.request_ids[0]))


def test_as_hooks_accepts_none_hooks_callables_and_lists():
    assert len(as_hooks(None)) == 0
    seen = []
    h = as_hooks([TimingHook(), seen.append])
    assert isinstance(h.hooks[1], FunctionHook)
    assert as_hooks(h) is h
    with pytest.raises(TypeError, match="Hook or a callable"):
        as_hooks([42])


def test_hooks_compose_in_order_and_scope_start_stop():
    log = []
    hooks = Hooks(Log("a", log), Hooks(Log("b", log)))
    with hooks.running():
        pass
    assert log == [("a", "start"), ("b", "start"), ("b", "stop"), ("a", "stop")]
    t = TimingHook()
    hooks.add(t)
    assert hooks.find(TimingHook) is t and hooks.find(ProgressHook) is None
    hooks.remove(t)
    assert hooks.find(TimingHook) is None


def test_pipeline_calls_hooks_for_every_span_and_request(tiny_pipe):
    log = []
    with tiny_pipe.hooks.using(Log("x", log)):
        r = tiny_pipe.generate("Hooks see everything.", **KW)
    names = [e[1] for e in log]
    assert names[0] == "start" and names[-1] == "stop"
    assert names.count("end") == 1 and log[-2] == ("x", "end", r.request_id)
    assert names.count("step") == r.num_frames  # one step span per frame for a lone request
    assert {"admission", "prefill", "code_predictor", "code2wav_chunk", "deliver", "request"} <= set(names)
    assert len(tiny_pipe.hooks) == 0  # using() removed it


def test_recorder_lays_out_phases_inside_the_step():
    timing = TimingHook()
    rec = Recorder(Hooks(timing))
    rec.begin("a", clock(), auto_end=True)
    t = clock()
    time.sleep(0.03)
    out = FrameOutput("a", 0, torch.zeros(16, dtype=torch.long), True, "eos", 0, prefill_ms=5.0, predictor_ms=10.0,
                      input_prep_ms=1.0, talker_ms=4.0, sampling_ms=50.0)
    rec.step([out], t)
    assert not rec.is_open("a")  # auto_end closed it on the finished frame
    tr = timing.traces[0]
    assert tr.check() == []
    by = {s.name: s for s in tr.spans}
    step = by["step"]
    order = ["prefill", "code_predictor", "input_prep", "talker_forward", "sampling"]
    for a, b in zip(order, order[1:]):
        assert by[a].end_s == pytest.approx(by[b].start_s)
    assert by["prefill"].start_s == step.start_s and by["sampling"].end_s == step.end_s
    assert by["code_predictor"].duration_ms == pytest.approx(10.0)
    assert by["sampling"].attrs["reported_ms"] == 50.0  # reported total kept, span clamped to the step
    assert step.cpu_ms >= 0 and step.pid == os.getpid() and step.tid == threading.get_native_id()
    assert by["request"].attrs["finish_reason"] == "eos"


def test_recorder_keep_open_and_worker_pid():
    rec = Recorder()
    t_admit, cpu = clock()
    rec.begin("a", (t_admit - 0.01, cpu), auto_end=True)  # admitted 10 ms ago: room for the worker's 2 ms
    rec.keep_open("a")
    out = FrameOutput("a", 0, torch.zeros(16, dtype=torch.long), True, "eos", 0, predictor_ms=1.0, talker_ms=1.0,
                      worker_pid=4242, worker_tid=4243)
    rec.step([out], clock())
    assert rec.is_open("a")
    tr = rec.end("a", "eos")
    ph = {s.name: s for s in tr.spans if s.pid == 4242}
    assert {"code_predictor", "talker_forward"} <= set(ph) and ph["code_predictor"].tid == 4243
    step = next(s for s in tr.spans if s.name == "step")
    # a worker that reports no start: its phases keep their reported durations, one after another, and the
    # last ends when the client got the frame
    assert ph["code_predictor"].duration_ms == pytest.approx(1.0) and ph["talker_forward"].duration_ms == pytest.approx(1.0)
    # placed back from the client's time as start + duration in seconds of a clock whose magnitude (seconds since
    # boot) sets the rounding: contiguous to 1 ulp of that clock (~4e-12 s at 1e4 s), asserted to 1 ns
    assert ph["talker_forward"].end_s == pytest.approx(ph["code_predictor"].start_s, rel=0, abs=1e-9)
    assert ph["code_predictor"].end_s == pytest.approx(step.end_s, rel=0, abs=1e-9)
    assert tr.request_metrics()["talker_compute_ms_per_frame"] == pytest.approx(2.0)
    assert rec.end("a") is None  # ending twice is a no-op


def test_thread_sampler_rows_and_overhead():
    s = ThreadSampler(interval_s=0.01)
    s.add_process(os.getpid(), "client")
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            sum(range(10000))
    th = threading.Thread(target=burn, name="burner")
    th.start()
    s.start()
    time.sleep(0.3)
    s.stop()
    stop.set()
    th.join()
    rows = s.rows()
    threads = rows["thread_samples"]
    assert threads and {"burner", "omnilab-sampler", "MainThread"} <= {r["thread"] for r in threads}
    assert all(r["cpu_ms"] >= 0 and r["wait_ms"] >= 0 and r["interval_ms"] > 0 for r in threads)
    burner = sum(r["cpu_ms"] for r in threads if r["thread"] == "burner")
    assert burner > 10  # a busy thread is seen busy
    assert all(0.0 <= r["busy"] <= 1.0 for r in rows["core_samples"])
    assert rows["process_samples"][0]["rss_mb"] > 10
    ov = s.overhead()
    assert ov["samples"] >= 3 and 0 < ov["ms_per_sample"] < 50 and not s.running


def test_thread_usage_hook_is_reentrant_and_attached_to_the_pipeline(tiny_pipe):
    hook = ThreadUsageHook(interval_s=0.02)
    with tiny_pipe.hooks.using(hook):
        assert os.getpid() in hook.sampler.procs
        with hook:  # an outer scope (a benchmark) keeps one sampler running across requests
            tiny_pipe.generate("One.", **KW)
            assert hook.sampler.running
            r = tiny_pipe.generate("Two.", **{**KW, "max_new_tokens": 40})
        assert not hook.sampler.running
    assert r.trace.thread_samples and r.trace.process_samples
    roles = {x["role"] for x in r.trace.thread_samples}
    assert roles == {tiny_pipe.processes()[os.getpid()]}


def test_a_request_shorter_than_the_sampling_period_still_gets_its_thread_rows(tiny_pipe):
    # The period stretches up to 10x when one sample is costly (a busy machine): a 150 ms request
    # could then end between two samples, with no row. The request's end closes the open interval,
    # so its trace holds its threads whatever the period (here far longer than the request).
    hook = ThreadUsageHook(interval_s=60.0)
    with tiny_pipe.hooks.using(hook):
        r = tiny_pipe.generate("One.", **KW)
        with hook:
            r2 = tiny_pipe.generate("Two.", **KW)
    client = tiny_pipe.processes()[os.getpid()]
    ncpu = len(os.sched_getaffinity(0))
    for res in (r, r2):
        rows = [x for x in res.trace.thread_samples if x["role"] == client]
        [req] = [sp for sp in res.trace.spans if sp.name == "request"]
        for x in rows:  # the closing sample spans the request, and no thread ran longer than it
            assert x["t_s"] >= req.end_s - 1e-3 and x["t_s"] - x["interval_ms"] / 1e3 <= req.start_s + 1e-3, x
            assert 0 <= x["cpu_ms"] <= x["interval_ms"] + 1.0, x
        assert sum(x["cpu_ms"] for x in rows) <= ncpu * max(x["interval_ms"] for x in rows) + 1.0
        # the owner thread computed the frames: its CPU time is a real share of the request, not a rounding
        owner = [x for x in rows if x["thread"] == "omnilab-owner"]
        assert owner and sum(x["cpu_ms"] for x in owner) >= 1.0, rows


class _FakeBar:
    """Stands in for ``tqdm.auto.tqdm``: records what the hook tells the bar."""
    made: list["_FakeBar"] = []

    def __init__(self, total=None, desc="", unit="", leave=True, **kw):  # kw: delay, disable (instrument/progress.py)
        self.total, self.desc, self.unit, self.n, self.updates, self.closed = total, desc, unit, 0, [], False
        _FakeBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)
        self.n += n

    def close(self):
        self.closed = True


def test_progress_hook_counts_frames(tiny_pipe, monkeypatch):
    monkeypatch.setattr("tqdm.auto.tqdm", _FakeBar)
    monkeypatch.setattr(_FakeBar, "made", [])
    p = ProgressHook(desc="talker", total=6)
    with tiny_pipe.hooks.using(p):
        r = tiny_pipe.generate("Progress.", **KW)
        assert p.bar is None  # closed when the synthesis stopped
        r2 = tiny_pipe.generate("Progress again, a bit longer.", **{**KW, "max_new_tokens": 9})
    assert r.num_frames > 0 and r2.num_frames > 0
    first, second = _FakeBar.made  # one bar per synthesis, each closed at its end
    assert (first.total, first.desc, first.unit) == (6, "talker", "frame") and first.closed and second.closed
    assert first.n == r.num_frames and second.n == r2.num_frames  # the frames of each run, nothing else
    assert set(first.updates) == {1}  # one update per talker step of a lone request (one frame each)


def test_cpu_list():
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and cpu_list([3]) == "3"
