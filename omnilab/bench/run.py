"""``omnilab bench``: the stream-latency benchmark (``bench_main(argv)``; Python: ``run_bench(BenchConfig)``).

For each backend (eager; vLLM in-process and vLLM stage workers when ``omnilab.pipeline.BACKENDS`` has
"vllm"; the official reference when ``.venv-ref`` exists): build the pipeline (fp32 by default), warm up,
then for each concurrency (1, 2, 4, ...) stream N prompts from ``omnilab/bench/prompts/harvard.txt`` with at most
that many in flight, recording every request's ``Trace`` plus thread/process samples. Reports per point:
TTFA, playback-start latency and stall (vLLM-Omni stream-bench definitions, ``omnilab.instrument.trace``), RTF =
wall/audio and x-realtime = audio/wall, talker/code2wav ms per frame (+ talker phases), aggregate frames/s,
peak RSS per process (``VmHWM``: lifetime peak, so the bench process carries earlier backends' peaks
over), the sampler's own CPU as % of step time, run-queue wait % (time our threads were
runnable but had no CPU: other load on a shared machine), and the memory-bandwidth floor of a talker
step: the weights it reads per frame (``bench_drivers.bytes_per_frame``) timed as pure GEMVs on this
machine (``measure_frame_floor``; the all-DRAM figure, bytes / DRAM GEMV GB/s, is in the meta), with
``floor_ratio`` = talker compute ms/frame / floor ms/frame (1 = at the floor; compute = the step's
phases, which for a stage-worker backend is the time the worker reported, not the client's wait).
Prints a table, writes ``<out>/<name>.json`` + ``_summary.csv`` + ``_requests.csv``, and ends with one
JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import inspect
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omnilab.bench import drivers as drv

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "harvard.txt"  # package data
DEFAULT_OUT = "omnilab-bench"  # results go to ./omnilab-bench/ unless --out names a directory
# bench backend name -> Pipeline.from_pretrained keyword arguments
BENCH_BACKENDS: dict[str, dict[str, Any]] = {
    "eager": {"backend": "eager"},
    "vllm": {"backend": "vllm"},                               # engine in this process, lock-step
    "vllm-workers": {"backend": "vllm", "deploy": "workers"},  # engine-core, talker, code2wav workers
}
TABLE_COLUMNS = (("backend", "backend", "{}"), ("conc", "concurrency", "{}"), ("n", "requests", "{}"),
                 ("TTFA p50 ms", "ttfa_ms_p50", "{:.0f}"), ("play-start p50 ms", "playback_start_ms_p50", "{:.0f}"),
                 ("stall p50 ms", "stall_ms_p50", "{:.0f}"), ("RTF wall/audio", "rtf_mean", "{:.2f}"),
                 ("x-realtime", "x_realtime_mean", "{:.3f}"), ("talker ms/frame", "talker_ms_per_frame", "{:.1f}"),
                 ("talker compute ms/frame", "talker_compute_ms_per_frame", "{:.1f}"),
                 ("c2w ms/frame", "code2wav_ms_per_frame", "{:.1f}"), ("frames/s", "frames_per_s", "{:.2f}"),
                 ("peak RSS MiB", "peak_rss_mb", "{:.0f}"), ("floor ms/frame", "floor_ms_per_frame", "{:.1f}"),
                 ("achieved/floor", "floor_ratio", "{:.2f}"), ("sampler %", "sampler_pct_of_step", "{:.2f}"),
                 ("run-queue wait %", "cpu_wait_pct", "{:.0f}"))


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``checkpoint`` None -> a random checkpoint of ``size`` in the omnilab cache."""
    checkpoint: str | None = None
    size: str = "tiny"
    dtype: str = "float32"
    threads: int = 2
    backends: tuple[str, ...] = ("auto",)
    concurrency: tuple[int, ...] = (1, 2)
    requests: int = 4
    warmup: int = 1
    max_new_tokens: int = 40
    prompts: str = str(DEFAULT_PROMPTS)
    seed: int = 0
    sampler_interval_s: float | None = 0.05
    gemv_mib: int = 1024
    reference: str = "auto"  # auto | on | off
    backend_kwargs: dict = field(default_factory=dict)  # name -> extra from_pretrained kwargs

    def __post_init__(self):
        if self.threads < 1 or self.requests < 1 or any(c < 1 for c in self.concurrency):
            raise ValueError("threads, requests and concurrency levels must be >= 1")
        if self.reference not in ("auto", "on", "off"):
            raise ValueError(f"reference={self.reference!r}; accepted: auto, on, off")


def available_backends() -> list[str]:
    from omnilab.pipeline import BACKENDS

    return [name for name, kw in BENCH_BACKENDS.items() if kw["backend"] in BACKENDS]


def checkpoint_for(cfg: BenchConfig) -> Path:
    if cfg.checkpoint:
        return Path(cfg.checkpoint)
    from omnilab.checkpoint.random import default_checkpoint, make_random_checkpoint
    from omnilab.paths import cache_dir

    if cfg.size == "tiny":
        return default_checkpoint()
    path = cache_dir() / "checkpoints" / f"{cfg.size}-custom_voice-seed0-v1"
    if not (path / "speech_tokenizer" / "model.safetensors").is_file():
        make_random_checkpoint(path, cfg.size, "custom_voice", 0, overwrite=True)
    return path


def load_prompts(path: str | os.PathLike) -> list[str]:
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


class BenchResult:
    """``summary`` (one row per backend x concurrency), ``requests`` (one row per request) DataFrames
    and ``meta`` (machine, checkpoint, bandwidth). Renders as a table in notebooks."""

    def __init__(self, summary, requests, meta: dict[str, Any]):
        self.summary, self.requests, self.meta = summary, requests, meta

    def table(self) -> str:
        rows = [[h for h, _, _ in TABLE_COLUMNS]]
        for _, r in self.summary.iterrows():
            rows.append([_fmt(fmt, r.get(col)) for _, col, fmt in TABLE_COLUMNS])
        w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [" | ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
        lines.insert(1, "-|-".join("-" * x for x in w))
        return "\n".join(lines)

    def save(self, out_dir: str | os.PathLike, name: str) -> dict[str, Path]:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"json": d / f"{name}.json", "summary_csv": d / f"{name}_summary.csv",
                 "requests_csv": d / f"{name}_requests.csv"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1, default=_jsonable))
        self.summary.to_csv(paths["summary_csv"], index=False)
        self.requests.to_csv(paths["requests_csv"], index=False)
        return paths

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "summary": self.summary.to_dict("records"),
                "requests": self.requests.to_dict("records")}

    def json_line(self) -> str:
        keys = ("backend", "concurrency", "ttfa_ms_p50", "playback_start_ms_p50", "stall_ms_p50", "rtf_mean",
                "x_realtime_mean", "talker_ms_per_frame", "talker_compute_ms_per_frame", "code2wav_ms_per_frame",
                "frames_per_s", "floor_ratio")
        pts = [{k: _round(r.get(k)) for k in keys} for r in self.summary.to_dict("records")]
        return json.dumps({"bench": "stream_latency", "checkpoint": self.meta.get("checkpoint"),
                           "dtype": self.meta.get("dtype"), "threads": self.meta.get("threads"),
                           "gemv_gbps": _round(self.meta.get("bandwidth", {}).get("gbps")), "points": pts},
                          default=_jsonable)

    def __repr__(self) -> str:
        return f"BenchResult(points={len(self.summary)}, requests={len(self.requests)})"

    def _repr_html_(self) -> str:
        cols = [c for _, c, _ in TABLE_COLUMNS if c in self.summary]
        bw = self.meta.get("bandwidth", {})
        head = (f"<b>stream-latency benchmark</b>: {html.escape(str(self.meta.get('checkpoint')))}, "
                f"{self.meta.get('dtype')}, {self.meta.get('threads')} threads, GEMV {bw.get('gbps', math.nan):.1f} GB/s")
        return f"<div>{head}{self.summary[cols].round(3).to_html(index=False, border=0)}</div>"


def load_bench(path: str | os.PathLike) -> BenchResult:
    """Read a benchmark JSON written by :meth:`BenchResult.save`."""
    import pandas as pd

    d = json.loads(Path(path).read_text())
    return BenchResult(pd.DataFrame(d["summary"]), pd.DataFrame(d["requests"]), d["meta"])


def _fmt(fmt: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _round(v: Any) -> Any:
    return round(v, 3) if isinstance(v, float) and math.isfinite(v) else (None if isinstance(v, float) else v)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def _make_pipeline(name: str, ckpt: Path, cfg: BenchConfig, hooks: list):
    from omnilab.pipeline import Pipeline

    kw = {**BENCH_BACKENDS.get(name, {"backend": name}), **cfg.backend_kwargs.get(name, {})}
    params = inspect.signature(Pipeline.from_pretrained).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        dropped = sorted(set(kw) - set(params))
        if dropped:
            raise ValueError(f"Pipeline.from_pretrained does not take {dropped} (bench backend {name!r})")
    kw.setdefault("max_concurrency", max(cfg.concurrency))  # the profile sizes KV and max_num_seqs for it
    return Pipeline.from_pretrained(ckpt, dtype=cfg.dtype, num_threads=cfg.threads, hooks=hooks, **kw)


def _point_summary(name: str, conc: int, driver: str, traces: list, wall_s: float, sampler, floor_ms: float,
                   init_s: float) -> tuple[dict, list[dict]]:
    import numpy as np

    from omnilab.instrument.trace import Trace, percentiles

    reqs = []
    for i, tr in enumerate(traces):
        if tr is None or not tr.request_ids:
            continue
        m = tr.request_metrics()
        reqs.append({"backend": name, "concurrency": conc, "index": i, **m})
    steps = {(s.pid, s.start_s, s.end_s) for tr in traces if tr is not None for s in tr.spans if s.name == "step"}
    step_ms = sum(1e3 * (b - a) for _, a, b in steps)
    frames = sum(r["frames"] for r in reqs)
    audio_ms = sum(r["audio_ms"] for r in reqs)
    col = lambda k: [r[k] for r in reqs if r[k] == r[k]]  # noqa: E731  (drop NaN)
    mean = lambda k: float(np.mean(col(k))) if col(k) else math.nan  # noqa: E731
    row = {"backend": name, "driver": driver, "concurrency": conc, "requests": len(reqs), "frames": frames,
           "audio_s": audio_ms / 1e3, "wall_s": wall_s, "init_s": init_s,
           "frames_per_s": frames / wall_s if wall_s > 0 else math.nan,
           "rtf_aggregate": wall_s / (audio_ms / 1e3) if audio_ms else math.inf,
           "rtf_mean": mean("rtf"), "x_realtime_mean": mean("x_realtime"), "stall_ms_mean": mean("stall_ms")}
    for k in ("ttfa_ms", "playback_start_ms", "stall_ms"):
        row.update({f"{k}_{q}": v for q, v in percentiles(col(k), (50, 90)).items()})
    for k in ("talker_ms_per_frame", "talker_compute_ms_per_frame", "code2wav_ms_per_frame",
              "code2wav_compute_ms_per_frame", "prefill_ms",
              "code_predictor_ms_per_frame", "input_prep_ms_per_frame", "talker_forward_ms_per_frame",
              "sampling_ms_per_frame", "step_ms_p50", "step_ms_p99"):
        row[k] = mean(k)
    merged = Trace([s for tr in traces if tr is not None for s in tr.spans])
    if sampler is not None:
        merged.process_samples = sampler.collect()["process_samples"]
        ov = sampler.overhead()
        row["sampler_cpu_ms"] = ov["sampler_cpu_ms"]
        row["sampler_pct_of_step"] = 100 * ov["sampler_cpu_ms"] / step_ms if step_ms else math.nan
        th = sampler.collect()["thread_samples"]
        cpu, wait = sum(r["cpu_ms"] for r in th), sum(r["wait_ms"] for r in th)
        row["cpu_wait_pct"] = 100 * wait / (cpu + wait) if cpu + wait else math.nan  # machine contention
        rss = drv.peak_rss_by_process(merged)
        row["peak_rss_mb"] = max(rss.values()) if rss else math.nan
        row["peak_rss_by_process"] = json.dumps({k: round(v, 1) for k, v in rss.items()})
    row["floor_ms_per_frame"] = floor_ms
    row["floor_ratio"] = row["talker_compute_ms_per_frame"] / floor_ms if floor_ms else math.nan
    return row, reqs


def run_bench(cfg: BenchConfig, progress: bool = True, log=print) -> BenchResult:
    """Run the benchmark described by ``cfg`` (see the module docstring)."""
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from omnilab.instrument.hooks import ThreadUsageHook, TimingHook
    from omnilab.pipeline import flush_denormals

    flush_denormals()
    ckpt = checkpoint_for(cfg)
    prompts = load_prompts(cfg.prompts)
    names = available_backends() if "auto" in cfg.backends else list(cfg.backends)
    torch.set_num_threads(cfg.threads)
    log(f"[bench] GEMV bandwidth probe ({cfg.gemv_mib} MiB fp32, {cfg.threads} threads)...")
    bw = drv.measure_gemv_bandwidth(cfg.gemv_mib, threads=cfg.threads)
    dtype_bytes = 2 if "16" in cfg.dtype else 4
    bpf = drv.bytes_per_frame(ckpt, dtype_bytes)
    ff = drv.measure_frame_floor(bpf, cfg.dtype, threads=cfg.threads)
    floor_ms = ff["floor_ms"]
    floor_dram_ms = 1e3 * bpf["talker_bytes_per_frame"] / (bw["gbps"] * 1e9)
    meta = {"checkpoint": str(ckpt), "size": cfg.size, "dtype": cfg.dtype, "threads": cfg.threads,
            "config": dataclasses.asdict(cfg), "bandwidth": bw, "bytes_per_frame": bpf, "frame_floor": ff,
            "floor_ms_per_frame": floor_ms, "floor_dram_ms_per_frame": floor_dram_ms,
            "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                        "torch": torch.__version__, **drv.python_info()},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": []}
    log(f"[bench] DRAM GEMV {bw['gbps']:.1f} GB/s (median {bw['gbps_median']:.1f}); the talker step reads "
        f"{bpf['talker_bytes_per_frame'] / 1e9:.2f} GB/frame ({bpf['talker_decode_bytes'] / 1e9:.2f} talker + "
        f"{int(bpf['predictor_passes'])} x {bpf['predictor_pass_bytes'] / 1e9:.3f} predictor) -> all-DRAM floor "
        f"{floor_dram_ms:.0f} ms/frame; emulated frame (cache reuse included) {floor_ms:.0f} ms/frame "
        f"(talker part {ff['talker_gbps']:.1f} GB/s, predictor part {ff['predictor_gbps']:.1f} GB/s)")
    summary, per_req = [], []
    for name in names:
        timing = TimingHook()
        sampler = ThreadUsageHook(cfg.sampler_interval_s) if cfg.sampler_interval_s else None
        t = time.perf_counter()
        try:
            pipe = _make_pipeline(name, ckpt, cfg, [timing] + ([sampler] if sampler else []))
        except Exception as e:  # a backend that cannot start is reported, not fatal
            meta["notes"].append(f"{name}: could not start: {type(e).__name__}: {e}")
            log(f"[bench] {name}: could not start: {e}")
            continue
        init_s = time.perf_counter() - t
        try:
            spk = pipe.model.config.speakers[0] if pipe.model.config.speakers else None
            base = {"speaker": spk, "language": "english", "max_new_tokens": cfg.max_new_tokens}
            warm = [prompts[i % len(prompts)] for i in range(cfg.warmup)]
            drv.stream_requests(pipe, warm, [{**base, "seed": cfg.seed + i} for i in range(len(warm))], 1)
            for conc in cfg.concurrency:
                texts = [prompts[(cfg.warmup + i) % len(prompts)] for i in range(cfg.requests)]
                kws = [{**base, "seed": cfg.seed + 1000 + i} for i in range(cfg.requests)]
                if sampler:
                    sampler.reset()
                bar = tqdm(total=len(texts), desc=f"{name} c={conc}", unit="req", disable=not progress, leave=False)
                t = time.perf_counter()
                with pipe.hooks.running():
                    traces = drv.stream_requests(pipe, texts, kws, conc, on_done=lambda _: bar.update(1))
                wall = time.perf_counter() - t
                bar.close()
                driver = "pipe.stream" if conc == 1 else "step-wise (talker.step + code2wav sessions)"
                row, reqs = _point_summary(name, conc, driver, traces, wall, sampler, floor_ms, init_s)
                summary.append(row)
                per_req += reqs
                log(f"[bench] {name} c={conc}: TTFA p50 {row['ttfa_ms_p50']:.0f} ms, talker "
                    f"{row['talker_ms_per_frame']:.1f} ms/frame, {row['frames_per_s']:.2f} frames/s")
        finally:
            pipe.close()
    if cfg.reference == "on" or (cfg.reference == "auto" and drv.reference_available()):
        summary_row = _reference_point(ckpt, prompts, cfg, floor_ms, meta, log)
        if summary_row is not None:
            summary.append(summary_row[0])
            per_req += summary_row[1]
    elif cfg.reference == "auto":
        meta["notes"].append("reference: .venv-ref not found, skipped")
    return BenchResult(pd.DataFrame(summary), pd.DataFrame(per_req), meta)


def _reference_point(ckpt, prompts, cfg: BenchConfig, floor_ms: float, meta: dict, log):
    from omnilab.config import Qwen3TTSConfig

    if not drv.reference_available():
        meta["notes"].append("reference: .venv-ref not found")
        return None
    spk = (Qwen3TTSConfig.load(Path(ckpt) / "config.json").speakers or [None])[0]
    texts = [prompts[(cfg.warmup + i) % len(prompts)] for i in range(cfg.requests)]
    log(f"[bench] reference (qwen-tts, {cfg.threads} threads) on {len(texts)} requests...")
    try:
        rows = drv.run_reference(ckpt, [prompts[0]] * cfg.warmup + texts, spk, cfg.max_new_tokens, cfg.threads,
                                 do_sample=True)[cfg.warmup:]
    except Exception as e:
        meta["notes"].append(f"reference failed: {type(e).__name__}: {str(e)[:500]}")
        log(f"[bench] reference failed: {e}")
        return None
    reqs = []
    for i, r in enumerate(rows):
        audio_s = r["frames"] * 0.08
        reqs.append({"backend": "reference", "concurrency": 1, "index": i, "frames": r["frames"],
                     "audio_ms": 1e3 * audio_s, "wall_ms": 1e3 * r["seconds"], "ttfa_ms": 1e3 * r["seconds"],
                     "rtf": r["seconds"] / audio_s if audio_s else math.inf,
                     "x_realtime": audio_s / r["seconds"] if r["seconds"] else math.inf,
                     "talker_ms_per_frame": math.nan})
    import numpy as np

    wall = sum(r["seconds"] for r in rows)
    frames = sum(r["frames"] for r in rows)
    row = {"backend": "reference", "driver": "qwen-tts generate (not streamed; TTFA = full audio)",
           "concurrency": 1, "requests": len(rows), "frames": frames, "audio_s": frames * 0.08, "wall_s": wall,
           "frames_per_s": frames / wall if wall else math.nan,
           "ttfa_ms_p50": float(np.median([q["ttfa_ms"] for q in reqs])) if reqs else math.nan,
           "rtf_mean": float(np.mean([q["rtf"] for q in reqs])) if reqs else math.nan,
           "x_realtime_mean": float(np.mean([q["x_realtime"] for q in reqs])) if reqs else math.nan,
           "ms_per_frame_total": 1e3 * wall / frames if frames else math.nan,
           "floor_ms_per_frame": floor_ms}
    return row, reqs


def bench_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random checkpoint of --size)")
    ap.add_argument("--size", default="tiny", help="tiny | mid | 0.6b | 1.7b (random weights, cached)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="auto", help=f"comma list of {', '.join(BENCH_BACKENDS)} or auto")
    ap.add_argument("--backend-kwargs", default="{}", help='JSON per backend, e.g. {"vllm": {"deploy": "multiprocess"}}')
    ap.add_argument("--concurrency", default="1,2", help="comma list, e.g. 1,2,4")
    ap.add_argument("--requests", type=int, default=4, help="requests per concurrency level")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=40, help="frames + 1 per request (random weights)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampler-interval", type=float, default=0.05, help="seconds; 0 disables thread sampling")
    ap.add_argument("--gemv-mib", type=int, default=1024)
    ap.add_argument("--reference", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--name", default=None, help="output file stem (default bench_<size>_<dtype>_t<threads>)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    cfg = BenchConfig(
        checkpoint=a.model, size=a.size, dtype=a.dtype, threads=a.threads,
        backends=tuple(x.strip() for x in a.backends.split(",") if x.strip()),
        concurrency=tuple(int(x) for x in a.concurrency.split(",")), requests=a.requests, warmup=a.warmup,
        max_new_tokens=a.max_new_tokens, prompts=a.prompts, seed=a.seed,
        sampler_interval_s=a.sampler_interval or None, gemv_mib=a.gemv_mib, reference=a.reference,
        backend_kwargs=json.loads(a.backend_kwargs))
    res = run_bench(cfg, progress=not a.no_progress)
    name = a.name or f"bench_{a.size if not a.model else Path(a.model).name}_{a.dtype}_t{a.threads}"
    paths = res.save(a.out, name)
    print(res.table())
    for note in res.meta["notes"]:
        print(f"note: {note}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(res.json_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
