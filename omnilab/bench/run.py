"""``omnilab bench``: configurations side by side on one checkpoint (``bench_main(argv)``; Python: ``run_bench(BenchConfig)``).

Each configuration (``backends``: ``eager``, ``vllm``, ``vllm-workers`` with ``+modifiers`` such as
``+compiled``, ``+torch-gemv``, ``+avx2-kernels``, ``+torch-snake``, ``+fp32-weights``) is built and run: a
warm-up request, then one stream of ``--frames`` frames and each larger ``--concurrency`` point (all its
streams started together, or a closed loop of ``--requests``), chunked 1 frame then 25. Per configuration:
talker decode step, talker forward, code predictor and vLLM overhead per frame, code2wav ms per frame,
TTFA (= prefill step + first chunk), RTF = wall / audio, N-stream step and frames/s, the N / 1 ratios
(end to end, talker stage, ceiling), peak RSS of all processes, init time, run-queue wait % (other load on
a shared host; above ``--wait-flag-pct`` the row is flagged), and the memory-bandwidth floor of a frame
measured next to the row (``floors``; ``--no-floor`` skips it). Definitions: ``drivers.summarize_point``,
``backends.derive``.

Three ways to run the configurations:

- one after the other in this process (default), the floor measured before and after each;
- ``--fresh``: each configuration in its own process (memory figures not inflated by an earlier one);
- ``--interleave N``: all (in-process) configurations built side by side in this process and run in
  alternation for N rounds, the order rotated every round and the floor measured before each round;
  rows are medians over rounds, so configurations are compared under the same host conditions.

``--code2wav-chunks`` adds the decoder's offline 1/25/100-frame and streaming chunk costs; the official
qwen-tts row (``reference``) is added when ``.venv-ref`` exists. Prints one table; writes one JSON
(``results``, the command line included) to ``--out`` (default ``./omnilab-bench/``); the last line gives its path.

Every variant is benched: CustomVoice requests take a built-in speaker, VoiceDesign ones ``--instruct`` (a
default description), Base ones ``--ref-audio`` (without it, a generated 1.5 s reference clip, x-vector mode;
``--ref-text`` for in-context cloning). ``--address`` (a Ray cluster: ``local:N``, ``auto``, ``ray://HOST:PORT``,
...) runs each configuration as a task on one of the cluster's nodes, in its own process there
(``bench/cluster.py``), and gathers one table whose rows name their node. ``--deploy-profile`` builds every
configuration from a deploy profile (threads, CPUs, KV budget as a user of that profile gets them) instead of
``--threads``.
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
from omnilab.bench.results import WAIT_FLAG_PCT, BenchResult, load_bench  # noqa: F401  (load_bench re-exported)
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "harvard.txt"  # package data
DEFAULT_OUT = "omnilab-bench"  # results go to ./omnilab-bench/ unless --out names a directory
DEFAULT_CONFIGS = ("eager", "vllm", "vllm-workers")
MODES = ("same-process", "fresh", "interleave")
EXAMPLES = """examples:
  omnilab bench --size 0.6b --configs eager,vllm,vllm-workers,vllm+compiled --frames 40 --concurrency 1,4 --fresh
  omnilab bench --size 0.6b --configs vllm,vllm+fp32-weights,eager --concurrency 1 --interleave 5
  omnilab bench --size 0.6b --configs eager --frames 24 --concurrency 1 --code2wav-chunks --reference on
  omnilab bench --size 0.6b --configs eager,vllm --quantization none,int8,int4 --dtype auto,float32,bfloat16 --interleave 3
"""


@dataclass(frozen=True)
class BenchConfig:
    """What to run (the CLI options, one field each). ``checkpoint`` None -> a random checkpoint of ``size``."""
    checkpoint: str | None = None
    size: str = "tiny"
    variant: str = "custom_voice"     # of the random checkpoint (no --model)
    dtype: str = "float32"
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
        from omnilab.config import VARIANTS

        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}; accepted: {', '.join(VARIANTS)}")
        if self.reference not in ("auto", "on", "off"):
            raise ValueError(f"reference={self.reference!r}; accepted: auto, on, off")
        if not self.configs:
            raise ValueError("configs is empty; accepted: names such as " + ", ".join(DEFAULT_CONFIGS))
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
        from omnilab.models.code2wav_stream import ChunkSchedule

        if not self.chunks:
            return None
        if len(self.chunks) < 2:
            raise ValueError(f"chunks={self.chunks!r}; accepted: FIRST,[RAMP...,]STEADY frames or 'profile'")
        return ChunkSchedule(self.chunks[0], tuple(self.chunks[1:-1]), self.chunks[-1])


def checkpoint_for(cfg: BenchConfig) -> Path:
    if cfg.checkpoint:
        return Path(cfg.checkpoint)
    from omnilab.checkpoint.random import default_checkpoint, make_random_checkpoint
    from omnilab.paths import cache_dir, file_lock

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
    from omnilab.checkpoint.random import cached_checkpoint
    return cached_checkpoint(cfg.size, cfg.variant, 0, calibrated=True)


def load_prompts(path: str | os.PathLike) -> list[str]:
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def run_bench(cfg: BenchConfig, command: str = "", child: bool = False) -> BenchResult:
    """Run the benchmark described by ``cfg`` (see the module docstring). ``child``: one configuration of a
    ``--fresh`` run (no bandwidth probe, no reference row)."""
    import pandas as pd
    import torch

    from omnilab.pipeline import flush_denormals

    flush_denormals()
    ckpt = checkpoint_for(cfg)
    prompts = load_prompts(cfg.prompts)
    bpf = floors.bytes_per_frame(ckpt, floors.dtype_bytes(cfg.dtype))
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
        from omnilab.bench.cluster import run_on_cluster
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
    if not child:
        from omnilab.bench.fidelity import add_fidelity
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
    from omnilab.bench import reference as ref

    if cfg.reference == "off" or (cfg.reference == "auto" and not ref.reference_available()):
        if cfg.reference == "auto":
            meta["notes"].append("reference: .venv-ref not found, skipped")
        return
    from omnilab.checkpoint.worker_weights import release_memory

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
    from omnilab.bench.memory import mem_available_bytes

    weights = sum(f.stat().st_size for f in Path(ckpt).rglob("*.safetensors"))
    return 3 * weights + 2 * 2**30, mem_available_bytes(meminfo)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def parser() -> argparse.ArgumentParser:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    ap = argparse.ArgumentParser(prog="omnilab bench", formatter_class=Formatter,
                                 description=__doc__.split("\n", 1)[1].strip().replace("``", "'"), epilog=EXAMPLES)
    a = ap.add_argument
    a("--model", default=None, help="checkpoint dir (any variant); None = a random checkpoint of --size and "
      "--variant (cached)")
    a("--size", default="tiny", help="random checkpoint size when --model is not given: tiny | mid | 0.6b | 1.7b")
    a("--variant", default="custom_voice", choices=("custom_voice", "voice_design", "base"),
      help="random checkpoint variant when --model is not given")
    a("--instruct", default=be.DEFAULT_INSTRUCT, help="VoiceDesign checkpoints: the voice description of every "
      "request")
    a("--ref-audio", default=None, help="Base checkpoints: reference audio file; None = a generated 1.5 s clip")
    a("--ref-text", default=None, help="Base checkpoints: transcript of --ref-audio (in-context cloning); None = "
      "x-vector only")
    a("--deploy-profile", default="none", help="none (--threads, --talker-cpus, --code2wav-cpus decide) | auto | a "
      "preset name | a deploy YAML: every configuration built with that profile's threads, CPUs and KV budget")
    a("--dtype", default="float32", help="compute dtype: float32 | bfloat16 | auto (what dtype=None picks), or a "
      "comma list: every configuration once per dtype (suffixes +fp32 / +bf16 / +auto)")
    a("--quantization", default="none", help="comma list of decode-matrix quantizations, every configuration once "
      "per entry: none | int8 | int4 | int4-g32 | int4-g64 | int4-g128 (suffixes +int8 / +int4 / ...)")
    a("--fidelity", choices=("auto", "on", "off"), default="auto", help="teacher-forced fidelity of each row's "
      "numerics (dtype, quantization) against eager float32 unquantized (omnilab.quality.compare); auto: when the "
      "rows' numerics differ")
    a("--threads", type=int, default=2, help="talker threads (eager / in-process / worker) and floor-probe threads")
    a("--configs", "--backends", dest="configs", default=",".join(DEFAULT_CONFIGS),
      help="comma list of configurations: " + "; ".join(f"{k}: {v}" for k, v in be.BASES.items())
      + f"; each with optional suffixes {' '.join(be.MODIFIERS)} (aliases: {', '.join(be.ALIASES)})")
    a("--frames", type=int, default=40, help="frames per request (max_new_tokens = frames + 1)")
    a("--concurrency", default="1,4", help="comma list of stream counts; 1 is always measured (the base of the "
      "N / 1 ratios); the table shows 1 and the largest")
    a("--requests", type=int, default=None, help="requests per concurrency point, at most the point's streams "
      "in flight; None = one wave (all started together)")
    a("--warmup-frames", type=int, default=4, help="frames of the warm-up request before each configuration's run")
    a("--prompts", default=str(DEFAULT_PROMPTS), help="prompt file, one per line ('#' lines skipped)")
    a("--sample", action="store_true", help="sample (seeded per request) instead of greedy decoding")
    a("--seed", type=int, default=0, help="first request's seed with --sample")
    a("--chunks", default="1,25", help="code2wav chunk sizes FIRST,[RAMP...,]STEADY frames, or 'profile' (each "
      "pipeline's own schedule)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fresh", action="store_true", help="run each configuration in its own process (without --fresh "
                      "or --interleave: one after the other in this process)")
    mode.add_argument("--interleave", type=int, default=0, metavar="ROUNDS", help="build the in-process configurations "
                      "side by side in this process and alternate them for ROUNDS rounds (order rotated every round); "
                      "rows are medians over rounds; 0 = off")
    a("--rebuild", action="store_true", help="with --interleave: one configuration in memory at a time, built anew "
      "for each turn and closed after it (a sweep too large to hold side by side)")
    a("--compile", choices=("off", "on"), default="off", help="on: vLLM's torch.compile path for the talker in every "
      "vllm configuration (per configuration: the +compiled suffix)")
    a("--talker-cpus", default=None, help="vllm-workers: talker CPU list, e.g. 0,1; None = the auto deploy profile's")
    a("--code2wav-cpus", default=None, help="vllm-workers: code2wav CPU list; None = the auto deploy profile's")
    a("--max-model-len", type=int, default=1024, help="vLLM max_model_len")
    a("--address", default=None, help="run the configurations across a Ray cluster's nodes, each in its own process "
      "on one node reserving --threads CPUs, gathered into one table: local | local:N (N Ray nodes on this machine) "
      "| auto | HOST:PORT | ray://HOST:PORT (needs the cluster extra); None = this machine only")
    a("--no-floor", action="store_true", help="skip the GEMV floor probes (bandwidth and the per-row frame floor)")
    a("--gemv-mib", type=int, default=1024, help="size of the DRAM bandwidth probe's matrix (MiB)")
    a("--reference", choices=("auto", "on", "off"), default="auto",
      help="the official qwen-tts row (auto: when .venv-ref exists)")
    a("--code2wav-chunks", action="store_true", help="add the decoder's offline 1/25/100-frame and streaming chunk "
      "costs (in-process code2wav only)")
    a("--wait-flag-pct", type=float, default=WAIT_FLAG_PCT, help="flag rows whose run-queue wait is above this %% "
      "(other load on the host)")
    a("--rss-interval", type=float, default=0.2, help="seconds between RSS samples")
    a("--out", default=DEFAULT_OUT, help="output directory (relative to the current directory)")
    a("--name", default=None, help="output file stem; None = bench_<size or model>_<dtype>_t<threads>")
    add_verbosity(ap)
    return ap


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    dtypes = _names(a.dtype) or ("float32",)
    single = len(dtypes) == 1 and dtypes[0] != "auto"  # one concrete dtype: --dtype as before, no suffix
    configs = be.expand(_names(a.configs), _names(a.quantization), () if single else dtypes)
    concrete = [d for d in dtypes if d != "auto"]
    return BenchConfig(
        checkpoint=a.model, size=a.size, variant=a.variant, instruct=a.instruct, ref_audio=a.ref_audio,
        ref_text=a.ref_text, deploy_profile=None if a.deploy_profile.lower() == "none" else a.deploy_profile,
        dtype=concrete[0] if concrete else "float32", threads=a.threads,
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
