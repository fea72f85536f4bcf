"""``BatchWorker``: one ``Pipeline`` in one process, synthesizing one manifest row per call.

The same class runs as a Ray actor (``cluster``) and, without Ray, in the driver (``run``). It writes nothing:
``synthesize`` returns the audio and the row's metrics, and the driver writes the files, so a worker that dies
mid-utterance leaves no partial file and the cluster needs no shared filesystem for the output. ``numa_pools``
is what a node reports before its actors are sized (its NUMA nodes and their physical cores).
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Mapping

from omnilab.errors import OmnilabError
from omnilab.hardware import probe_hardware


def numa_pools() -> list[tuple[int, tuple[int, ...]]]:
    """``[(NUMA node id, first CPU of each usable physical core)]`` of the machine this runs on (probed)."""
    hw = probe_hardware()
    pools: dict[int, list[int]] = {}
    for core in hw.usable_cores:
        pools.setdefault(core.node, []).append(core.cpus[0])
    return sorted((n, tuple(c)) for n, c in pools.items())


def settings_json(settings: Mapping[str, Any]) -> str:
    """The row's generation settings as JSON (the Parquet ``settings`` column; reference audio by path)."""
    return json.dumps({k: (v if not isinstance(v, tuple) else "<array>") for k, v in sorted(settings.items())},
                      sort_keys=True)


def profile_line(pipe) -> str:
    """``auto: shared, talker 2 thr [0-1], code2wav 1 thr [1]`` (what the actor's Pipeline applied)."""
    prof = pipe.profile
    if prof is None:
        return "none"
    mode = prof.values().get("mode", "")
    return (f"{prof.name}: {mode}, talker {prof.threads('talker')} thr [{prof.bind_string('talker')}], "
            f"code2wav {prof.threads('code2wav')} thr [{prof.bind_string('code2wav')}]")


class BatchWorker:
    """Build one Pipeline (``Pipeline.from_pretrained(model, **pipeline_kwargs)``) and serve ``synthesize`` calls.

    Args:
        name: the actor's name in records (``a0``, ``a0.r1`` after a restart).
        node: the node's label in records (Ray node IP and id, or the host name).
        cpus: pin this process to these CPUs before torch starts its threads (None: leave the affinity).
        env: variables set in this process first (the driver's ``OMNILAB_*`` overrides).
    """

    def __init__(self, model: Any, *, name: str = "local", node: str | None = None, cpus: tuple[int, ...] | None = None,
                 env: Mapping[str, str] | None = None, **pipeline_kwargs):
        os.environ.update(env or {})
        if cpus:
            os.sched_setaffinity(0, cpus)
        from omnilab.pipeline import Pipeline  # lazy: torch

        t0 = time.perf_counter()
        self.name, self.node, self.cpus = name, node or socket.gethostname(), tuple(cpus or ())
        self.pipe = Pipeline.from_pretrained(model, **pipeline_kwargs)
        self.load_s = time.perf_counter() - t0
        self.profile = profile_line(self.pipe)

    def info(self) -> dict[str, Any]:
        import torch

        return {"actor": self.name, "node": self.node, "pid": os.getpid(), "host": socket.gethostname(),
                "profile": self.profile, "threads": torch.get_num_threads(), "cpus": self.cpus,
                "affinity": tuple(sorted(os.sched_getaffinity(0))), "load_s": round(self.load_s, 3),
                "model": str(self.pipe.model.path), "variant": self.pipe.model.config.tts_model_type}

    def synthesize(self, utt: Mapping[str, Any]) -> dict[str, Any]:
        """One row (``Utterance.to_dict()``, ``ref_audio`` possibly already read as ``(wav, sr)``) -> its record
        with ``audio`` (float32 at 24 kHz). A request the model refuses (``OmnilabError``) comes back as a record
        with ``error`` set; anything else raises (the driver reports it for that row)."""
        base = {"id": utt["id"], "line": utt["line"], "text": utt["text"], "node": self.node, "actor": self.name,
                "pid": os.getpid(), "profile": self.profile,
                "settings": utt.get("settings_json") or settings_json(utt["settings"])}
        try:
            res = self.pipe.generate(utt["text"], **utt["settings"])
        except OmnilabError as e:
            return {**base, "error": f"{type(e).__name__}: {e}"}
        return {**base, "audio": res.audio, "frames": res.num_frames, "audio_s": res.duration_s,
                "ttfa_ms": res.ttfa_ms, "wall_s": res.wall_s, "rtf": res.rtf, "finish_reason": res.finish_reason,
                "seed": res.seed, "error": None}

    def close(self) -> None:
        self.pipe.close()
