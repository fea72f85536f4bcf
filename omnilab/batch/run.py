"""``synthesize(manifest, model, out, address=...)``: a manifest to ``out/wav/<id>.wav`` and ``out/metrics.parquet``.

Output directory:
- ``wav/<id>.wav``: float32 WAV at 24 kHz, written as ``wav/<id>.wav.part`` and renamed (``os.replace``), so a
  ``<id>.wav`` is always whole; a row counts as done when its wav exists;
- ``records/<id>.json``: the row's metrics, renamed into place just before its wav (so every wav has a record);
- ``metrics.parquet``: one row per finished manifest id, rebuilt from ``records/`` at the end of every run
  (also after an interrupt): id, line, text, frames, audio_s, ttfa_ms, wall_s, rtf, finish_reason, seed, node,
  actor, pid, profile, settings (JSON), run_id, finished_at.

Resume: ids whose wav exists are skipped (their record and wav are left untouched); run again after a stop
and only the rest is synthesized. Where the work runs: Ray (``address``: ``None``/``"local"`` a local
instance, ``"auto"``, ``"ray://HOST:PORT"``; see ``omnilab.batch.cluster``) or, with ``address="none"`` or
when ``ray`` is not installed and no address was given, one Pipeline in this process, one row after another.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import omnilab.batch.cluster as cluster
from omnilab.batch.manifest import Manifest, RowError, check_for_model, from_records, read_manifest
from omnilab.batch.worker import BatchWorker, settings_json
from omnilab.errors import InputError, UnsupportedError

RECORD_COLUMNS = ("id", "line", "text", "frames", "audio_s", "ttfa_ms", "wall_s", "rtf", "finish_reason", "seed",
                  "node", "actor", "pid", "profile", "settings", "run_id", "finished_at")
NO_RAY = "ray is not installed: running sequentially in this process (pip install -e \".[cluster]\" for Ray)"


@dataclass(frozen=True, eq=False)
class BatchReport:
    """What a run did: ``done`` ids synthesized now, ``skipped`` ids already there, ``failed`` rows (manifest
    errors and refused or crashed rows, each with its line), ``restarts`` of dead actors, the actors' ``actors``
    info, and ``metrics`` (the Parquet's DataFrame)."""
    out: Path
    mode: str
    done: tuple[str, ...]
    skipped: tuple[str, ...]
    failed: tuple[RowError, ...]
    restarts: int
    wall_s: float
    metrics: Any = field(repr=False, default=None)
    actors: tuple[dict, ...] = field(repr=False, default=())
    run_id: str = ""
    synth_s: float = 0.0  # from the actors being ready to the last row (wall_s also counts connecting and loading)

    @property
    def utterances_per_s(self) -> float:
        """Rows synthesized per second once the actors were loaded (``synth_s``)."""
        return len(self.done) / self.synth_s if self.synth_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        m = self.metrics
        new = m[m["run_id"] == self.run_id] if m is not None and len(m) else None
        audio = float(new["audio_s"].sum()) if new is not None else 0.0
        return {"mode": self.mode, "actors": len(self.actors), "done": len(self.done), "skipped": len(self.skipped),
                "failed": len(self.failed), "restarts": self.restarts, "wall_s": round(self.wall_s, 2),
                "synth_s": round(self.synth_s, 2), "utterances_per_s": round(self.utterances_per_s, 3),
                "audio_s_per_s": round(audio / self.synth_s, 3) if self.synth_s > 0 else 0.0,
                "metrics": str(self.out / "metrics.parquet")}

    def __str__(self) -> str:
        w = max(len(k) for k in self.summary())
        return "\n".join(f"{k:<{w}}  {v}" for k, v in self.summary().items())


class OutputDir:
    """The files of one output directory; writes are renames of whole files."""

    def __init__(self, out: str | Path):
        self.root = Path(out)
        self.wav_dir, self.rec_dir = self.root / "wav", self.root / "records"
        for d in (self.wav_dir, self.rec_dir):
            d.mkdir(parents=True, exist_ok=True)
        for stale in list(self.wav_dir.glob("*.part")) + list(self.rec_dir.glob("*.part")):
            stale.unlink(missing_ok=True)  # a previous run stopped while writing: never a finished file

    def wav(self, rid: str) -> Path:
        return self.wav_dir / f"{rid}.wav"

    def done(self, rid: str) -> bool:
        return self.wav(rid).is_file()

    def write(self, rec: Mapping[str, Any]) -> None:
        import soundfile as sf

        rid = rec["id"]
        meta = {k: rec.get(k) for k in RECORD_COLUMNS}
        tmp_rec = self.rec_dir / f"{rid}.json.part"
        tmp_rec.write_text(json.dumps(meta, default=float))
        tmp_wav = self.wav_dir / f"{rid}.wav.part"
        sf.write(str(tmp_wav), rec["audio"], 24000, subtype="FLOAT", format="WAV")
        os.replace(tmp_rec, self.rec_dir / f"{rid}.json")
        os.replace(tmp_wav, self.wav(rid))

    def write_metrics(self, ids: list[str]):
        import pandas as pd

        rows = []
        for rid in ids:
            p = self.rec_dir / f"{rid}.json"
            if self.done(rid) and p.is_file():
                rows.append(json.loads(p.read_text()))
        df = pd.DataFrame(rows, columns=list(RECORD_COLUMNS))
        tmp = self.root / "metrics.parquet.part"
        df.to_parquet(tmp, index=False)
        os.replace(tmp, self.root / "metrics.parquet")
        return df


def _read_ref(settings: dict) -> dict:
    """``ref_audio`` path -> ``(wav, sample_rate)``, read here so the actors need no shared filesystem."""
    if "ref_audio" not in settings:
        return settings
    import soundfile as sf

    wav, sr = sf.read(settings["ref_audio"], dtype="float32", always_2d=False)
    return {**settings, "ref_audio": (wav, int(sr))}


def synthesize(manifest: str | Path | Manifest | list, model: Any = None, out: str | Path = "batch-out", *,
               address: str | None = None, backend: str = "vllm", deploy_profile: Any = "auto", dtype: Any = None,
               threads: int | None = None, actors_per_node: int | None = None, strict: bool = False,
               progress: bool = True, max_retries: int = 2, on_record: Callable[[dict], None] | None = None,
               log: Callable[[str], None] | None = None, **pipeline_kwargs) -> BatchReport:
    """Synthesize every row of ``manifest`` with ``model`` (a directory or hub id; None: the embedded tiny
    checkpoint) into ``out`` (see the module docstring); return a ``BatchReport``.

    Args:
        manifest: a CSV / JSONL / Parquet path, a ``Manifest``, or a list of row dicts.
        address: ``None`` (local Ray, or this process when ray is not installed), ``"local"``, ``"local:N"``
            (N Ray nodes started on this machine), ``"auto"``, ``"ray://HOST:PORT"``, ``"HOST:PORT"``, or
            ``"none"`` (this process, no Ray).
        backend, deploy_profile, dtype, **pipeline_kwargs: for each actor's ``Pipeline.from_pretrained``.
        threads: threads (and Ray CPUs) per actor; None: the NUMA node's physical cores (``cluster``).
        actors_per_node: None: one per NUMA node.
        strict: refuse the whole run (``InputError`` listing every bad row) instead of running the good rows.
        max_retries: how often a row whose actor died is run again before it is reported failed.
        on_record: called with each new record (in the driver) as it is written.
        log: where messages go (default: stderr).
    """
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    m = manifest if isinstance(manifest, Manifest) else (
        from_records(manifest) if isinstance(manifest, list) else read_manifest(manifest))
    if model is not None:
        m = check_for_model(m, model)
    if m.errors and strict:
        raise InputError(f"{len(m.errors)} bad row(s) in the manifest (strict: nothing was run):\n"
                         + "\n".join(f"  {e}" for e in m.errors))
    for e in m.errors:
        say(f"[batch] skipped {e}")
    outdir = OutputDir(out)
    skipped = tuple(u.id for u in m.utterances if outdir.done(u.id))
    todo = [u for u in m.utterances if not outdir.done(u.id)]
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if skipped:
        say(f"[batch] resume: {len(skipped)} id(s) already in {outdir.wav_dir} are skipped")
    failed: list[RowError] = list(m.errors)
    done: list[str] = []
    where = "row" if m.format in ("parquet", "records") else "line"
    bar = None  # made once the actors are loaded (started)
    audio_total = [0.0]

    def deliver(rec: dict) -> None:
        if rec.get("error"):
            failed.append(RowError(rec["line"], rec["id"], rec["error"], where))
            say(f"[batch] failed {failed[-1]}")
        else:
            rec = {**rec, "run_id": run_id, "finished_at": time.time()}
            outdir.write(rec)
            done.append(rec["id"])
            audio_total[0] += rec["audio_s"]
            if on_record is not None:
                on_record({k: v for k, v in rec.items() if k != "audio"})
        if bar is not None:
            el = time.perf_counter() - t_run
            bar.set_postfix(audio_x=f"{audio_total[0] / el:.2f}" if el > 0 else "-", failed=len(failed) - len(m.errors))
            bar.update(1)

    kw = dict(backend=backend, deploy_profile=deploy_profile, dtype=dtype, **pipeline_kwargs)
    rows = [{**u.to_dict(), "settings": _read_ref(dict(u.settings)), "settings_json": settings_json(u.settings)}
            for u in todo]
    mode, restarts, actors = "none", 0, ()
    t_run = time.perf_counter()

    def started() -> None:  # the actors are loaded: throughput and ETA count from here
        nonlocal t_run, bar
        t_run = time.perf_counter()
        bar = _bar(len(todo), progress)

    try:
        if todo:
            mode, restarts, actors = _execute(address, model, kw, rows, deliver, say, started, run_id=run_id,
                                              threads=threads, actors_per_node=actors_per_node,
                                              max_retries=max_retries)
    finally:
        if bar is not None:
            bar.close()
        metrics = outdir.write_metrics([u.id for u in m.utterances])
    t_end = time.perf_counter()
    return BatchReport(outdir.root, mode, tuple(done), skipped, tuple(sorted(failed, key=lambda e: e.line)),
                       restarts, t_end - t0, metrics, tuple(actors), run_id, t_end - t_run if todo else 0.0)


def _bar(total: int, progress: bool):
    if not progress or not total:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="utt", desc="omnilab batch", file=sys.stderr, dynamic_ncols=True)


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _execute(address, model, kw, rows, deliver, say, started, *, run_id, threads, actors_per_node, max_retries):
    """Run ``rows`` on Ray or in this process; returns ``(mode, restarts, actor infos)``."""
    if isinstance(address, str) and address.lower() == "none":
        return _sequential(model, kw, rows, deliver, say, started, threads, "this process (address 'none')")
    if not _has_ray():
        if address is not None:
            raise UnsupportedError(f"address {address!r} needs Ray, which is not installed; "
                                   "pip install -e \".[cluster]\", or pass address='none' to run in this process")
        say(f"[batch] {NO_RAY}")
        return _sequential(model, kw, rows, deliver, say, started, threads, "this process (ray not installed)")

    owned = cluster.connect(address)  # None: connected already; a Cluster for "local:N"; True: ray.init here
    pool = None
    try:
        slots = cluster.plan_slots(actors_per_node, threads)
        say(f"[batch] Ray: {len(slots)} actor(s) on {len({s.node_id for s in slots})} node(s)")
        for s in slots:
            say(f"[batch]   a{s.index} on {s.node}: {s.num_cpus} CPU(s) ({s.reason})")
        pool = cluster.ActorPool(slots, model, kw, run_id=run_id, max_retries=max_retries, log=say)
        started()
        pool.run(rows, deliver)
        return "ray", pool.restarts, tuple(pool.infos.values())
    finally:
        if pool is not None:
            pool.close()
        if owned is not None:
            import ray

            ray.shutdown()
            if owned is not True:
                owned.shutdown()


def _sequential(model, kw, rows, deliver, say, started, threads, why):
    w = BatchWorker(model, name="local", node=socket.gethostname(), num_threads=threads, **kw)
    say(f"[batch] {why}: 1 Pipeline, {w.profile}")
    started()
    try:
        for r in rows:
            try:
                rec = w.synthesize(r)
            except Exception as e:  # noqa: BLE001 - reported for this row, the rest still runs
                rec = {"id": r["id"], "line": r["line"], "text": r["text"], "error": f"{type(e).__name__}: {e}"}
            deliver(rec)
        return "sequential", 0, (w.info(),)
    finally:
        w.close()
