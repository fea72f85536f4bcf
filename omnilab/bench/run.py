"""``omnilab bench``: configurations side by side on one checkpoint (``bench_main(argv)``; Python: ``run_bench(BenchConfig)``).

Each configuration (``backends``) is built and run: a warm-up request, then one stream of ``--frames`` frames and
each larger ``--concurrency`` point; the figures per configuration are defined in ``drivers.summarize_point`` and
``backends.derive``, the floors in ``floors``. Three modes: one after the other in this process, ``--fresh`` (a
process each) and ``--interleave N`` (side by side, alternated for N rounds, medians and paired ratios). The
method, the columns and the configuration suffixes: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omnilab.bench import backends as be
from omnilab.bench import floors, modes
from omnilab.bench import reference as ref
from omnilab.bench.cluster import run_on_cluster
from omnilab.bench.fidelity import add_fidelity
from omnilab.bench.memory import mem_available_bytes
from omnilab.bench.results import WAIT_FLAG_PCT, BenchResult, load_bench  # noqa: F401  (load_bench re-exported)
from omnilab.cli.main import Formatter
from omnilab.config import VARIANTS
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity
from omnilab.paths import cache_dir, file_lock
from omnilab.serve.load import load_main

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "harvard.txt"  # package data
DEFAULT_OUT = "omnilab-bench"  # results go to ./omnilab-bench/ unless --out names a directory
DEFAULT_CONFIGS = ("eager", "vllm", "vllm-workers")
MODES = ("same-process", "fresh", "interleave")
EXAMPLES = """examples:
  omnilab bench --size 0.6b --configs eager,vllm,vllm-workers --frames 40 --concurrency 1,4 --fresh
  omnilab bench --size 0.6b --configs eager,vllm --quantization none,int8,int4 \\
      --dtype auto,float32,bfloat16 --interleave 2 --rebuild
  omnilab bench --server http://127.0.0.1:8091    # load a running omnilab serve
  omnilab bench --serve "--model DIR" --compare 4  # start one, time it beside the pipeline in-process
(the load run's options: omnilab bench --server URL --help; docs/serving.md#load-run)
"""


@dataclass(frozen=True)
class BenchConfig:
    """What to run (the CLI options, one field each). ``checkpoint`` None -> a random checkpoint of ``size``."""
    checkpoint: str | None = None
    size: str = "tiny"
    variant: str = "custom_voice"     # of the random checkpoint (no --model)
    dtype: str = "auto"               # of configurations without a dtype suffix: auto (as synth) | float32 | bfloat16
    threads: int = 2
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    frames: int = 40
    concurrency: tuple[int, ...] = (1, 4)
    requests: int | None = None       # per concurrency point; None: one wave (as many as the point's streams)
    warmup_frames: int = 4
    prompts: str = str(DEFAULT_PROMPTS)
    sample: bool = False              # False: greedy (talker and sub-talker)
    seed: int = 0
    chunks: tuple[int, ...] = (1, 25)  # first, ramp..., steady; () = each pipeline's own schedule
    mode: str = "same-process"
    rounds: int = 1
    compile_talker: bool = False
    talker_cpus: tuple[int, ...] | None = None
    code2wav_cpus: tuple[int, ...] | None = None
    max_model_len: int = 1024
    floor: bool = True
    gemv_mib: int = 1024
    reference: str = "auto"           # auto | on | off
    code2wav_chunks: bool = False
    wait_flag_pct: float = WAIT_FLAG_PCT
    rss_interval_s: float = 0.2
    fidelity: str = "auto"            # auto | on | off (bench/fidelity.py)
    rebuild: bool = False             # --interleave: one configuration in memory at a time (modes.run_interleaved)
    deploy_profile: str | None = None  # None: --threads and the CPU lists; else auto | preset | YAML (backends.build)
    instruct: str = be.DEFAULT_INSTRUCT  # VoiceDesign requests
    ref_audio: str | None = None      # Base requests: a file; None = backends.reference_clip()
    ref_text: str | None = None       # Base: the reference's transcript (in-context cloning); None = x-vector only
    address: str | None = None        # a Ray cluster: each configuration a task on one of its nodes (bench/cluster.py)

    @property
    def floor_dtype(self) -> str:
        """The dtype of the floor probes and of the bytes per frame: float32 for ``auto`` (its decode computes in
        fp32 unless the machine's timing picks bf16)."""
        return "float32" if self.dtype == "auto" else self.dtype

    def __post_init__(self):
        for k in ("threads", "frames", "rounds", "warmup_frames", "max_model_len", "gemv_mib"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)!r}; accepted: an integer >= 1")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency={self.concurrency!r}; accepted: integers >= 1")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests={self.requests!r}; accepted: an integer >= 1 or None")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; accepted: {', '.join(MODES)}")
        if self.fidelity not in ("auto", "on", "off"):
            raise ValueError(f"fidelity={self.fidelity!r}; accepted: auto, on, off")

        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}; accepted: {', '.join(VARIANTS)}")
        if self.reference not in ("auto", "on", "off"):
            raise ValueError(f"reference={self.reference!r}; accepted: auto, on, off")
        if not self.configs:
            raise ValueError("configs is empty; accepted: names such as " + ", ".join(DEFAULT_CONFIGS))
        if self.dtype != "auto":
            floors.dtype_bytes(self.dtype)
        parsed = [be.parse_config(n, self.compile_talker) for n in self.configs]  # ValueError names the bad one
        if self.rebuild and self.mode != "interleave":
            raise ValueError("rebuild=True (--rebuild) goes with --interleave ROUNDS; accepted: --interleave N --rebuild")
        if self.address and self.mode == "interleave":
            raise ValueError("--address runs each configuration in its own process on a cluster node (as --fresh); "
                             "--interleave compares in one process: use one or the other")
        if self.mode == "interleave" and any(c.workers for c in parsed):
            raise ValueError("--interleave takes in-process configurations only (stage workers bind CPUs for their "
                             "lifetime); run vllm-workers with --fresh or on its own")
        self.schedule()

    def schedule(self):
        from omnilab.models.code2wav_stream import ChunkSchedule  # lazy: torch

        if not self.chunks:
            return None
        if len(self.chunks) < 2:
            raise ValueError(f"chunks={self.chunks!r}; accepted: FIRST,[RAMP...,]STEADY frames or 'profile'")
        return ChunkSchedule(self.chunks[0], tuple(self.chunks[1:-1]), self.chunks[-1])


def checkpoint_for(cfg: BenchConfig) -> Path:
    if cfg.checkpoint:
        return Path(cfg.checkpoint)
    from omnilab.checkpoint.random import default_checkpoint, make_random_checkpoint  # lazy: torch

    if cfg.size == "tiny" and cfg.variant == "custom_voice":
        return default_checkpoint()
    path = cache_dir() / "checkpoints" / f"{cfg.size}-{cfg.variant}-seed0-v1"
    with file_lock(path.with_name(path.name + ".lock")):  # two bench processes on one machine: one writes it
        if not (path / "speech_tokenizer" / "model.safetensors").is_file():
            make_random_checkpoint(path, cfg.size, cfg.variant, 0, overwrite=True)
    return path


def fidelity_checkpoint(cfg: BenchConfig, ckpt: Path) -> Path:
    """Where the fidelity columns are measured: the given checkpoint, else (a random one) its confident twin of the
    same geometry, whose decisions have a trained model's margins (docs/quality.md#confident-random-checkpoints)."""
    if cfg.checkpoint:
        return Path(cfg.checkpoint)
    from omnilab.checkpoint.random import cached_checkpoint  # lazy: torch
    return cached_checkpoint(cfg.size, cfg.variant, 0, calibrated=True)


def load_prompts(path: str | os.PathLike) -> list[str]:
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def run_bench(cfg: BenchConfig, command: str = "", child: bool = False) -> BenchResult:
    """Run the benchmark described by ``cfg`` (see the module docstring). ``child``: one configuration of a
    ``--fresh`` run (no bandwidth probe, no reference row)."""
    import pandas as pd
    import torch

    from omnilab.pipeline import flush_denormals  # lazy: torch

    flush_denormals()
    ckpt = checkpoint_for(cfg)
    prompts = load_prompts(cfg.prompts)
    bpf = floors.bytes_per_frame(ckpt, floors.dtype_bytes(cfg.floor_dtype))
    meta: dict[str, Any] = {
        "checkpoint": str(ckpt), "size": cfg.size, "dtype": cfg.dtype, "threads": cfg.threads,
        "settings": dataclasses.asdict(cfg), "bytes_per_frame": bpf, "pid": os.getpid(),
        "machine": {"cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "torch": torch.__version__, "python": sys.version.split()[0], "executable": sys.executable},
        "load_start": os.getloadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": []}
    if cfg.floor and not child:
        modes.log(f"[bench] GEMV bandwidth probe ({cfg.gemv_mib} MiB fp32, {cfg.threads} threads)...")
        bw = floors.measure_gemv_bandwidth(cfg.gemv_mib, threads=cfg.threads)
        dram_ms = lambda nbytes: 1e3 * nbytes / (bw["gbps"] * 1e9)  # noqa: E731  (bytes at the DRAM GEMV rate)
        meta.update(bandwidth=bw, floor_dram_ms_per_frame=dram_ms(bpf["talker_bytes_per_frame"]),
                    floor_dram_talker_ms=dram_ms(bpf["talker_decode_bytes"]),
                    floor_dram_predictor_ms=dram_ms(bpf["predictor_passes"] * bpf["predictor_pass_bytes"]))
        meta["stream_read"] = floors.measure_stream_read(cfg.gemv_mib, threads=cfg.threads)
        modes.log(f"[bench] streaming read (x.sum()) {meta['stream_read']['gbps']:.1f} GB/s, "
                  f"DRAM GEMV {bw['gbps']:.1f} GB/s; a frame reads {bpf['talker_bytes_per_frame'] / 1e9:.3f} GB "
             f"-> all-DRAM floor {meta['floor_dram_ms_per_frame']:.1f} ms/frame")
    if cfg.address:
        rows, points, reqs, rounds = run_on_cluster(cfg, meta, cfg.address)
    elif cfg.mode == "fresh":
        rows, points, reqs, rounds = modes.run_fresh(cfg, ckpt, meta)
    elif cfg.mode == "interleave":
        rows, points, reqs, rounds = modes.run_interleaved(cfg, ckpt, prompts, bpf, meta)
    else:
        rows, points, reqs, rounds = modes.run_same_process(cfg, ckpt, prompts, bpf, meta)
    for r in rows:  # what was asked (the row's suffix or --dtype) and the decode step's read bandwidth
        r["dtype_requested"] = be.parse_config(r["config"]).dtype or cfg.dtype
        if isinstance(r.get("decode_bytes_per_frame"), float) and isinstance(r.get("step_ms"), float):
            r["effective_gbps"] = r["decode_bytes_per_frame"] / (r["step_ms"] * 1e-3) / 1e9
            if isinstance(r.get("n_step_ms"), float):  # N streams: one read of the weights for N rows
                r["n_effective_gbps"] = r["decode_bytes_per_frame"] / (r["n_step_ms"] * 1e-3) / 1e9
        for part in ("talker", "predictor"):  # each part's own read bandwidth: its bytes / its share of the step
            nbytes, ms = r.get(f"decode_bytes_{part}"), r.get(f"{part}_ms")
            if isinstance(nbytes, float) and isinstance(ms, float) and ms > 0:
                r[f"{part}_gbps"] = nbytes / (ms * 1e-3) / 1e9
    if not child:
        add_fidelity(cfg, fidelity_checkpoint(cfg, ckpt), prompts, rows, meta)
        _reference(cfg, ckpt, rows, meta)
    base = rows[0].get("step_ms") if rows else None
    for r in rows:  # --interleave set it already, paired per round (bench.paired); otherwise the medians' ratio
        if base and isinstance(r.get("step_ms"), float) and "step_ratio" not in r:
            r["step_ratio"] = r["step_ms"] / base
    meta["load_end"] = os.getloadavg()
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMNILAB_", "VLLM_CPU")) or k in be.ISA_VARS}
    return BenchResult(rows, pd.DataFrame(points), pd.DataFrame(reqs), meta, rounds, command, env)


def _reference(cfg: BenchConfig, ckpt: Path, rows: list[dict], meta: dict) -> None:
    if cfg.reference == "off" or (cfg.reference == "auto" and not ref.reference_available()):
        if cfg.reference == "auto":
            meta["notes"].append("reference: .venv-ref not found, skipped")
        return
    from omnilab.checkpoint.worker_weights import release_memory  # lazy: torch

    release_memory()  # the benched pipelines' freed pages, before a second process loads the model
    need, have = reference_memory(ckpt)
    if have < need:  # the kernel's OOM killer would take this process, and every result with it
        meta["notes"].append(f"reference skipped: {have / 2**30:.1f} GiB available, the official pipeline needs "
                             f"~{need / 2**30:.1f} GiB (3 x the checkpoint's weights + 2 GiB); run it alone: "
                             f"omnilab bench --configs eager --reference on")
        modes.log(f"[bench] {meta['notes'][-1]}")
        return
    modes.log(f"[bench] reference (qwen-tts, {cfg.threads} threads)...")
    try:
        row = ref.reference_row(ckpt, cfg.threads, cfg.frames)
    except Exception as e:  # a reference that cannot run is reported, not fatal
        meta["notes"].append(f"reference failed: {type(e).__name__}: {str(e)[:500]}")
        return
    fl = [r["floor_ms"] for r in rows if isinstance(r.get("floor_ms"), float)]
    if fl:
        row.update(floor_ms=sorted(fl)[len(fl) // 2], step_floor_ratio=row["step_ms"] / sorted(fl)[len(fl) // 2])
    rows.append(row)


def reference_memory(ckpt: Path, meminfo: str | None = None) -> tuple[int, int]:
    """(bytes the official pipeline needs, bytes available now): 3 x the checkpoint's weight files (it loads them in
    fp32 from a bf16 file, with the file's copy while casting) + 2 GiB of runtime; MemAvailable within the cgroup
    (``meminfo``: that file's, for tests)."""
    weights = sum(f.stat().st_size for f in Path(ckpt).rglob("*.safetensors"))
    return 3 * weights + 2 * 2**30, mem_available_bytes(meminfo)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


DESCRIPTION = """\
Build each configuration on one checkpoint, run a warm-up request, one stream of --frames frames and
each larger --concurrency point; print a table (a line per configuration) and write one JSON, whose
path is the last line. Configurations: eager, vllm, vllm-workers, each with optional +suffixes
(+int4, +bf16, +torch-gemv, ...). Method, columns and every suffix: docs/benchmarks.md."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omnilab bench", formatter_class=Formatter, usage="omnilab bench [options]",
                                 description=DESCRIPTION, epilog=EXAMPLES)
    a = ap.add_argument
    a("--model", default=None, metavar="DIR", help="checkpoint, any variant (default: a random one of --size, --variant)")
    a("--size", default="tiny", help="random checkpoint size: tiny | mid | 0.6b | 1.7b")
    a("--variant", default="custom_voice", choices=("custom_voice", "voice_design", "base"), metavar="V",
      help="random checkpoint variant: custom_voice | voice_design | base")
    a("--instruct", default=be.DEFAULT_INSTRUCT, metavar="TEXT", help="VoiceDesign: every request's voice description "
      "(default: a fixed one)")
    a("--ref-audio", default=None, metavar="WAV", help="Base: reference audio file (default: a generated 1.5 s clip)")
    a("--ref-text", default=None, metavar="TEXT", help="Base: its transcript, for in-context cloning (default: x-vector only)")
    a("--deploy-profile", default="none", metavar="P", help="none (--threads decides) | auto | preset | deploy "
      "YAML")
    a("--dtype", default="auto", metavar="D", help="auto (as synth) | float32 | bfloat16, or a comma list")
    a("--quantization", default="none", metavar="Q", help="none | int8 | int4 | int4-gN (32/64/128), or a comma "
      "list")
    a("--fidelity", choices=("auto", "on", "off"), default="auto", help="fidelity against eager float32 (auto: where it "
      "differs)")
    a("--threads", type=int, default=2, metavar="N", help="talker threads and floor-probe threads")
    a("--configs", "--backends", dest="configs", default=",".join(DEFAULT_CONFIGS), metavar="LIST",
      help="configurations, comma-separated")
    a("--frames", type=int, default=40, metavar="N", help="frames per request")
    a("--concurrency", default="1,4", metavar="LIST", help="stream counts, comma-separated; 1 always runs")
    a("--requests", type=int, default=None, metavar="N", help="requests per concurrency point (default: one wave)")
    a("--warmup-frames", type=int, default=4, metavar="N", help="frames of each configuration's warm-up request")
    a("--prompts", default=str(DEFAULT_PROMPTS), metavar="FILE", help="prompts, one a line (default: the shipped "
      "Harvard sentences)")
    a("--sample", action="store_true", help="sample, seeded per request, instead of greedy decoding")
    a("--seed", type=int, default=0, metavar="N", help="first request's seed with --sample")
    a("--chunks", default="1,25", metavar="LIST", help="code2wav chunks FIRST,[RAMP...,]STEADY, or 'profile'")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fresh", action="store_true", help="run each configuration in its own process")
    mode.add_argument("--interleave", type=int, default=0, metavar="N", help="alternate side by side for N rounds "
                      "(default: off)")
    a("--rebuild", action="store_true", help="with --interleave: build each configuration anew for its turn")
    a("--compile", choices=("off", "on"), default="off", help="vLLM's torch.compile path in every vllm configuration")
    a("--talker-cpus", default=None, metavar="CPUS", help="vllm-workers: talker CPU list (default: the auto profile's)")
    a("--code2wav-cpus", default=None, metavar="CPUS", help="vllm-workers: code2wav CPU list (default: the auto profile's)")
    a("--max-model-len", type=int, default=1024, metavar="N", help="vLLM max_model_len")
    a("--address", default=None, metavar="ADDR", help="Ray cluster: local[:N] | auto | ray://HOST:PORT (default: "
      "this machine)")
    a("--no-floor", action="store_true", help="skip the memory-bandwidth floor probes")
    a("--gemv-mib", type=int, default=1024, metavar="MIB", help="size of the DRAM bandwidth probe (MiB)")
    a("--reference", choices=("auto", "on", "off"), default="auto", help="the official qwen-tts row; auto: with "
      ".venv-ref")
    a("--code2wav-chunks", action="store_true", help="add code2wav's offline and streaming chunk costs")
    a("--wait-flag-pct", type=float, default=WAIT_FLAG_PCT, metavar="PCT", help="flag rows with more run-queue wait")
    a("--rss-interval", type=float, default=0.2, metavar="S", help="seconds between RSS samples")
    a("--out", default=DEFAULT_OUT, metavar="DIR", help="output directory")
    a("--name", default=None, metavar="STEM", help="output file stem (default: bench_<size>_<dtype>_t<threads>)")
    add_verbosity(ap)
    return ap


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    dtypes = _names(a.dtype) or ("auto",)
    single = len(dtypes) == 1  # one dtype: the configurations' own (no suffix); a list: a suffix each
    configs = be.expand(_names(a.configs), _names(a.quantization), () if single else dtypes)
    concrete = [d for d in dtypes if d != "auto"]
    return BenchConfig(
        checkpoint=a.model, size=a.size, variant=a.variant, instruct=a.instruct, ref_audio=a.ref_audio,
        ref_text=a.ref_text, deploy_profile=None if a.deploy_profile.lower() == "none" else a.deploy_profile,
        dtype=dtypes[0] if single else (concrete[0] if concrete else "float32"), threads=a.threads,
        configs=configs, frames=a.frames, fidelity=a.fidelity, rebuild=a.rebuild,
        concurrency=_ints(a.concurrency), requests=a.requests, warmup_frames=a.warmup_frames, prompts=a.prompts,
        sample=a.sample, seed=a.seed, chunks=() if a.chunks == "profile" else _ints(a.chunks),
        mode="interleave" if a.interleave else ("fresh" if a.fresh else "same-process"), rounds=a.interleave or 1,
        compile_talker=a.compile == "on", talker_cpus=_ints(a.talker_cpus) if a.talker_cpus else None,
        code2wav_cpus=_ints(a.code2wav_cpus) if a.code2wav_cpus else None, max_model_len=a.max_model_len,
        floor=not a.no_floor, gemv_mib=a.gemv_mib, reference=a.reference, code2wav_chunks=a.code2wav_chunks,
        wait_flag_pct=a.wait_flag_pct, rss_interval_s=a.rss_interval, address=a.address)


def bench_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # one configuration of a --fresh run: python -m omnilab.bench.run --child CFG OUT
        return _child_main(*argv[1:3])
    if any(x in ("--server", "--serve") or x.startswith(("--server=", "--serve=")) for x in argv):  # load a server
        return load_main(argv)
    ap = parser()
    a = ap.parse_args(argv)
    apply_verbosity(a)
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        ap.error(str(e))
    command = "omnilab bench " + shlex.join(argv)
    res = run_bench(cfg, command)
    stem = Path(a.model).name if a.model else (a.size if a.variant == "custom_voice" else f"{a.size}_{a.variant}")
    name = a.name or f"bench_{stem}_{a.dtype.replace(',', '-')}_t{a.threads}"
    path = res.save(a.out, name)
    print(res.table())
    for note in res.meta["notes"]:
        print(f"note: {note}")
    print(f"results: {path}")  # the JSON (rows, points, requests, the command line) is in the file
    return 0


def _child_main(cfg_path: str, out_path: str) -> int:
    d = json.loads(Path(cfg_path).read_text())
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    res = run_bench(cfg, child=True)
    Path(out_path).write_text(json.dumps(res.to_dict(), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
