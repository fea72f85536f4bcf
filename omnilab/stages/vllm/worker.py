"""``TalkerCPUWorker``: vLLM's ``CPUWorker`` running :class:`~omnilab.stages.vllm.runner.TalkerCPUModelRunner`.

Contract: selected with ``EngineArgs(worker_cls="omnilab.stages.vllm.worker.TalkerCPUWorker")``. Importing
this module registers the omnilab talker with vLLM (:func:`omnilab.stages.vllm.plugin.register`), so spawned
engine-core and worker processes know it without an installed entry point. The worker only swaps the
runner class and adds RPC methods (``collective_rpc("omnilab_...")``): a state summary, releasing
aborted requests, runner options (and this process's pid), and a readback of this process's CPU affinity and
thread count. Like the engine core, the worker process dies with its parent (``register()`` arms
:func:`omnilab.stages.lifecycle.adopt_parent_from_env`).
Sleep mode raises :class:`~omnilab.errors.UnsupportedError` (vLLM's CPU worker silently ignores it).
"""
from __future__ import annotations

import os
from typing import Any

import torch

import vllm.v1.worker.cpu_worker as _cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

from omnilab.errors import UnsupportedError
from omnilab.logs import native_notices
from omnilab.stages.vllm.plugin import register
from omnilab.stages.vllm.runner import TalkerCPUModelRunner

register()


class TalkerCPUWorker(CPUWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # CPUWorker.__init__ binds memory through vLLM's C++ init_cpu_memory_env, which prints a NUMA binding notice
        # straight to stderr: dropped while quiet, anything else printed there is passed on (omnilab.logs)
        with native_notices():
            super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        if self.use_v2_model_runner:
            raise UnsupportedError("omnilab's talker hooks target vLLM's V1 CPU model runner; unset "
                                   "VLLM_USE_V2_MODEL_RUNNER")
        original = _cpu_worker.CPUModelRunner
        _cpu_worker.CPUModelRunner = TalkerCPUModelRunner
        try:
            super().init_device()
        finally:
            _cpu_worker.CPUModelRunner = original
        if not isinstance(self.model_runner, TalkerCPUModelRunner):
            raise RuntimeError("the omnilab talker runner was not installed")

    # ---- unsupported on CPU ----------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        raise UnsupportedError("sleep mode is not supported on CPU (it offloads GPU memory); omnilab runs the "
                               "talker on CPUs only")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise UnsupportedError("sleep mode (wake_up) is not supported on CPU")

    # ---- RPC ---------------------------------------------------------------------------------------
    def omnilab_summary(self) -> dict[str, Any]:
        """Runner state tables plus this process's pid, affinity and thread count."""
        r: TalkerCPUModelRunner = self.model_runner
        out = r.tts_summary()
        out.update(process_info())
        return out

    def omnilab_release(self, req_ids: list[str]) -> int:
        return self.model_runner.release(req_ids)

    def omnilab_set(self, predictor_per_row: bool | None = None, return_hidden: bool | None = None) -> dict:
        r: TalkerCPUModelRunner = self.model_runner
        if predictor_per_row is not None:
            r.predictor_per_row = bool(predictor_per_row)
        if return_hidden is not None:
            r.return_hidden = bool(return_hidden)
        return {"predictor_per_row": r.predictor_per_row, "return_hidden": r.return_hidden, "pid": os.getpid()}


def process_info() -> dict[str, Any]:
    """pid, CPU affinity, torch intra-op threads and the OpenMP/binding environment of this process."""
    return {"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
