"""Request drivers of ``omnilab bench``: stream requests through the public ``Pipeline`` API and time every step.

- ``run_point``: N prompts with at most ``concurrency`` in flight (closed loop; N == concurrency: all
  started together), through the step-wise API (``pipe.talker.start/step`` + ``pipe.code2wav.open_session``),
  chunked with a ``ChunkSchedule`` (default 1 frame, then 25: the pipeline's own default without a
  profile). Spans are recorded through ``pipe.recorder`` as ``pipe.stream`` records them, so every request
  has a ``Trace``; besides, the wall time and phases of each talker step and each code2wav push are kept.
- ``summarize_point``: the figures of one point (definitions in its docstring) and one row per request.
- ``stream_requests``: ``run_point``'s traces (one per prompt, in order).
- ``code2wav_chunk_costs``: an in-process decoder's ms per frame on offline 1/25/100-frame chunks, in a
  steady stream (25-frame chunks after 75 frames of context) and the first 1-frame chunk of a stream (ms).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from omnilab.instrument.recorder import clock
from omnilab.instrument.trace import percentiles

FRAME_MS = 80.0  # audio per frame at 12.5 Hz (1920 samples at 24 kHz)


def default_schedule():
    from omnilab.models.code2wav_stream import ChunkSchedule  # lazy: torch

    return ChunkSchedule(first_frames=1, ramp=(), steady_frames=25)


@dataclass
class PointRun:
    """What ``run_point`` saw: one ``Trace`` per request, one record per talker step that produced frames
    (``step_ms`` client wall, the first row's phases, ``prefill``: the step held a prefill), one record per
    code2wav push, per-request time to first audio, and the point's wall time."""
    concurrency: int
    traces: list
    steps: list[dict] = field(default_factory=list)
    pushes: list[dict] = field(default_factory=list)
    ttfa_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    talker_in_worker: bool = False


def _med(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return float(statistics.median(xs)) if xs else math.nan


def run_point(pipe: Any, prompts: Sequence[str], kwargs: Sequence[dict], concurrency: int, schedule: Any = None,
              on_done: Callable[[Any], None] | None = None) -> PointRun:
    """Stream every prompt (``kwargs[i]`` for prompt i) with at most ``concurrency`` in flight."""
    rec, sched = pipe.recorder, schedule or default_schedule()
    me = os.getpid()
    run = PointRun(concurrency, [None] * len(prompts),
                   talker_in_worker="talker" not in pipe.processes().get(me, ""))
    queue = list(range(len(prompts)))
    live: dict[Any, dict] = {}
    t_point = time.perf_counter()
    with pipe.hooks.running():
        try:
            while queue or live:
                while queue and len(live) < concurrency:
                    i = queue.pop(0)
                    t0 = time.perf_counter()
                    rid = pipe.talker.start(prompts[i], **kwargs[i])
                    rec.keep_open(rid)
                    live[rid] = {"i": i, "t0": t0, "session": pipe.code2wav.open_session(rid), "pending": [],
                                 "chunk": 0, "frame": 0, "done": False, "reason": ""}
                ts = time.perf_counter()
                outs = pipe.talker.step()
                step_ms = 1e3 * (time.perf_counter() - ts)
                rows = [o for o in outs.values() if o.codes is not None]
                if rows:
                    o = rows[0]  # phases are the step's, shared by its rows
                    # VllmFrameOutput adds the engine's accounting; an eager FrameOutput has none of it
                    run.steps.append({"step_ms": step_ms, "rows": len(rows),
                                      "prefill": any(r.prefill_ms > 0 for r in outs.values()),
                                      "talker_ms": o.talker_ms, "predictor_ms": o.predictor_ms,
                                      "input_prep_ms": o.input_prep_ms, "sampling_ms": o.sampling_ms,
                                      "cycle_ms": getattr(o, "cycle_ms", 0.0),
                                      "schedule_ms": getattr(o, "schedule_ms", 0.0)})
                for rid, o in outs.items():
                    st = live.get(rid)
                    if st is None:
                        continue
                    if o.codes is not None:
                        st["pending"].append(o.codes)
                    if o.finished:
                        st["done"], st["reason"] = True, o.finish_reason or ""
                for rid, st in list(live.items()):
                    if st["pending"] and (st["done"] or len(st["pending"]) >= sched.chunk_frames(st["chunk"])):
                        _push(pipe, rec, run, rid, st)
                    if st["done"]:
                        st["session"].close()
                        run.traces[st["i"]] = rec.end(rid, st["reason"])
                        del live[rid]
                        if on_done:
                            on_done(run.traces[st["i"]])
        finally:
            for rid, st in live.items():
                pipe.talker.abort(rid)
                st["session"].close()
                rec.end(rid, "abort")
    run.wall_s = time.perf_counter() - t_point
    return run


def _push(pipe, rec, run: PointRun, rid, st: dict) -> None:
    """Decode a request's pending frames as one chunk (hop + code2wav_chunk spans, then deliver)."""
    import torch

    t = clock()
    codes = torch.stack(st["pending"]).numpy()  # [F, 16]
    rec.span("hop", rid, t, frame_index=st["frame"], num_frames=len(codes))
    t = clock()
    tc = time.perf_counter()
    audio = st["session"].push(codes)  # float32 [F * 1920]
    ms = 1e3 * (time.perf_counter() - tc)
    rec.span("code2wav_chunk", rid, t, frame_index=st["frame"], num_frames=len(codes))
    pipe._take_spans(st["session"])
    rec.deliver(rid, st["frame"], st["frame"] + len(codes), len(audio))
    run.pushes.append({"frames": len(codes), "ms": ms, "first": st["chunk"] == 0})
    if st["chunk"] == 0:
        run.ttfa_ms.append(1e3 * (time.perf_counter() - st["t0"]))
    st["frame"] += len(codes)
    st["chunk"] += 1
    st["pending"] = []


def stream_requests(pipe: Any, prompts: Sequence[str], kwargs: Sequence[dict], concurrency: int,
                    on_done: Callable[[Any], None] | None = None, schedule: Any = None) -> list:
    """Stream every prompt (``kwargs[i]`` for prompt i); returns each request's ``Trace`` in order."""
    return run_point(pipe, prompts, kwargs, concurrency, schedule, on_done).traces


def summarize_point(run: PointRun) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(point, requests)``. From the timed steps and pushes (``decode`` steps = steps without a prefill):

    - ``decode_step_ms``: median client wall of a decode step; ``talker_forward_ms``, ``predictor_ms``,
      ``input_prep_ms``, ``sampling_ms``: medians of its phases; ``prefill_step_ms``: median step that
      held a prefill (it also yields frame 0).
    - ``overhead_ms`` / ``overhead_pct``: step - talker forward - predictor, median over decode steps (the
      engine's scheduling, IPC, sampling, input prep); the step is the client's wall in-process and the
      worker's whole cycle (idle gap + execute + sample) when the talker runs in a worker.
    - ``first_chunk_ms``: median first code2wav push; ``code2wav_ms_per_frame``: all push time / frames.
    - ``ttfa_ms``: median over requests of (first audio - the request's start() call).
    - ``frames_per_s``: all frames / the point's wall; ``talker_frames_per_s``: frames / time in talker
      steps (prefills included, code2wav excluded); ``steady_frames_per_s``: concurrency / decode step.
    - ``rtf_mean``: wall / audio, mean over requests (``x_realtime_mean``: audio / wall), ``ttfa_ms_p50/p90``,
      ``playback_start_ms_p50/p90``, ``stall_ms_p50/p90``: from each request's ``Trace``
      (``omnilab.instrument.trace.request_metrics``), as are the per-request rows.
    """
    import numpy as np

    reqs = [{"index": i, **tr.request_metrics()} for i, tr in enumerate(run.traces)
            if tr is not None and tr.request_ids]
    decode = [s for s in run.steps if not s["prefill"]]
    pre = [s for s in run.steps if s["prefill"]]
    frames = sum(p["frames"] for p in run.pushes)
    c2w_ms = sum(p["ms"] for p in run.pushes)
    talker_s = sum(s["step_ms"] for s in run.steps) / 1e3
    col = lambda k: [r[k] for r in reqs if r[k] == r[k]]  # noqa: E731  (drop NaN)
    mean = lambda k: float(np.mean(col(k))) if col(k) else math.nan  # noqa: E731
    p = {"concurrency": run.concurrency, "requests": len(reqs), "frames": frames, "audio_s": frames * FRAME_MS / 1e3,
         "wall_s": run.wall_s, "frames_per_s": frames / run.wall_s if run.wall_s > 0 else math.nan,
         "decode_step_ms": _med([s["step_ms"] for s in decode]),
         "prefill_step_ms": _med([s["step_ms"] for s in pre]),
         "first_chunk_ms": _med([x["ms"] for x in run.pushes if x["first"]]),
         "code2wav_ms_per_frame": c2w_ms / frames if frames else math.nan,
         "ttfa_ms": _med(run.ttfa_ms),
         "talker_frames_per_s": frames / talker_s if talker_s else math.nan,
         "talker_in_worker": run.talker_in_worker}
    for k, src in (("talker_forward_ms", "talker_ms"), ("predictor_ms", "predictor_ms"),
                   ("input_prep_ms", "input_prep_ms"), ("sampling_ms", "sampling_ms"),
                   ("schedule_ms", "schedule_ms"), ("worker_cycle_ms", "cycle_ms")):
        p[k] = _med([s[src] for s in decode])
    base = "cycle_ms" if run.talker_in_worker else "step_ms"
    ovs = [(s[base] - s["talker_ms"] - s["predictor_ms"], s[base]) for s in decode if s[base] > 0]
    p["overhead_ms"] = _med([o for o, _ in ovs])
    p["overhead_pct"] = _med([100 * o / b for o, b in ovs])
    p["steady_frames_per_s"] = 1e3 * run.concurrency / p["decode_step_ms"] if p["decode_step_ms"] > 0 else math.nan
    p["rtf_mean"], p["x_realtime_mean"] = mean("rtf"), mean("x_realtime")
    for k in ("ttfa_ms", "playback_start_ms", "stall_ms"):
        p.update({f"{k}_{q}": v for q, v in percentiles(col(k), (50, 90)).items()})
    for k in ("talker_ms_per_frame", "talker_compute_ms_per_frame", "code2wav_compute_ms_per_frame",
              "code_predictor_ms_per_frame", "input_prep_ms_per_frame", "talker_forward_ms_per_frame",
              "sampling_ms_per_frame", "step_ms_p50", "step_ms_p99"):
        p[k] = mean(k)
    return p, reqs


def code2wav_chunk_costs(decoder: Any, repeats: int = 3, seed: int = 0) -> dict[str, float]:
    """ms per frame of ``decoder`` (an in-process ``Code2Wav``) on random codes: offline chunks of 1, 25 and
    100 frames (median of ``repeats``, 2 for 100; one warm-up each), a steady 25-frame streaming chunk after
    75 frames of context, and the first 1-frame chunk of a fresh stream (ms)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    with torch.inference_mode():
        for n in (1, 25, 100):
            codes = torch.randint(0, 2048, (1, 16, n), generator=g)  # [B, 16, T]
            decoder(codes)
            ts = []
            for _ in range(repeats if n < 100 else 2):
                t0 = time.perf_counter()
                decoder(codes)
                ts.append(time.perf_counter() - t0)
            out[f"code2wav_{n}f_ms_per_frame"] = 1e3 * statistics.median(ts) / n
        ctx = torch.randint(0, 2048, (1, 16, 75), generator=g)
        chunk = torch.randint(0, 2048, (1, 16, 25), generator=g)
        steady, first = [], []
        for _ in range(repeats):
            st = decoder.start_stream(1)
            t0 = time.perf_counter()
            decoder.decode_chunk(st, ctx[..., :1])
            first.append(time.perf_counter() - t0)
            decoder.decode_chunk(st, ctx[..., 1:])
            t0 = time.perf_counter()
            decoder.decode_chunk(st, chunk)
            steady.append(time.perf_counter() - t0)
            st.free()
    out["code2wav_stream_steady_ms_per_frame"] = 1e3 * statistics.median(steady) / 25
    out["code2wav_1f_chunk_ms"] = 1e3 * statistics.median(first)
    return out
