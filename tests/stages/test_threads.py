"""One Pipeline used from several threads, and iterators that end (docs/reliability.md#threads-and-iterators).

On each placement (eager; vLLM in this process; vLLM engine-core + talker + code2wav worker processes), every
stage call runs on the pipeline's one owner thread: 8 threads calling ``generate`` at once get their solo codes
(equal by construction: the calls run one at a time, in turn) within a bounded wall time; streams started
back to back and iterated in turn get exactly the frames the talker made for them (and, in this process, the
codes of one batched ``generate`` of the same texts); the step-wise API refuses a second driving thread;
``talker.abort`` or ``close`` during a stream ends its next iteration (StopIteration / ``InputError``) instead of
spinning. Every wait here has a timeout, so a regression fails rather than hangs.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest

from _deps import need  # noqa: E402

from omnilab.errors import InputError, WorkerError
from omnilab.pipeline import Pipeline
from omnilab.stages.base import FrameOutput
from omnilab.stages.owner import FrameRouter, OwnerThread

GREEDY = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False)
TEXTS = [f"Sentence number {i} for the thread test." for i in range(8)]
N = 6                      # max_new_tokens of the storm requests: 5 frames each
TIMEOUT_S = 240.0          # a generous bound on a shared 2-core host; a hang is what it catches
_CPUS = sorted(os.sched_getaffinity(0))


def _in_threads(fns, timeout_s: float = TIMEOUT_S):
    """Run each ``fn`` in its own daemon thread, all released at once -> their results (exceptions re-raised).
    Fails (never hangs) when they are not all done within ``timeout_s``."""
    out, errs, go = [None] * len(fns), [None] * len(fns), threading.Barrier(len(fns))

    def body(i, fn):
        go.wait()
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errs[i] = e

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, timeout_s - (time.monotonic() - t0)))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"threads {stuck} still running after {timeout_s:.0f} s"
    for e in errs:
        if e is not None:
            raise e
    return out


def _next_within(it, timeout_s: float = 60.0):
    """``next(it)`` in a helper thread -> ("item", chunk) | ("stop", None) | ("error", exc); fails on a hang."""
    box = []

    def body():
        try:
            box.append(("item", next(it)))
        except StopIteration:
            box.append(("stop", None))
        except BaseException as e:  # noqa: BLE001
            box.append(("error", e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the iterator's next() did not return within {timeout_s:.0f} s"
    return box[0]


def _build(kind: str, ckpt) -> Pipeline:
    if kind == "eager":
        pipe = Pipeline.from_pretrained(ckpt, backend="eager", dtype="float32", deploy_profile=None)
        pipe._talker.engine.batched = False  # rows one by one: a stream's codes do not depend on its batch mates
        return pipe
    need("vllm")
    from omnilab.stages.vllm.deploy import VllmDeploy
    from omnilab.stages.vllm.engine import VllmStageConfig

    if kind == "vllm":
        return Pipeline.from_pretrained(ckpt, backend="vllm", dtype="float32", deploy_profile=None,
                                        deploy=dict(max_model_len=256, block_size=32))
    deploy = VllmDeploy(VllmStageConfig(multiprocess=True, talker_cpus=(_CPUS[0],), talker_threads=1,
                                        max_model_len=256, block_size=32),
                        code2wav="process", code2wav_cpus=(_CPUS[-1],), code2wav_threads=1)
    return Pipeline.from_pretrained(ckpt, backend="vllm", dtype="float32", deploy=deploy)


@pytest.fixture(scope="module", params=[
    "eager", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow]),
    pytest.param("workers", marks=[pytest.mark.vllm, pytest.mark.slow])])
def pipe(request, tiny_ckpt):
    """One pipeline per placement for the whole module (the last test closes it)."""
    p = _build(request.param, tiny_ckpt("custom_voice"))
    p.kind = request.param
    yield p
    p.close()


@pytest.fixture(scope="module")
def solo(pipe):
    """Each storm request alone, one after another, on this placement -> codes [T, 16]."""
    return [pipe.generate(t, max_new_tokens=N, **GREEDY).codes for t in TEXTS]


def _live_nothing(pipe) -> None:
    assert pipe.talker.num_live == 0 and pipe.code2wav.num_sessions == 0


def test_eight_threads_generate_their_solo_codes(pipe, solo):
    t0 = time.monotonic()
    got = _in_threads([lambda t=t: pipe.generate(t, max_new_tokens=N, **GREEDY) for t in TEXTS])
    wall_s = time.monotonic() - t0
    for i, (res, ref) in enumerate(zip(got, solo)):
        np.testing.assert_array_equal(res.codes, ref, err_msg=f"thread {i} ({pipe.kind})")
        assert res.audio.shape == (len(ref) * 1920,) and np.isfinite(res.audio).all()
    assert len({r.request_id for r in got}) == len(TEXTS)
    assert wall_s < TIMEOUT_S
    _live_nothing(pipe)
    # the pipeline is whole afterwards: one more call from this thread gives the solo result again
    np.testing.assert_array_equal(pipe.generate(TEXTS[0], max_new_tokens=N, **GREEDY).codes, solo[0])


@pytest.mark.slow
def test_interleaved_streams_get_their_own_frames(pipe):
    """Each stream's chunks are exactly the frames the talker produced for its request (recorded at every step,
    so this holds by construction on every placement); in this process, where the 4 requests are added before
    the first step as a batched ``generate()`` adds them, the codes also equal that batch's. (The workers'
    engine core steps on its own clock, so there which requests share a step is timing-dependent.)"""
    texts, kw = TEXTS[:4], dict(max_new_tokens=9, **GREEDY)
    batch = pipe.generate(texts, **kw)
    produced: dict = {}
    inner = pipe._step

    def recorded(*a, **k):
        outs = inner(*a, **k)
        for o in outs:
            if o.codes is not None:
                produced.setdefault(o.request_id, []).append(o.codes.numpy().copy())
        return outs

    pipe._step = recorded
    try:
        its = [pipe.stream(t, **kw) for t in texts]  # all four live before the first step, as in the batch
        assert pipe.talker.num_live == 4
        chunks: list[list] = [[] for _ in its]
        live = set(range(len(its)))
        while live:  # round robin by the caller: a next() steps every live request, the frames go to their stream
            for i in sorted(live):
                kind, c = _next_within(its[i])
                if kind == "stop":
                    live.discard(i)
                else:
                    assert kind == "item", c
                    chunks[i].append(c)
    finally:
        del pipe._step
    for i, (cs, ref) in enumerate(zip(chunks, batch)):
        assert cs and cs[-1].is_last and not any(c.is_last for c in cs[:-1])
        assert [c.frame_start for c in cs] == [0] + [c.frame_end for c in cs[:-1]]
        assert {c.request_id for c in cs} == {cs[0].request_id}
        got = np.concatenate([c.codes for c in cs])
        np.testing.assert_array_equal(got, np.stack(produced[cs[0].request_id]), err_msg=f"stream {i}")
        if pipe.kind != "workers":
            np.testing.assert_array_equal(got, ref.codes, err_msg=f"stream {i} vs the batch")
        assert cs[-1].trace is not None
    assert len({c[0].request_id for c in chunks}) == len(texts)
    _live_nothing(pipe)


# Codes equal solo by construction only with rows decoded one by one (eager, batched=False); the vLLM placements
# are covered by the interleaved test above.
@pytest.mark.slow
@pytest.mark.parametrize("pipe", ["eager"], indirect=True)
def test_eight_threads_each_iterate_their_own_stream(pipe, solo):
    got = _in_threads([lambda t=t: list(pipe.stream(t, max_new_tokens=N, **GREEDY)) for t in TEXTS])
    for i, (cs, ref) in enumerate(zip(got, solo)):
        assert cs[-1].is_last
        np.testing.assert_array_equal(np.concatenate([c.codes for c in cs]), ref, err_msg=f"thread {i}")
    _live_nothing(pipe)


def test_stepwise_api_is_driven_by_one_thread(pipe, solo):
    rid = pipe.talker.start(TEXTS[0], max_new_tokens=N, **GREEDY)

    def from_other_thread():
        errs = []
        for call in (lambda: pipe.talker.start(TEXTS[1], max_new_tokens=N, **GREEDY), pipe.talker.step,
                     lambda: pipe.generate(TEXTS[1], max_new_tokens=N, **GREEDY)):
            with pytest.raises(InputError) as e:
                call()
            errs.append(str(e.value))
        return errs

    errs = _in_threads([from_other_thread])[0]
    assert "driven by another thread" in errs[0] and "pipe.generate()/pipe.stream()" in errs[0]
    assert "driven by another thread" in errs[1]
    assert "step-wise talker requests" in errs[2]
    assert pipe.talker.num_live == 1
    frames = []
    while pipe.talker.has_unfinished():  # the starting thread steps on
        frames += [o.codes for o in pipe.talker.step().values() if o.codes is not None]
    np.testing.assert_array_equal(np.stack([f.numpy() for f in frames]), solo[0])
    assert rid not in pipe._stepwise
    # finished: any thread may drive now; abort works from any thread
    rid2 = _in_threads([lambda: pipe.talker.start(TEXTS[1], max_new_tokens=N, **GREEDY)])[0]
    pipe.talker.abort(rid2)
    _live_nothing(pipe)


def test_stepwise_start_refused_while_a_stream_is_live(pipe):
    it = pipe.stream(TEXTS[0], max_new_tokens=N, **GREEDY)
    with pytest.raises(InputError, match=r"stream\(\) iterator\(s\) are live"):
        pipe.talker.start(TEXTS[1], max_new_tokens=N, **GREEDY)
    it.close()
    _live_nothing(pipe)


@pytest.mark.parametrize("where", ["same thread", "other thread"])
def test_abort_during_a_stream_ends_its_next_iteration(pipe, where):
    it = pipe.stream(TEXTS[0], max_new_tokens=60, **GREEDY)
    kind, first = _next_within(it)
    assert kind == "item" and first.frame_start == 0 and not first.is_last
    if where == "same thread":
        pipe.talker.abort(first.request_id)
    else:
        _in_threads([lambda: pipe.talker.abort(first.request_id)])
    assert _next_within(it) == ("stop", None)
    assert _next_within(it) == ("stop", None)  # and stays ended
    _live_nothing(pipe)


def test_a_stream_never_iterated_frees_its_request_when_dropped(pipe):
    it = pipe.stream(TEXTS[0], max_new_tokens=N, **GREEDY)
    assert pipe.talker.num_live == 1
    del it  # garbage collection of an iterator that never started
    _live_nothing(pipe)


@pytest.mark.parametrize("pipe", ["eager"], indirect=True)  # placement-independent pipeline code: checked once
def test_interrupted_caller_cancels_its_generate(pipe, solo):
    """A KeyboardInterrupt in the waiting thread (as Ctrl-C in a notebook) stops the call on the owner thread at
    its next talker step; its request is aborted and the pipeline answers the next call as before."""
    steps = []
    inner = pipe._step
    pipe._step = lambda *a, **k: (steps.append(1), time.sleep(0.05), inner(*a, **k))[2]
    box = []

    def body():
        try:
            pipe.generate(TEXTS[0], max_new_tokens=200, **GREEDY)
            box.append("finished")
        except KeyboardInterrupt:
            box.append("interrupted")

    t = threading.Thread(target=body, daemon=True)
    try:
        t.start()
        while len(steps) < 3:
            time.sleep(0.01)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(KeyboardInterrupt))
        t.join(30)
        assert box == ["interrupted"]
        deadline = time.monotonic() + 30
        while pipe.talker.num_live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(steps) < 100, "the cancelled call ran on"
    finally:
        del pipe._step
    _live_nothing(pipe)
    np.testing.assert_array_equal(pipe.generate(TEXTS[0], max_new_tokens=N, **GREEDY).codes, solo[0])


def test_close_while_another_thread_generates(tiny_ckpt):
    """``close()`` from one thread while another's ``generate()`` runs: that call raises at its next talker step
    (it does not run to its end first), and close returns."""
    p = _build("eager", tiny_ckpt("custom_voice"))
    steps, inner = [], p._step
    p._step = lambda *a, **k: (steps.append(1), time.sleep(0.05), inner(*a, **k))[2]
    box = []

    def body():
        try:
            p.generate(TEXTS[0], max_new_tokens=200, **GREEDY)
            box.append("finished")
        except InputError as e:
            box.append(str(e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    while len(steps) < 3:
        time.sleep(0.01)
    _in_threads([p.close], timeout_s=60)
    t.join(30)
    assert box == ["this Pipeline was closed while the request was running"] and len(steps) < 100
    with pytest.raises(InputError, match="closed"):
        p.generate(TEXTS[0], max_new_tokens=N, **GREEDY)


def test_router_refuses_to_step_forever_for_a_request_that_is_gone():
    router = FrameRouter()
    router.add("a")
    with pytest.raises(WorkerError, match="no longer in the talker"):
        router.pull(["a"], lambda: [], lambda: False)
    router.end("a")
    assert [o.finish_reason for o in router.pull(["a"], lambda: [], lambda: False)["a"]] == ["abort"]
    out = router.route([FrameOutput("a", 0, None, True, "eos", 0), FrameOutput("b", 0, None, True, "eos", 0)])
    assert [o.request_id for o in out] == ["b"]
    assert router.pull(["zz"], lambda: [], lambda: True)["zz"][0].finish_reason == "abort"


def test_owner_thread_runs_calls_in_turn_and_stops():
    owner = OwnerThread(closed_message="closed for the test")
    seen = []
    assert _in_threads([lambda i=i: owner.run(lambda: seen.append(threading.get_ident()) or i)
                        for i in range(8)]) == list(range(8))
    assert set(seen) == {owner._thread.ident}
    assert owner.run(lambda: owner.run(lambda: "nested")) == "nested"  # re-entrant on its own thread
    with pytest.raises(ZeroDivisionError):
        owner.run(lambda: 1 / 0)
    owner.stop()
    assert not owner._thread.is_alive()
    with pytest.raises(InputError, match="closed for the test"):
        owner.run(lambda: None)
    assert owner.run_if_open(lambda: 1) is None


def test_run_first_goes_ahead_of_the_queued_ordinary_calls():
    """A stream's start and its calls until its first chunk use ``run_first``: ahead of ordinary calls already
    queued (other streams' chunks), in arrival order among themselves, never ahead of the running call."""
    owner = OwnerThread()
    gate, order, threads = threading.Event(), [], []

    def queue_call(fn, *args, queued: int):
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 30
        while owner._queue.qsize() < queued:  # queued before the next one is sent: a fixed arrival order
            assert time.monotonic() < deadline
            time.sleep(0.001)

    queue_call(owner.run, gate.wait, 30, queued=0)
    while owner._current is None:
        time.sleep(0.001)
    queue_call(owner.run, order.append, "a", queued=1)
    queue_call(owner.run_first, order.append, "c", queued=2)
    queue_call(owner.run, order.append, "b", queued=3)
    queue_call(owner.run_first, order.append, "d", queued=4)
    gate.set()
    for t in threads:
        t.join(30)
    assert order == ["c", "d", "a", "b"]
    owner.stop()
    assert not owner._thread.is_alive()


def test_a_stream_started_mid_chunk_does_not_wait_for_that_chunk(pipe):
    """A stream's ``next()`` steps the talker until its chunk is due (25 frames here). A stream started meanwhile
    from another thread starts and gets its first 1-frame chunk a few talker steps later, not after the rest of the
    other's chunk: the owner thread is handed over between steps (``AGAIN``). Counted in talker steps, not time, so
    it holds on any CPU."""
    from omnilab.models.code2wav_stream import ChunkSchedule

    sched = ChunkSchedule(first_frames=1, ramp=(), steady_frames=25)
    kw = dict(GREEDY, max_new_tokens=40, chunk_schedule=sched)
    steps, box = [0], {}
    inner = pipe._step

    def counted(*a, **k):
        steps[0] += 1
        return inner(*a, **k)

    pipe._step = counted
    try:
        a = pipe.stream(TEXTS[0], **kw)
        assert _next_within(a)[0] == "item"
        s0 = steps[0]

        def second():
            deadline = time.monotonic() + 60
            while steps[0] < s0 + 3 and time.monotonic() < deadline:  # A's 25-frame next() is under way
                time.sleep(0.0005)
            box["asked"] = steps[0]
            b = pipe.stream(TEXTS[1], **kw)
            box["started"] = steps[0]
            box["chunk"] = next(b)
            box["first"] = steps[0]
            b.close()

        t = threading.Thread(target=second, daemon=True)
        t.start()
        kind, chunk = _next_within(a)
        box["a_done"] = steps[0]
        t.join(60)
        assert not t.is_alive()
        a.close()
    finally:
        del pipe._step
    assert kind == "item" and chunk.frame_end - chunk.frame_start == 25, (kind, chunk)
    assert box["chunk"].frame_start == 0 and box["chunk"].frame_end == 1
    assert box["started"] - box["asked"] <= 1, box
    assert box["first"] - box["asked"] <= 4, box
    assert box["first"] < box["a_done"], box
    _live_nothing(pipe)


def test_close_during_a_stream_ends_it_with_a_clear_error(pipe):
    """Last in the module: it closes the shared pipeline."""
    it = pipe.stream(TEXTS[0], max_new_tokens=60, **GREEDY)
    assert _next_within(it)[0] == "item"
    threads_before = threading.active_count()
    _in_threads([pipe.close])  # from another thread
    kind, err = _next_within(it)
    assert kind == "error" and isinstance(err, InputError) and "closed" in str(err), (kind, err)
    assert _next_within(it) == ("stop", None)
    with pytest.raises(InputError, match="closed"):
        pipe.talker.step()
    assert not pipe._owner._thread.is_alive() and threading.active_count() <= threads_before
