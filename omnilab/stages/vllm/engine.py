"""The vLLM talker stage: the talker inside vLLM's CPU engine, behind the same API as the eager stage.

Contract:
- ``VllmTalkerStage(model, config)`` builds a ``vllm.LLMEngine`` whose worker is
  :class:`~omnilab.stages.vllm.worker.TalkerCPUWorker`. ``config.multiprocess=False`` runs engine core and
  worker in this process (lock-step ``step()``, fast init, notebooks); ``True`` spawns vLLM's engine-core
  and worker processes, the worker's OpenMP threads bound to ``config.talker_cpus``; ``tensor_parallel_size=N``: N
  worker processes (ranks, ``talker`` and ``talker-rank<i>`` in ``processes()``), each on its own CPU list.
- Same methods as :class:`~omnilab.stages.eager.EagerTalkerStage`: ``add_request(request_id,
  PromptRequest, SamplingParams) -> seed``, ``step(return_hidden) -> list[VllmFrameOutput]``, ``abort``,
  ``has_unfinished``, ``num_live``, ``close`` (also a finalizer), ``max_new_tokens_limit``.
- Frame and stop semantics equal the eager backend's (same codes for the same seed up to float rounding;
  greedy codes match): ``max_new_tokens`` counts talker tokens (vLLM ``max_tokens = max_new_tokens - 1``,
  every sampled non-EOS token becomes a frame), ``min_new_tokens`` masks EOS, EOS is a stop token. One
  difference in *when*: a frame is returned in the step that computed it, so an EOS stop arrives one step
  later as an output with ``codes=None``, ``finish_reason="eos"``. Generation is also capped by the
  engine's ``max_model_len`` (``finish_reason="length"``).
- Sleep mode and GPU-only engine options raise :class:`~omnilab.errors.UnsupportedError`.
- Engine death (a killed engine-core or talker worker process, an exception in the engine step, an answer
  that does not come within ``OMNILAB_WORKER_TIMEOUT_S``): that call and every later one raise
  :class:`~omnilab.errors.WorkerError` naming the cause (never vLLM's ``EngineDeadError``); ``respawn()``
  (``pipe.restart()``) builds a new stage with the same config. A row whose talker logits are not finite ends its
  request (``step()`` raises ``InputError`` naming request and frame); the engine lives on. Workers die with the
  client (:mod:`omnilab.stages.lifecycle`); a closed and dropped stage frees its memory (``imports.py``).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from omnilab.stages.base import DEFAULT_MAX_NEW_TOKENS_LIMIT, FrameOutput
from omnilab.errors import InputError, UnsupportedError, WorkerError
from omnilab.models.prompt import PromptRequest, prompt_length
from omnilab.sampling import SamplingParams
from omnilab.stages.vllm import imports, liveness, payload as vllm_payload
from omnilab.stages.vllm.config import (VllmStageConfig, compile_predictor_flag, engine_env, engine_kwargs,
                                        kv_bytes_per_token)
from omnilab.stages import lifecycle
from omnilab.logs import quiet_libraries
from omnilab.stages._env import temporary_environ
from omnilab.stages.vllm.plugin import register
from omnilab.stages.vllm.view import view_dir

__all__ = ["VllmTalkerStage", "VllmStageConfig", "VllmFrameOutput"]

@dataclass
class VllmFrameOutput(FrameOutput):
    """:class:`~omnilab.stages.base.FrameOutput` plus vLLM step accounting (ms)."""
    schedule_ms: float = 0.0   # scheduler.schedule() (in-process only)
    engine_ms: float = 0.0     # worker idle gap before this step: scheduling, output handling, IPC
    cycle_ms: float = 0.0      # worker cycle of this step: idle gap + execute_model + sample_tokens
    step_ms: float = 0.0       # wall time of LLMEngine.step() seen by the client
    batch_rows: int = 0        # rows that produced a frame in this step
    step: int = 0              # worker step counter


@dataclass
class _Live:
    user_id: Hashable
    ext_id: str
    int_id: str
    seed: int
    frames: int = 0


class VllmTalkerStage:
    backend = "vllm"

    def __init__(self, model, config: VllmStageConfig | None = None):
        self.model = model
        self.config = config = config or VllmStageConfig()
        cfg = model.config
        self.eos_id = cfg.talker.codec_eos_token_id
        self.pad_id = cfg.talker.codec_pad_id
        limit = int(model.generation.max_new_tokens) if model.generation.max_new_tokens else 0
        self.max_new_tokens_limit = max(limit, DEFAULT_MAX_NEW_TOKENS_LIMIT)
        self._live: dict[Hashable, _Live] = {}
        self._by_ext: dict[str, _Live] = {}
        self._pending: list[VllmFrameOutput] = []
        self._ids = itertools.count()
        self._share_key = None
        self._return_hidden = False
        self._worker_pid: int | None = None  # the talker worker (rank 0); _rank_pids: every rank's
        self._rank_pids: list[int] = []
        self._dead: str | None = None  # why the engine died (every later call raises WorkerError with it)
        self.timeout_s = lifecycle.worker_timeout_s()
        self.schedule_ms = 0.0
        self.init_s = 0.0
        self.engine = self._build_engine()
        self._finalizer = weakref.finalize(self, liveness.shutdown, self.engine.engine_core)
        self._closed = False
        if config.multiprocess:
            # The engine core runs steps ahead of step() calls, so a per-step flag could arrive after the
            # frame was computed: across processes the hidden state always travels (4 B x H per frame)
            # and step() drops it unless asked for.
            ranks = self.rpc("omnilab_set", None, True, all_ranks=True)  # one answer per tensor-parallel rank
            self._rank_pids = [r.get("pid") for r in ranks]
            self._worker_pid = self._rank_pids[0]
            self._return_hidden = True
            self.engine.get_supported_tasks()  # cached now: add_request would ask with an untimed call

    # ---- construction --------------------------------------------------------------------------------
    def _build_engine(self):
        c, m = self.config, self.model
        quiet_libraries(c.log_level)  # vLLM's level and warning filters, here and in the engine's processes
        t0 = time.perf_counter()
        import vllm.envs
        from vllm import LLMEngine
        from vllm.engine.arg_utils import EngineArgs

        register()
        dtype = "float32" if m.dtype == torch.float32 else "bfloat16"
        compile_flag, compile_source = compile_predictor_flag(c.compile_predictor, os.environ)
        self.compile_predictor = (compile_flag, compile_source)
        # vLLM's CPU variables stay set and reach the engine; the KV size and the binding agree with them, and
        # the engine's processes start with the profile's environment (c.env): config.engine_kwargs / engine_env
        kwargs = engine_kwargs(c, os.environ, model_dir=str(view_dir(m.path)), dtype=dtype,
                               per_token_bytes=kv_bytes_per_token(m.config, m.dtype))
        env = engine_env(c, os.environ, compile_predictor=compile_flag)
        quant = getattr(m, "quantization", None)
        if quant is not None and quant.enabled:  # the worker quantizes at load as the client did (model.py)
            kwargs["hf_overrides"] = {**kwargs["hf_overrides"], "omnilab_quantization": quant.key()}
        set_threads = torch.set_num_threads
        if not c.multiprocess and c.talker_threads is not None:
            torch.set_num_threads(c.talker_threads)
        vllm.envs.disable_envs_cache()
        if c.multiprocess:  # the engine core and talker worker die with this process (stages/lifecycle.py)
            lifecycle.check_spawnable("vLLM engine core")
            marker = lifecycle.spawn_marker()
            env = {**env, lifecycle.PARENT_ENV: lifecycle.parent_token(), lifecycle.MARKER_ENV: marker}
        try:
            if not c.multiprocess and m.talker is not None:
                from omnilab.stages.vllm.model import share_talker  # lazy: vllm
                self._share_key = share_talker(m.talker)
                kwargs["hf_overrides"] = {**kwargs["hf_overrides"], "omnilab_share_key": self._share_key}
            with temporary_environ(env):
                engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        except Exception:  # an engine core that stopped for want of a __main__ guard left the marker
            if c.multiprocess and lifecycle.guard_tripped(marker):
                raise lifecycle.main_guard_error("vLLM engine core") from None
            raise
        finally:
            torch.set_num_threads = set_threads  # CPUWorker replaces it with a no-op, process-wide
            vllm.envs.disable_envs_cache()
            if self._share_key is not None:  # the worker holds the talker now (or failed to)
                from omnilab.stages.vllm.model import unshare_talker  # lazy: vllm
                unshare_talker(self._share_key)
                self._share_key = None
        self.init_s = time.perf_counter() - t0
        imports.drop_import_tracebacks()  # else vLLM's first import pins these frames, and this stage, for good
        if not c.multiprocess:
            self._wrap_scheduler(engine)
        elif c.engine_core_nice:
            liveness.renice(engine, c.engine_core_nice)
        return engine

    def _wrap_scheduler(self, engine) -> None:
        core = getattr(engine.engine_core, "engine_core", None)
        sched = getattr(core, "scheduler", None)
        if sched is None:
            return
        inner = sched.schedule

        def timed_schedule(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.schedule_ms = 1e3 * (time.perf_counter() - t0)
        sched.schedule = timed_schedule

    # ---- in-process access ------------------------------------------------------------------------------
    @property
    def worker(self):
        """The worker object (in-process only; None in multiprocess mode)."""
        core = getattr(self.engine.engine_core, "engine_core", None)
        executor = getattr(core, "model_executor", None)
        driver = getattr(executor, "driver_worker", None)
        return getattr(driver, "worker", None)

    @property
    def runner(self):
        w = self.worker
        return None if w is None else w.model_runner

    def rpc(self, method: str, *args: Any, timeout: float | None = None, all_ranks: bool = False) -> Any:
        """``collective_rpc`` on the talker worker (every tensor-parallel rank runs it) -> rank 0's result (the
        list of every rank's with ``all_ranks``), within ``timeout`` s (None: ``self.timeout_s``); a dead or
        silent engine raises WorkerError."""
        self._check_live()
        timeout = self.timeout_s if timeout is None else timeout
        pick = (lambda r: list(r)) if all_ranks else (lambda r: r[0])
        if not self.config.multiprocess:
            return pick(self.engine.collective_rpc(method, timeout=timeout, args=args))
        if not self._engine_alive():
            raise self._died()
        try:
            return pick(liveness.timed_rpc(self.engine.engine_core, method, args, timeout, self._engine_alive))
        except TimeoutError:
            raise self._died(f"no answer to RPC {method!r} within {timeout:g} s ({lifecycle.WORKER_TIMEOUT_ENV})")
        except Exception as e:
            if isinstance(e, WorkerError) or liveness.is_dead_error(e) or not self._engine_alive():
                raise self._died() from None
            raise

    def processes(self) -> dict[int, str]:
        """``{pid: role}`` of the engine's processes (in-process: the caller's own pid)."""
        if not self.config.multiprocess or self._closed:
            return {os.getpid(): "client+talker"}
        out = {p.pid: "talker-engine-core" for p in liveness.engine_processes(self.engine.engine_core) if p.pid}
        if self._worker_pid is None:
            with contextlib.suppress(Exception):
                self._worker_pid = int(self.summary()["pid"])
        if self._worker_pid is not None:
            out[self._worker_pid] = "talker"
        out.update({pid: f"talker-rank{i}" for i, pid in enumerate(self._rank_pids) if i})
        return out

    def summary(self) -> dict[str, Any]:
        """Worker-side state tables, step counter, pid, CPU affinity and torch thread count."""
        return self.rpc("omnilab_summary")

    def take_spans(self) -> list[dict[str, Any]]:  # spans come with each step's outputs, none apart
        return []

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, req: PromptRequest, params: SamplingParams) -> int:
        """Queue a request (prefilled by the next step). Returns the seed in use."""
        self._check_live()
        if request_id in self._live:
            raise InputError(f"request_id {request_id!r} is already running")
        cfg = self.model.config
        n_prompt = prompt_length(cfg, req)
        room = self.config.max_model_len - n_prompt
        if room < 1:
            raise InputError(f"prompt of {n_prompt} positions leaves no room under the engine's max_model_len "
                             f"{self.config.max_model_len}")
        params.validate(self.max_new_tokens_limit)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        if params.max_new_tokens <= 1:  # token 0 would be the last one: it never becomes a frame
            self._pending.append(VllmFrameOutput(request_id, 0, None, True, "length", seed))
            return seed
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        max_tokens = min(params.max_new_tokens - 1, room)
        extra = vllm_payload.request_to_extra(req, params, seed)
        sp = VllmSampling(max_tokens=max_tokens, min_tokens=min(params.min_new_tokens, max_tokens), temperature=0.0,
                          stop_token_ids=[self.eos_id], detokenize=False, skip_special_tokens=False,
                          extra_args={vllm_payload.EXTRA_KEY: extra})
        ext = f"omni-{next(self._ids)}"
        try:
            int_id = self.engine.add_request(ext, TokensPrompt(prompt_token_ids=[self.pad_id] * n_prompt), sp)
        except Exception as e:
            if liveness.is_dead_error(e) or (self.config.multiprocess and not self._engine_alive()):
                raise self._died() from None
            raise
        live = _Live(request_id, ext, int_id, seed)
        self._live[request_id] = live
        self._by_ext[ext] = live
        return seed

    def step(self, return_hidden: bool = False) -> list[VllmFrameOutput]:
        """One engine step -> one :class:`VllmFrameOutput` per request that produced something."""
        self._check_live()
        outs, self._pending = self._pending, []
        if return_hidden != self._return_hidden and not self.config.multiprocess:
            self.rpc("omnilab_set", None, return_hidden)
            self._return_hidden = return_hidden
        if not self._live:
            return outs
        t0 = time.perf_counter()
        if self.config.multiprocess:
            self._wait_for_output()
        try:
            results = self.engine.step()
        except Exception as e:  # the engine's state is unknown now: dead for every later call
            if liveness.is_dead_error(e):
                raise self._died() from None
            raise self._died(f"the engine step raised {type(e).__name__}: {e}") from e
        step_ms = 1e3 * (time.perf_counter() - t0)
        poisoned = []
        for ro in results:
            live = self._by_ext.get(ro.request_id)
            if live is None:
                continue
            data = getattr(getattr(ro, "outputs", None), "data", None)
            d = vllm_payload.decode(data) if isinstance(data, torch.Tensor) else None
            codes = d["codes"] if d else None
            finished = bool(ro.finished)
            reason = None if not finished else ("length" if codes is not None else "eos")
            if d is None:  # no record: the engine ended the request without a step of ours
                reason = "length" if finished else None
            o = VllmFrameOutput(
                live.user_id, d["frame_index"] if d else live.frames, codes, finished, reason, live.seed,
                hidden=d["hidden"] if d and return_hidden else None, step_ms=step_ms, schedule_ms=self.schedule_ms)
            if d:
                for name in vllm_payload.TIMING_FIELDS:
                    setattr(o, name, d[name])
                o.batch_rows, o.step = d["batch_rows"], d["step"]
                o.worker_pid, o.worker_tid = d["pid"], d["tid"]
            if codes is not None:
                live.frames += 1
            if finished:
                self._forget(live)
            if d is not None and d["nonfinite"]:
                poisoned.append(o)
                continue
            outs.append(o)
        if poisoned:  # their requests end here; the engine and the other requests live on
            self._pending += outs
            for o in poisoned:
                self.abort(o.request_id)
            o = poisoned[0]
            raise InputError(f"request {o.request_id!r}: the talker's logits at frame {o.frame_index} are not "
                             "finite (NaN/Inf): the request's inputs (ref_audio, x-vector) or the checkpoint's "
                             "weights hold NaN/Inf; the request was ended")
        return outs

    def _engine_alive(self) -> bool:
        return liveness.engine_alive(self.engine.engine_core)

    def _wait_for_output(self) -> None:
        """Block until the engine core has sent a step's outputs (:func:`liveness.wait_for_output`)."""
        got = liveness.wait_for_output(self.engine.engine_core, self.timeout_s, self._engine_alive)
        if got == "dead":
            raise self._died()
        if got == "timeout":
            raise self._died(f"no step output within {self.timeout_s:g} s ({lifecycle.WORKER_TIMEOUT_ENV}); "
                             "the engine core or talker worker is stopped, frozen or overloaded")

    # ---- death -------------------------------------------------------------------------------------------
    def _died(self, cause: str | None = None) -> WorkerError:
        """Mark the engine dead (the first cause stays; a process that exited comes first) -> the WorkerError."""
        if self._dead is None:
            core = self.engine.engine_core
            pids = self._rank_pids or self._worker_pid
            found = liveness.death_cause(core, pids) if self.config.multiprocess else None
            self._dead = found or cause or "the engine core stopped (its log on stderr has the traceback)"
        return self._dead_error()

    def _dead_error(self) -> WorkerError:
        return WorkerError(f"the vLLM talker engine is dead: {self._dead}. Every call raises this error until "
                           "pipe.restart() (new worker processes, same deployment) or a new Pipeline")

    def _check_live(self) -> None:
        self._check_open()
        if self._dead is not None:
            raise self._dead_error()

    def abort(self, request_id: Hashable) -> VllmFrameOutput | None:
        """Drop a request, free its KV blocks and worker state. None if the id is unknown."""
        live = self._live.get(request_id)
        if live is None:
            for i, o in enumerate(self._pending):
                if o.request_id == request_id:
                    return self._pending.pop(i)
            return None
        self._forget(live)
        if not self._closed and self._dead is None:
            self.engine.abort_request([live.ext_id])
            self.rpc("omnilab_release", [live.int_id])
        return VllmFrameOutput(request_id, max(live.frames - 1, 0), None, True, "abort", live.seed)

    def _forget(self, live: _Live) -> None:
        self._live.pop(live.user_id, None)
        self._by_ext.pop(live.ext_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._live or self._pending)

    @property
    def num_live(self) -> int:
        return len(self._live) + len(self._pending)

    def sleep(self, level: int = 1) -> None:
        raise UnsupportedError("sleep mode is not supported on CPU: it offloads weights and KV cache from GPU "
                               "memory; close() the pipeline to free the talker's memory instead")

    wake_up = sleep

    # ---- lifetime ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InputError("this vLLM talker stage is closed")

    def respawn(self) -> "VllmTalkerStage":
        """Close this stage and build a new one like it (new engine processes, same config): after a death."""
        self.close()
        return type(self)(self.model, self.config)

    def close(self) -> None:
        """Abort everything and stop the engine (and its processes). Idempotent."""
        if self._closed:
            return
        for rid in list(self._live):
            with contextlib.suppress(Exception):
                self.abort(rid)
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "VllmTalkerStage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "multiprocess" if self.config.multiprocess else "in-process"
        return f"VllmTalkerStage({mode}, live={len(self._live)}, closed={self._closed})"
