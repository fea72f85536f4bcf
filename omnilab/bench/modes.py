"""The three ways ``omnilab bench`` runs its configurations; each returns ``(rows, points, requests, rounds)``.

- ``run_same_process``: one after the other in this process, the frame floor measured before and after each
  (their mean is the row's floor), peak RSS sampled from build to close;
- ``run_interleaved``: all built side by side in this process (each only when MemAvailable leaves room for one more
  as large as the largest so far, else an ``InputError`` naming ``--rebuild``: ``check_room``) or, ``--rebuild``,
  each built anew for its turn and closed after it; then ``rounds`` rounds, each a floor measurement and every
  configuration once, the order rotated every round; a row is the median of its rounds, and its ratios to the
  first row and to its ``+auto`` sibling are medians of per-round ratios (``paired``: the host's drift cancels);
- ``run_fresh``: each configuration in its own interpreter (``python -m omnilab.bench.run --child CFG OUT``,
  which runs ``run_same_process`` for that one), merged here.

``cfg`` is the ``run.BenchConfig``; ``points`` one record per configuration x concurrency x round,
``requests`` one per request, ``rounds`` the order of each round (and its floor).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from omnilab.bench import backends as be
from omnilab.bench import floors
from omnilab.bench.drivers import code2wav_chunk_costs
from omnilab.bench.memory import ProcessSampler, mem_available_bytes, tree_rss_bytes
from omnilab.bench.paired import paired_figures
from omnilab.errors import InputError

if TYPE_CHECKING:
    from omnilab.bench.run import BenchConfig


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _floor(cfg: BenchConfig, bpf: dict) -> dict | None:
    """The frame floor right now (the host is shared: measured next to each row or round)."""
    return floors.measure_frame_floor(bpf, cfg.floor_dtype, reps=2, threads=cfg.threads) if cfg.floor else None


def _mean_floor(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: (a[k] + b[k]) / 2 for k in ("floor_ms", "talker_floor_ms", "predictor_floor_ms")}


def _code2wav_chunks(pipe: Any, cfg: BenchConfig) -> dict:
    if not cfg.code2wav_chunks or pipe.model.code2wav is None:  # None: code2wav runs in a worker process
        return {}
    return code2wav_chunk_costs(pipe.model.code2wav)


def run_same_process(cfg: BenchConfig, ckpt: Path, prompts: list[str], bpf: dict,
                     meta: dict) -> tuple[list, list, list, list]:
    rows, points, reqs = [], [], []
    for c in (be.parse_config(n, cfg.compile_talker) for n in cfg.configs):
        gc.collect()
        before = _floor(cfg, bpf)
        with be.config_env(c), ProcessSampler(cfg.rss_interval_s) as mem:
            try:
                pipe, init_s = be.timed_build(c, ckpt, cfg)
            except Exception as e:  # a configuration that cannot start is reported, the others still run
                meta["notes"].append(f"{c.name}: could not start: {type(e).__name__}: {str(e)[:500]}")
                log(f"[bench] {c.name}: could not start: {e}")
                continue
            try:
                labels = be.labels(pipe)
                run = be.measure(pipe, c, cfg, prompts, cfg.schedule() or pipe.chunk_schedule, 1)
                chunks = _code2wav_chunks(pipe, cfg)
            finally:
                pipe.close()
        del pipe
        gc.collect()
        fl = _mean_floor(before, _floor(cfg, bpf))
        row = be.median_row(c.name, [be.derive(run, fl)])
        row.update(init_s=init_s, pid=os.getpid(), env=c.env, **labels, **mem.summary(), **chunks)
        rows.append(row)
        points += run["points"]
        reqs += run["requests"]
        log(f"[bench] {c.name}: step {row['step_ms']:.1f} ms, code2wav {row['code2wav_ms_per_frame']:.1f} ms/frame, "
            f"RTF {row['rtf']:.2f}" + (f", floor {fl['floor_ms']:.3g} ms" if fl else ""))
    return rows, points, reqs, [{"round": 1, "order": list(cfg.configs)}]


ROOM_MARGIN_BYTES = 2 * 2**30  # kept free besides the next configuration: runs, floor probes, the allocator's slack


def check_room(name: str, built: int, total: int, took: Sequence[int], available: int | None = None) -> None:
    """Before ``--interleave`` builds configuration ``name`` side by side with the ``built`` ones: an ``InputError``
    when MemAvailable is under the most one configuration has taken so far plus :data:`ROOM_MARGIN_BYTES` (the
    kernel's OOM killer would otherwise end the run with nothing written), naming ``--rebuild``."""
    if not took:
        return
    have = mem_available_bytes() if available is None else available
    need = max(took) + ROOM_MARGIN_BYTES
    if have and have < need:
        raise InputError(
            f"--interleave builds every configuration side by side: {built} of {total} are in memory, the largest "
            f"took {max(took) / 2**30:.1f} GiB, and {have / 2**30:.1f} GiB is available, under the "
            f"{need / 2**30:.1f} GiB that {name!r} would need with a {ROOM_MARGIN_BYTES // 2**30} GiB margin; add "
            f"--rebuild (one configuration in memory at a time, built anew for each turn) or bench fewer "
            f"configurations")


def run_interleaved(cfg: BenchConfig, ckpt: Path, prompts: list[str], bpf: dict, meta: dict) -> tuple[list, list, list, list]:
    """All configurations in rounds, the order rotated every round. Side by side in memory, or with
    ``cfg.rebuild`` one at a time: each is built anew for its turn and closed after it (every configuration of a
    large sweep then fits in memory; the page cache keeps the checkpoint warm, and ``init_s`` is the median)."""
    configs = [be.parse_config(n, cfg.compile_talker) for n in cfg.configs]
    rebuild = getattr(cfg, "rebuild", False)
    pipes, built, runs, inits = {}, {}, {c.name: [] for c in configs}, {c.name: [] for c in configs}
    points, reqs, rounds = [], [], []

    def build(c):
        gc.collect()
        with be.config_env(c):  # weight storage and placement are fixed here; kernel modes switch per run
            pipe, init_s = be.timed_build(c, ckpt, cfg)
        inits[c.name].append(init_s)
        built.setdefault(c.name, be.labels(pipe))
        return pipe

    with ProcessSampler(cfg.rss_interval_s) as mem:
        try:
            if not rebuild:
                took: list[int] = []  # bytes each configuration added to the process tree's RSS when it was built
                for c in configs:
                    check_room(c.name, len(pipes), len(configs), took)
                    before = tree_rss_bytes()
                    pipes[c.name] = build(c)
                    took.append(max(tree_rss_bytes() - before, 0))
            for r in range(cfg.rounds):
                fl = _floor(cfg, bpf)
                # the order rotates every round, so position effects (first after the floor probe freed its
                # matrices, last before the next round) average out instead of landing on one configuration
                order = configs[r % len(configs):] + configs[:r % len(configs)]
                rounds.append({"round": r + 1, "order": [c.name for c in order],
                               "floor_ms": fl["floor_ms"] if fl else None})
                for c in order:
                    pipe = pipes[c.name] if not rebuild else build(c)
                    try:
                        with be.kernel_modes(c):
                            run = be.measure(pipe, c, cfg, prompts, cfg.schedule() or pipe.chunk_schedule, r + 1)
                            if rebuild and r == cfg.rounds - 1:
                                built[c.name].update(_code2wav_chunks(pipe, cfg))
                    finally:
                        if rebuild:
                            pipe.close()
                    del pipe
                    runs[c.name].append(be.derive(run, fl))
                    points += run["points"]
                    reqs += run["requests"]
                log(f"[bench] round {r + 1}: " + ("" if fl is None else f"floor {fl['floor_ms']:.3g} ms  ")
                     + "  ".join(f"{c.name} {runs[c.name][-1]['step_ms']:.1f} ms" for c in order))
            if not rebuild:
                for c in configs:
                    with be.kernel_modes(c):
                        built[c.name].update(_code2wav_chunks(pipes[c.name], cfg))
        finally:
            for p in pipes.values():
                p.close()
    meta["peak_rss_gib_all_configs"] = mem.summary()["peak_rss_gib"]
    meta["notes"].append("interleave: every configuration runs in this one process, so peak RSS is one figure for "
                         "all of them (meta.peak_rss_gib_all_configs), not per row"
                         + ("; --rebuild: one configuration in memory at a time, built anew for each turn"
                            if rebuild else ""))
    pairs = paired_figures(runs)  # ratios taken within a round, then the median: the host's drift cancels
    rows = [{**be.median_row(c.name, runs[c.name]), "pid": os.getpid(), "env": c.env,
             "init_s": sorted(inits[c.name])[len(inits[c.name]) // 2], **built[c.name], **pairs.get(c.name, {})}
            for c in configs]
    return rows, points, reqs, rounds


def run_fresh(cfg: BenchConfig, ckpt: Path, meta: dict) -> tuple[list, list, list, list]:
    rows, points, reqs = [], [], []
    with tempfile.TemporaryDirectory(prefix="omnilab-bench-") as d:
        for name in cfg.configs:
            child = dataclasses.replace(cfg, checkpoint=str(ckpt), configs=(name,), mode="same-process", rounds=1,
                                        reference="off")
            cfg_path, out_path = Path(d) / "config.json", Path(d) / "result.json"
            cfg_path.write_text(json.dumps(dataclasses.asdict(child)))
            out_path.unlink(missing_ok=True)
            log(f"[bench] {name}: in a fresh process")
            rc = subprocess.call([sys.executable, "-m", "omnilab.bench.run", "--child", str(cfg_path), str(out_path)])
            if rc != 0 or not out_path.is_file():
                meta["notes"].append(f"{name}: its process failed (exit {rc})")
                log(f"[bench] {name}: failed (exit {rc})")
                continue
            part = json.loads(out_path.read_text())
            rows += part["rows"]
            points += part["summary"]
            reqs += part["requests"]
            meta.setdefault("children", {})[name] = {k: part["meta"].get(k) for k in ("pid", "started", "machine")}
            meta["notes"] += part["meta"].get("notes", [])
    return rows, points, reqs, [{"round": 1, "order": list(cfg.configs), "fresh_processes": True}]
