"""What ``omnilab.bench.run`` measures with: request drivers, the GEMV bandwidth probe, bytes per frame,
and the official reference run. Works through the public ``Pipeline`` API only, for every backend.

- ``stream_requests``: N prompts with at most ``concurrency`` in flight (closed loop). Concurrency 1 uses
  ``pipe.stream`` (the user path); above 1, the step-wise API (``pipe.talker.start/step`` +
  ``pipe.code2wav.open_session``) streams every live request with the pipeline's chunk schedule, recording
  the same spans as ``pipe.stream`` through ``pipe.recorder``. Returns one ``Trace`` per request.
- ``measure_gemv_bandwidth``: best fp32 ``W @ x`` throughput over a matrix far larger than the caches.
- ``bytes_per_frame``: weights the talker step reads per frame at batch 1 (checkpoint tensor shapes):
  1 talker decode + 15 code-predictor passes. code2wav is compute-bound and excluded.
- ``measure_frame_floor``: the same bytes as pure GEMVs (talker-sized matrix once, predictor-sized
  matrix 15 times, so cache reuse counts as in the real step): the time a frame cannot beat.
- ``run_reference``: the official ``qwen-tts`` (``.venv-ref``) on the same checkpoint and threads.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from omnilab.instrument.recorder import clock

REPO = Path(__file__).resolve().parents[2]  # a source checkout (the reference env lives there); absent otherwise
REFERENCE_PYTHON = REPO / ".venv-ref" / "bin" / "python"
REFERENCE_SCRIPT = REPO / "scripts" / "reference" / "run_reference.py"


def stream_requests(pipe: Any, prompts: Sequence[str], kwargs: Sequence[dict], concurrency: int,
                    on_done: Callable[[Any], None] | None = None) -> list:
    """Stream every prompt (``kwargs[i]`` for prompt i); returns each request's ``Trace`` in order."""
    if concurrency <= 1:
        traces = []
        for text, kw in zip(prompts, kwargs):
            last = None
            for chunk in pipe.stream(text, **kw):
                last = chunk
            traces.append(last.trace if last is not None else None)
            if on_done:
                on_done(traces[-1])
        return traces
    return _stream_concurrent(pipe, prompts, kwargs, concurrency, on_done)


def _stream_concurrent(pipe, prompts, kwargs, concurrency, on_done) -> list:
    import torch

    rec, sched = pipe.recorder, pipe.chunk_schedule
    queue = list(range(len(prompts)))
    live: dict[Any, dict] = {}
    traces: list = [None] * len(prompts)
    with pipe.hooks.running():
        try:
            while queue or live:
                while queue and len(live) < concurrency:
                    i = queue.pop(0)
                    rid = pipe.talker.start(prompts[i], **kwargs[i])
                    rec.keep_open(rid)
                    live[rid] = {"i": i, "session": pipe.code2wav.open_session(rid), "pending": [],
                                 "chunk": 0, "frame": 0, "done": False, "reason": ""}
                for rid, o in pipe.talker.step().items():
                    st = live.get(rid)
                    if st is None:
                        continue
                    if o.codes is not None:
                        st["pending"].append(o.codes)
                    if o.finished:
                        st["done"], st["reason"] = True, o.finish_reason or ""
                for rid, st in list(live.items()):
                    if st["pending"] and (st["done"] or len(st["pending"]) >= sched.chunk_frames(st["chunk"])):
                        t = clock()
                        codes = torch.stack(st["pending"]).numpy()
                        rec.span("hop", rid, t, frame_index=st["frame"], num_frames=len(codes))
                        t = clock()
                        audio = st["session"].push(codes)
                        rec.span("code2wav_chunk", rid, t, frame_index=st["frame"], num_frames=len(codes))
                        pipe._take_spans(st["session"])
                        rec.deliver(rid, st["frame"], st["frame"] + len(codes), len(audio))
                        st["frame"] += len(codes)
                        st["chunk"] += 1
                        st["pending"] = []
                    if st["done"]:
                        st["session"].close()
                        traces[st["i"]] = rec.end(rid, st["reason"])
                        del live[rid]
                        if on_done:
                            on_done(traces[st["i"]])
        finally:
            for rid, st in live.items():
                pipe.talker.abort(rid)
                st["session"].close()
                rec.end(rid, "abort")
    return traces


def _gemv_matrix(nbytes: float, dtype):
    import torch

    cols = 4096
    rows = max(int(nbytes) // (torch.finfo(dtype).bits // 8 * cols), 1)
    return torch.full((rows, cols), 0.5, dtype=dtype), torch.full((cols,), 0.25, dtype=dtype)


def measure_gemv_bandwidth(mib: int = 1024, reps: int = 5, threads: int | None = None) -> dict[str, float]:
    """DRAM bandwidth seen by an fp32 matrix-vector product: ``y = W @ x`` with ``W`` of ``mib`` MiB
    (far above the last-level cache), ``reps`` timed runs after one warm-up. GB/s = W bytes / time
    (10^9 bytes); ``gbps`` is the best run, ``gbps_median`` the median."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        w, x = _gemv_matrix(mib * 2**20, torch.float32)
        torch.mv(w, x)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            torch.mv(w, x)
            times.append(time.perf_counter() - t)
        nbytes = w.numel() * 4
        del w
    finally:
        torch.set_num_threads(old)
    times.sort()
    return {"gemv_mib": nbytes / 2**20, "gbps": nbytes / times[0] / 1e9,
            "gbps_median": nbytes / times[len(times) // 2] / 1e9, "threads": threads or old, "reps": reps}


def measure_frame_floor(bpf: dict[str, float], dtype_name: str = "float32", reps: int = 5,
                        threads: int | None = None) -> dict[str, float]:
    """The bandwidth floor of one frame, measured: a GEMV over a matrix the size of the talker decode's
    weights, then ``predictor_passes`` GEMVs over one the size of a code-predictor pass (so the predictor
    is re-read from cache when it fits, as in the real step). ``floor_ms`` is the best of ``reps``
    emulated frames (after a warm-up); also the talker-part GB/s and the predictor-part GB/s."""
    import torch

    dtype = getattr(torch, dtype_name)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        wt, xt = _gemv_matrix(bpf["talker_decode_bytes"], dtype)
        wp, xp = _gemv_matrix(bpf["predictor_pass_bytes"], dtype)
        n = int(bpf["predictor_passes"])
        best = (math.inf, math.inf, math.inf)
        for i in range(reps + 1):
            t0 = time.perf_counter()
            torch.mv(wt, xt)
            t1 = time.perf_counter()
            for _ in range(n):
                torch.mv(wp, xp)
            t2 = time.perf_counter()
            if i and t2 - t0 < best[0]:
                best = (t2 - t0, t1 - t0, t2 - t1)
        tb, pb = wt.numel() * wt.element_size(), wp.numel() * wp.element_size()
        del wt, wp
    finally:
        torch.set_num_threads(old)
    return {"floor_ms": 1e3 * best[0], "talker_gbps": tb / best[1] / 1e9, "predictor_gbps": n * pb / best[2] / 1e9,
            "reps": reps}


def bytes_per_frame(checkpoint: str | os.PathLike, dtype_bytes: int) -> dict[str, float]:
    """Weights read per frame at batch 1 by the talker step, from the checkpoint's tensor shapes
    (``model.safetensors`` header): one talker decode (``talker.model.layers.*``, final norm,
    ``codec_head``) and one code-predictor pass (its layers, norm, one ``lm_head``, projection) per
    predicted codebook (15). Embedding rows and KV-cache reads (< 1 % here) are not counted; code2wav
    is compute-bound and excluded."""
    import struct

    path = Path(checkpoint) / "model.safetensors"
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    talker = pred = heads = head_params = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        numel = math.prod(info["shape"])
        if name.startswith(("talker.model.layers.", "talker.model.norm.", "talker.codec_head.")):
            talker += numel
        elif name.startswith("talker.code_predictor.lm_head."):
            heads, head_params = heads + 1, head_params + numel
        elif name.startswith(("talker.code_predictor.model.layers.", "talker.code_predictor.model.norm.",
                              "talker.code_predictor.small_to_mtp_projection.")):
            pred += numel
    pass_params = pred + (head_params / heads if heads else 0)
    return {"talker_decode_bytes": float(talker * dtype_bytes), "predictor_pass_bytes": float(pass_params * dtype_bytes),
            "predictor_passes": heads,
            "talker_bytes_per_frame": float((talker + heads * pass_params) * dtype_bytes)}


def reference_available() -> bool:
    return REFERENCE_PYTHON.is_file() and REFERENCE_SCRIPT.is_file()


def run_reference(checkpoint: str | os.PathLike, prompts: Sequence[str], speaker: str, max_new_tokens: int,
                  threads: int, do_sample: bool, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """Run the official package on ``prompts`` (one process, model loaded once); per request: wall
    seconds of its ``generate`` call as the runner reports it (not streamed: TTFA = time to full audio;
    the runner also decodes the codes once more for its golden file, included) and frames."""
    reqs = [{"name": f"bench{i}", "api": "custom_voice", "text": t, "language": "english", "speaker": speaker,
             "gen": {"do_sample": do_sample, "subtalker_dosample": do_sample, "max_new_tokens": max_new_tokens}}
            for i, t in enumerate(prompts)]
    with tempfile.TemporaryDirectory(prefix="omnilab-ref-") as d:
        req_path = Path(d) / "requests.json"
        req_path.write_text(json.dumps(reqs))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        t = time.perf_counter()
        proc = subprocess.run([str(REFERENCE_PYTHON), str(REFERENCE_SCRIPT), str(checkpoint), str(req_path),
                               str(Path(d) / "out"), "--threads", str(threads)], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        total_s = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"reference run failed ({proc.returncode}): {proc.stderr[-2000:]}")
        manifest = json.loads((Path(d) / "out" / "manifest.json").read_text())
    rows = []
    for r in manifest.get("requests", []):
        shapes = r.get("shapes", {})
        codes = shapes.get("codes") or [0]
        frames = int(codes[0]) if isinstance(codes, (list, tuple)) else int(codes)
        rows.append({"seconds": float(r["seconds"]), "frames": frames, "process_s": total_s})
    return rows


def peak_rss_by_process(trace: Any) -> dict[str, float]:
    """``"role (pid)" -> peak RSS MiB`` (``VmHWM``, lifetime peak) from a trace's process samples."""
    out: dict[str, float] = {}
    for r in trace.process_samples:
        key = f"{r['role']} ({r['pid']})"
        out[key] = max(out.get(key, 0.0), float(r["peak_rss_mb"]))
    return out


def python_info() -> dict[str, str]:
    return {"python": sys.version.split()[0], "executable": sys.executable}
