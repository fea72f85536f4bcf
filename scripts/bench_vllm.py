"""Eager vs vLLM (in-process and stage workers) side by side on one checkpoint, one run.

Per backend: per-frame talker step (decode steps, prefill excluded), code-predictor and talker-forward
time, vLLM overhead per step (step - forward - predictor), code2wav ms per frame, TTFA and its parts,
RTF = wall / audio for 1 stream and aggregate frames/s for N concurrent streams (all started together,
chunked like ``Pipeline.stream``: first chunk 1 frame, then 25), and the peak resident memory of all
processes of the run (client + children, sampled every 0.2 s). Prints a table and writes JSON.

N-stream ratios: ``concurrent_speedup`` (end to end: all frames / wall, prefills and code2wav included),
``steady_speedup`` (decode steps only), ``talker_speedup`` (the talker stage: frames / time in talker steps,
prefills included) and ``e2e_ceiling`` (the end-to-end ratio if N rows cost one row's step; code2wav is
compute bound per stream and caps it).

    OMNILAB_CPU_INDUCTOR=1 python scripts/bench_vllm.py --checkpoint DIR --frames 40 --concurrency 4
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
         "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish."]


class MemorySampler:
    """Peak of the summed RSS of this process and all its descendants (and per-process peaks)."""

    def __init__(self, interval_s: float = 0.2):
        import psutil
        self.me, self.interval_s = psutil.Process(), interval_s
        self.peak_total, self.peaks = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        total = 0
        for p in [self.me] + self.me.children(recursive=True):
            try:
                rss = p.memory_info().rss
                name = p.name() if p.pid != self.me.pid else "client"
            except Exception:
                continue
            total += rss
            key = f"{p.pid}:{name}"
            self.peaks[key] = max(self.peaks.get(key, 0), rss)
        self.peak_total = max(self.peak_total, total)

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _med(xs):
    return round(statistics.median(xs), 2) if xs else None


def name_is_workers(pipe) -> bool:
    return bool(getattr(getattr(pipe._talker, "config", None), "multiprocess", False))


def run_streams(pipe, n: int, frames: int, schedule=(1, 25)) -> dict:
    """Start ``n`` requests together and stream them (sync code2wav pushes, as Pipeline.stream does)."""
    import torch
    talker, c2w = pipe._talker, pipe.code2wav
    kw = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False,
              max_new_tokens=frames + 1)
    t0 = time.perf_counter()
    live = {}
    for i in range(n):
        rid = pipe.talker.start(TEXTS[i % len(TEXTS)], **kw)
        live[rid] = {"pending": [], "chunks": 0, "frames": 0, "ttfa": None, "done": False, "t_first_frame": None}
    for rid in live:
        live[rid]["session"] = c2w.open_session(rid)
    steps, c2w_ms, c2w_frames, first_chunk_ms = [], [], 0, []
    while any(not s["done"] for s in live.values()):
        ts = time.perf_counter()
        outs = talker.step()
        step_ms = 1e3 * (time.perf_counter() - ts)
        rows = [o for o in outs if o.codes is not None]
        if rows:
            o = rows[0]
            steps.append({"step_ms": step_ms, "rows": len(rows), "prefill": any(r.prefill_ms > 0 for r in outs),
                          "talker_ms": o.talker_ms, "predictor_ms": o.predictor_ms, "input_prep_ms": o.input_prep_ms,
                          "sampling_ms": o.sampling_ms, "cycle_ms": getattr(o, "cycle_ms", 0.0),
                          "schedule_ms": getattr(o, "schedule_ms", 0.0), "engine_ms": getattr(o, "engine_ms", 0.0)})
        for o in outs:
            s = live[o.request_id]
            if o.codes is not None:
                s["pending"].append(o.codes)
                if s["t_first_frame"] is None:
                    s["t_first_frame"] = 1e3 * (time.perf_counter() - t0)
            s["done"] = s["done"] or o.finished
        for rid, s in live.items():
            need = schedule[0] if s["chunks"] == 0 else schedule[1]
            if s["pending"] and (s["done"] or len(s["pending"]) >= need):
                codes = torch.stack(s["pending"]).numpy()
                tc = time.perf_counter()
                s["session"].push(codes)
                ms = 1e3 * (time.perf_counter() - tc)
                c2w_ms.append(ms)
                c2w_frames += len(codes)
                if s["chunks"] == 0:
                    first_chunk_ms.append(ms)
                    s["ttfa"] = 1e3 * (time.perf_counter() - t0)
                s["frames"] += len(codes)
                s["chunks"] += 1
                s["pending"] = []
    wall_s = time.perf_counter() - t0
    for s in live.values():
        s["session"].close()
    total_frames = sum(s["frames"] for s in live.values())
    decode = [x for x in steps if not x["prefill"]]
    pre = [x for x in steps if x["prefill"]]
    out = {
        "streams": n, "frames": total_frames, "wall_s": round(wall_s, 3),
        "audio_s": round(total_frames * 0.08, 3), "rtf": round(wall_s / (total_frames * 0.08 / n), 3),
        "frames_per_s": round(total_frames / wall_s, 3),
        "ttfa_ms": _med([s["ttfa"] for s in live.values()]),
        "prefill_step_ms": _med([x["step_ms"] for x in pre]),
        "first_chunk_ms": _med(first_chunk_ms),
        "decode_step_ms": _med([x["step_ms"] for x in decode]),
        "talker_forward_ms": _med([x["talker_ms"] for x in decode]),
        "predictor_ms": _med([x["predictor_ms"] for x in decode]),
        "input_prep_ms": _med([x["input_prep_ms"] for x in decode]),
        "sampling_ms": _med([x["sampling_ms"] for x in decode]),
        "schedule_ms": _med([x["schedule_ms"] for x in decode]),
        "worker_cycle_ms": _med([x["cycle_ms"] for x in decode]),
        "code2wav_ms_per_frame": round(sum(c2w_ms) / max(c2w_frames, 1), 2),
    }
    # Per-step overhead: what is neither the talker forward nor the code predictor, median over decode
    # steps. Step time = the client's step() wall in-process (code2wav pushes happen outside it); with stage
    # workers it is the worker's whole cycle (idle gap for scheduling/IPC + execute + sample).
    base = "cycle_ms" if name_is_workers(pipe) else "step_ms"
    ovs = [(x[base] - x["talker_ms"] - x["predictor_ms"], x[base]) for x in decode if x[base] > 0]
    if ovs:
        out["overhead_ms"] = _med([o for o, _ in ovs])
        out["overhead_pct"] = _med([100 * o / b for o, b in ovs])
    out["steady_frames_per_s"] = round(1e3 * n / out["decode_step_ms"], 3) if out["decode_step_ms"] else None
    # the talker stage alone: frames over the time spent in talker steps (prefills included, code2wav excluded)
    talker_s = sum(x["step_ms"] for x in steps) / 1e3
    out["talker_frames_per_s"] = round(total_frames / talker_s, 3) if talker_s else None
    return out


BACKENDS = {
    # name -> how it is built (all fp32, same checkpoint)
    "eager": "plain torch in this process (talker + predictor + code2wav), --threads torch threads",
    "vllm": "vLLM engine in this process (lock-step), code2wav in this process, --threads torch threads",
    "vllm-workers": "Pipeline.from_pretrained(deploy='workers') under the auto deploy profile: vLLM engine-core + "
                    "talker worker + code2wav worker, CPUs and threads as planned (--threads = talker threads)",
    "vllm-inductor": "as vllm, with the code predictor's MLPs compiled by inductor (OMNILAB_CPU_INDUCTOR)",
    "vllm-workers-inductor": "as vllm-workers, predictor MLPs compiled by inductor",
    "vllm-compiled": "as vllm, with vLLM's own torch.compile path for the talker (enforce_eager=False)",
}
# Suffixes for any backend (combinable): the environment each sets while the backend is built (and, for
# worker processes, for their lifetime).
MODIFIERS = {
    "+torch-gemv": {"OMNILAB_CPU_GEMV": "torch"},   # every linear on torch (MKL), not omnilab's 4-8 row kernel
    "+huge-pages": {"OMNILAB_HUGEPAGES": "on"},     # decode weights in a huge-page arena (opt-in)
    "+fp32-weights": {"OMNILAB_DECODE_WEIGHTS": "compute"},  # fp32 copies of the bf16 decode matrices
    "+avx2-gemv": {"OMNILAB_CPU_GEMV": "omnilab-avx2"},  # the AVX2 build of the GEMV kernel
    "+torch-snake": {"OMNILAB_CPU_SNAKE": "torch"},  # code2wav's SnakeBeta as torch's 4 passes, not the fused kernel
    # the AVX2 builds of both kernels (what an AVX2-only CPU runs; add the MKL/ATen/oneDNN caps of _isa_env)
    "+avx2-kernels": {"OMNILAB_CPU_GEMV": "omnilab-avx2", "OMNILAB_CPU_SNAKE": "omnilab-avx2"},
}
MODIFIER_VARS = sorted({var for env in MODIFIERS.values() for var in env})


def split_name(name: str) -> tuple[str, dict[str, str]]:
    """``"vllm+torch-gemv+huge-pages"`` -> ``("vllm", {"OMNILAB_CPU_GEMV": "torch", "OMNILAB_HUGEPAGES": "on"})``."""
    base, env = name, {}
    changed = True
    while changed:
        changed = False
        for suffix, values in MODIFIERS.items():
            if base.endswith(suffix):
                base, changed = base[: -len(suffix)], True
                env.update(values)
    if base not in BACKENDS:
        raise SystemExit(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)}, each with optional suffixes "
                         f"{', '.join(MODIFIERS)}")
    return base, env


def apply_env(name: str) -> None:
    """Set this backend's modifier variables (and clear the others) before it is built; the GEMV choice of
    this process is re-resolved."""
    from omnilab.kernels import gemv, snake
    env = split_name(name)[1]
    for var in MODIFIER_VARS:
        os.environ.pop(var, None)
    os.environ.update(env)
    gemv.reset()
    snake.reset()


def build(name: str, ckpt: str, args):
    from omnilab.pipeline import Pipeline
    from omnilab.stages.vllm.deploy import VllmDeploy
    from omnilab.stages.vllm.engine import VllmStageConfig

    name, _ = split_name(name)
    inductor = name.endswith("-inductor")
    compiled = name == "vllm-compiled" or args.compile_talker
    common = dict(max_model_len=args.max_model_len, block_size=128, enforce_eager=not compiled,
                  compile_predictor=inductor, max_num_seqs=max(args.concurrency, 1))
    if name == "eager":
        return Pipeline.from_pretrained(ckpt, backend="eager", dtype="float32", num_threads=args.threads,
                                        deploy_profile=None)
    if name.startswith("vllm-workers"):
        if args.talker_cpus is None and args.code2wav_cpus is None:  # what users get: the auto profile
            import dataclasses
            from omnilab.deployment import prepare
            dep = prepare(Path(ckpt), backend="vllm", deploy="workers", dtype="float32", num_threads=args.threads,
                          max_concurrency=args.concurrency)
            d = dep.vllm_deploy
            talker = dataclasses.replace(d.talker, max_model_len=args.max_model_len, enforce_eager=not compiled,
                                         compile_predictor=inductor, kv_cache_memory_bytes=None)  # as in-process
            return Pipeline.from_pretrained(ckpt, backend="vllm", dtype="float32",
                                            deploy=dataclasses.replace(d, talker=talker))
        cpus = sorted(os.sched_getaffinity(0))
        talker_cpus = tuple(cpus[:args.threads]) if args.talker_cpus is None else tuple(args.talker_cpus)
        c2w_cpus = (cpus[-1],) if args.code2wav_cpus is None else tuple(args.code2wav_cpus)
        deploy = VllmDeploy(VllmStageConfig(multiprocess=True, talker_cpus=talker_cpus,
                                            talker_threads=len(talker_cpus), **common),
                            code2wav="process", code2wav_cpus=c2w_cpus, code2wav_threads=len(c2w_cpus))
        return Pipeline.from_pretrained(ckpt, backend="vllm", dtype="float32", deploy=deploy)
    import torch
    torch.set_num_threads(args.threads)
    return Pipeline.from_pretrained(ckpt, backend="vllm", dtype="float32", deploy_profile=None,
                                    deploy=VllmDeploy(VllmStageConfig(talker_threads=args.threads, **common),
                                                      code2wav="inprocess"))


def _fresh_processes(names, args, argv) -> int:
    """Run each backend in its own interpreter (same arguments) and merge the JSON files."""
    import subprocess
    import tempfile
    merged, out = {}, Path(args.out)
    base = [a for a in argv]
    parts = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    for name in names:
        part = parts / f"{name}.json"
        cmd = [sys.executable, __file__] + _replace_opt(_replace_opt(base, "--backends", name), "--out", str(part))
        if subprocess.call(cmd) != 0:
            print(f"backend {name} failed", file=sys.stderr)
            continue
        d = json.loads(part.read_text())
        merged.setdefault("meta", {}).update({f"{name}.{k}": v for k, v in d.pop("meta").items()})
        merged.update(d)
    out.write_text(json.dumps(merged, indent=1))
    print(f"merged -> {out}")
    _print_table(merged, [n for n in names if n in merged])
    print(json.dumps(_headline(merged)))
    return 0


def _replace_opt(argv, opt, value):
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == opt:
            skip = True
            continue
        if a.startswith(opt + "="):
            continue
        out.append(a)
    return out + [opt, value]


def _print_table(results: dict, names) -> None:
    keys = ["decode_step_ms", "talker_forward_ms", "predictor_ms", "overhead_pct", "code2wav_ms_per_frame",
            "prefill_step_ms", "first_chunk_ms", "ttfa_ms", "rtf", "frames_per_s", "floor_ratio"]
    print("\n" + "metric".ljust(24) + "".join(n.rjust(16) for n in names))
    for mode in ("single", "concurrent"):
        for k in keys:
            row = [results[n][mode].get(k) if results[n].get(mode) else None for n in names]
            print(f"{mode[:4]} {k}".ljust(24) + "".join(str(v).rjust(16) for v in row))
    for k in ("floor_ms", "concurrent_speedup", "steady_speedup", "talker_speedup", "e2e_ceiling", "peak_rss_total_gib",
              "init_s"):
        print(k.ljust(24) + "".join(str(results[n].get(k)).rjust(16) for n in names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--backends", default="eager,vllm,vllm-workers",
                    help="comma-separated: " + "; ".join(f"{k}: {v}" for k, v in BACKENDS.items()))
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="talker threads (eager / in-process / worker)")
    ap.add_argument("--talker-cpus", type=int, nargs="*", default=None)
    ap.add_argument("--code2wav-cpus", type=int, nargs="*", default=None)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--compile-talker", action="store_true", help="vLLM torch.compile for the talker")
    ap.add_argument("--out", default=str(ROOT / "data" / "bench" / "vllm_bench.json"))
    ap.add_argument("--same-process", action="store_true",
                    help="run every backend in this process (default: one fresh process each, so memory "
                         "figures are not inflated by an earlier backend)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="build the (in-process) backends side by side in this process and alternate single-stream "
                         "runs for ROUNDS rounds: per-backend medians and ratios to the first backend, free of the "
                         "drift between sequential runs on a shared machine")
    args = ap.parse_args(argv)
    names = args.backends.split(",")
    if args.interleave:
        return interleave(names, args)
    if len(names) > 1 and not args.same_process:
        return _fresh_processes(names, args, argv if argv is not None else sys.argv[1:])
    from omnilab.pipeline import flush_denormals
    flush_denormals()
    results = {"meta": {"checkpoint": args.checkpoint, "frames": args.frames, "threads": args.threads,
                        "inductor": os.environ.get("OMNILAB_CPU_INDUCTOR", "0"), "compile_talker": args.compile_talker,
                        "load_start": os.getloadavg(), "cpus": sorted(os.sched_getaffinity(0)), "isa_env": _isa_env()}}
    from omnilab.bench import drivers as drv
    bpf = drv.bytes_per_frame(args.checkpoint, 4)
    results["meta"]["bytes_per_frame"] = bpf

    def floor() -> float:  # the memory-bandwidth floor of one frame right now (shared machine)
        return round(drv.measure_frame_floor(bpf, threads=args.threads, reps=2)["floor_ms"], 1)

    from omnilab.kernels import gemv_choice
    for name in names:
        gc.collect()
        floor_before = floor()
        apply_env(name)
        with MemorySampler() as mem:
            t = time.perf_counter()
            pipe = build(name, args.checkpoint, args)
            init_s = time.perf_counter() - t
            weights_label = pipe.deployment.weights.label
            run_streams(pipe, 1, 4)  # warm-up
            one = run_streams(pipe, 1, args.frames)
            many = run_streams(pipe, args.concurrency, args.frames) if args.concurrency > 1 else None
            procs = pipe.processes()
            pipe.close()
        del pipe
        floor_ms = round((floor_before + floor()) / 2, 1)
        one["floor_ratio"] = round(one["decode_step_ms"] / floor_ms, 2) if one["decode_step_ms"] else None
        r = {"init_s": round(init_s, 1), "gemv": gemv_choice().label, "weights": weights_label,
             "env": split_name(name)[1],
             "floor_ms": floor_ms, "single": one, "concurrent": many, "processes": procs,
             "peak_rss_total_gib": round(mem.peak_total / 2**30, 3),
             "peak_rss_gib": {k: round(v / 2**30, 3) for k, v in mem.peaks.items()}}
        if many:
            r["concurrent_speedup"] = round(many["frames_per_s"] / one["frames_per_s"], 3)
            r["steady_speedup"] = round(many["steady_frames_per_s"] / one["steady_frames_per_s"], 3)
            r["talker_speedup"] = round(many["talker_frames_per_s"] / one["talker_frames_per_s"], 3)
            r["e2e_ceiling"] = e2e_ceiling(one, many)
        results[name] = r
        print(name, json.dumps(r, indent=1), flush=True)
    results["meta"]["load_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    _print_table(results, names)
    print(json.dumps(_headline(results)))
    return 0


def e2e_ceiling(one: dict, many: dict) -> float | None:
    """The most the end-to-end steady ratio could be if N streams' talker step cost no more than one stream's
    (weights read once, nothing else per row): ``N (S1 + C1) / (S1 + N C_N)``, S = talker step, C = code2wav ms
    per frame. code2wav is compute bound per stream, so its share does not shrink with N."""
    s1, c1, cn, n = one["decode_step_ms"], one["code2wav_ms_per_frame"], many["code2wav_ms_per_frame"], many["streams"]
    return round(n * (s1 + c1) / (s1 + n * cn), 3) if s1 and c1 and cn else None


def _isa_env() -> dict[str, str]:
    """Variables that cap the ISA of torch / MKL / oneDNN (set them to emulate an AVX2-only CPU)."""
    return {k: os.environ[k] for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
            if k in os.environ}


def _modes(name: str):
    """This backend's GEMV and SnakeBeta modes as one context (switched per run in ``--interleave``)."""
    from omnilab.kernels import use_gemv
    from omnilab.kernels.snake import use_snake
    env = split_name(name)[1]
    stack = contextlib.ExitStack()
    stack.enter_context(use_gemv(env.get("OMNILAB_CPU_GEMV", "auto")))
    stack.enter_context(use_snake(env.get("OMNILAB_CPU_SNAKE", "auto")))
    return stack


def interleave(names: list[str], args) -> int:
    """Alternate runs of in-process backends held side by side (see ``--interleave``): per round, each backend
    streams one request and then, with ``--concurrency`` > 1, that many together."""
    if any(n.startswith("vllm-workers") for n in names):
        raise SystemExit("--interleave takes in-process backends only (workers bind CPUs for their lifetime)")
    from omnilab.pipeline import flush_denormals
    flush_denormals()
    pipes = {}
    for n in names:
        apply_env(n)  # the weight placement is fixed at load; the kernel modes are switched per run below
        pipes[n] = build(n, args.checkpoint, args)
    for n, p in pipes.items():
        with _modes(n):
            run_streams(p, 1, 4)  # warm-up
    from omnilab.bench import drivers as drv
    bpf = drv.bytes_per_frame(args.checkpoint, 4)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    many: dict[str, list[dict]] = {n: [] for n in names}
    floors = []
    for r in range(args.interleave):
        floors.append(drv.measure_frame_floor(bpf, threads=args.threads, reps=2)["floor_ms"])
        # the order rotates every round, so position effects (running first, right after the floor measurement
        # frees its 2 GB of matrices) average out instead of landing on one backend
        for n in names[r % len(names):] + names[:r % len(names)]:
            with _modes(n):
                runs[n].append(run_streams(pipes[n], 1, args.frames))
                if args.concurrency > 1:
                    many[n].append(run_streams(pipes[n], args.concurrency, args.frames))
                    many[n][-1]["speedup"] = round(many[n][-1]["frames_per_s"] / runs[n][-1]["frames_per_s"], 3)
                    many[n][-1]["talker_speedup"] = round(many[n][-1]["talker_frames_per_s"]
                                                          / runs[n][-1]["talker_frames_per_s"], 3)
                    many[n][-1]["e2e_ceiling"] = e2e_ceiling(runs[n][-1], many[n][-1])
            runs[n][-1]["floor_ratio"] = round(runs[n][-1]["decode_step_ms"] / floors[-1], 3)
        print(f"round {r + 1}: floor {floors[-1]:.0f} ms  " + "  ".join(
            f"{n} {runs[n][-1]['decode_step_ms']:.0f} ms (x{runs[n][-1]['floor_ratio']:.2f})"
            + (f" {args.concurrency} streams x{many[n][-1]['speedup']:.2f}" if many[n] else "") for n in names),
            flush=True)
    for p in pipes.values():
        p.close()
    keys = ("decode_step_ms", "floor_ratio", "talker_forward_ms", "predictor_ms", "code2wav_ms_per_frame", "ttfa_ms",
            "rtf")
    res = {n: {k: _med([x[k] for x in runs[n] if x.get(k) is not None]) for k in keys} for n in names}
    if args.concurrency > 1:
        for n in names:
            res[n].update({f"concurrent_{k}": _med([x[k] for x in many[n]])
                           for k in ("decode_step_ms", "code2wav_ms_per_frame", "frames_per_s", "speedup",
                                     "talker_speedup", "e2e_ceiling")})
            res[n]["single_frames_per_s"] = _med([x["frames_per_s"] for x in runs[n]])
        keys = keys + ("single_frames_per_s", "concurrent_decode_step_ms", "concurrent_code2wav_ms_per_frame",
                       "concurrent_frames_per_s", "concurrent_speedup", "concurrent_talker_speedup",
                       "concurrent_e2e_ceiling")
    base = names[0]
    print("\nmedian over rounds".ljust(24) + "".join(n.rjust(16) for n in names))
    for k in keys:
        print(k[:23].ljust(24) + "".join(str(res[n][k]).rjust(16) for n in names))
    print(f"step ratio to {base}".ljust(24) + "".join(
        str(round(res[n]["decode_step_ms"] / res[base]["decode_step_ms"], 3)).rjust(16) for n in names))
    print(f"floor ms per round: {[round(f, 1) for f in floors]}")
    out = {"bench": "vllm_stage_interleaved", "checkpoint": args.checkpoint, "rounds": args.interleave,
           "floor_ms": [round(f, 1) for f in floors],
           "frames": args.frames, "threads": args.threads, "isa_env": _isa_env(), "median": res,
           "step_ratio": {n: round(res[n]["decode_step_ms"] / res[base]["decode_step_ms"], 3) for n in names},
           "weights": {n: p.deployment.weights.label for n, p in pipes.items()},
           "concurrency": args.concurrency, "runs": runs, "concurrent_runs": many}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("bench", "rounds", "median", "step_ratio")}))
    return 0


def _headline(results: dict) -> dict:
    """One JSON line: per backend the figures the targets are stated in."""
    meta = results.get("meta", {})
    ckpt = meta.get("checkpoint") or next((v for k, v in meta.items() if k.endswith(".checkpoint")), None)
    out = {"bench": "vllm_stage", "checkpoint": ckpt}
    for name, r in results.items():
        if name == "meta" or not isinstance(r, dict) or "single" not in r:
            continue
        one, many = r["single"], r.get("concurrent") or {}
        out[name] = {"gemv": r.get("gemv"), "weights": r.get("weights"), "step_ms": one.get("decode_step_ms"), "predictor_ms": one.get("predictor_ms"),
                     "overhead_pct": one.get("overhead_pct"), "code2wav_ms_per_frame": one.get("code2wav_ms_per_frame"),
                     "ttfa_ms": one.get("ttfa_ms"), "rtf": one.get("rtf"), "floor_ms": r.get("floor_ms"),
                     "conc_speedup": r.get("concurrent_speedup"), "steady_speedup": r.get("steady_speedup"),
                     "talker_speedup": r.get("talker_speedup"), "e2e_ceiling": r.get("e2e_ceiling"),
                     "conc_rtf": many.get("rtf"), "peak_rss_gib": r.get("peak_rss_total_gib")}
    return out


if __name__ == "__main__":
    sys.exit(main())
