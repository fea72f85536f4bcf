"""``Pipeline``: the public entry point — talker stage + code2wav stage behind one notebook-friendly API.

Contract:
- ``Pipeline.from_pretrained(path_or_hub_id, device="cpu", backend="vllm", deploy_profile="auto")`` loads
  the released checkpoint layout (``omnilab.checkpoint.load``), applies the deploy profile (``omnilab.deployment``:
  threads, CPU lists, KV budget, dtype, chunking; ``pipe.profile``, ``pipe.check_profile()``) and builds
  the stages. Only ``device="cpu"``.
- ``generate(...)`` runs one utterance (or a list, batched in the talker) to completion and returns
  ``SynthesisResult``; ``stream(...)`` yields ``AudioChunk``s while later frames are still being
  generated (closing the iterator aborts the request and frees its talker and decoder state).
- ``pipe.talker`` is the step-wise talker (``start`` / ``step`` / ``abort``); ``pipe.code2wav`` decodes
  codes offline (``decode``) or chunk by chunk (``open_session``).
- Safe from any thread: every stage call runs on the pipeline's one owner thread, in arrival order, and talker
  outputs are queued per request, so streams interleave (``omnilab.stages.owner``; docs/reliability.md).
- Instrumentation: every request is recorded as spans (``omnilab.instrument.recorder.Recorder``) that flow to the
  ``hooks=`` given to ``from_pretrained`` (``TimingHook``, ``ThreadUsageHook``, any callable); each
  ``SynthesisResult`` (and the last streamed ``AudioChunk``) carries the request's ``Trace``. The
  pipeline holds no display code. Every stage follows the contract of :mod:`omnilab.stages.base`
  (``processes() -> {pid: role}``, ``take_spans() -> [span dicts]``, ``summary()`` / ``info()``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
import time
import weakref
from typing import Any, Hashable, Iterator, Sequence

import numpy as np
import torch

from omnilab.checkpoint.load import load_model, read_configs, resolve_checkpoint, resolve_dtype, validate_checkpoint_dir
from omnilab.checkpoint.random import default_checkpoint
from omnilab.deployment import PipelineRepr, prepare, quantization_row, quantization_spelling
from omnilab.errors import InputError, UnsupportedError
from omnilab.instrument.hooks import as_hooks
from omnilab.instrument.recorder import Recorder, clock
from omnilab.kernels import kernel_choices
from omnilab.models.code2wav_stream import ChunkSchedule
from omnilab.profiles.planner import as_geometry
from omnilab.profiles.readback import check_stages
from omnilab.requests import UserRequest, build_request
from omnilab.results import AudioChunk, SynthesisResult
from omnilab.sampling import SamplingParams
from omnilab.stages.code2wav.stage import Code2WavStage
from omnilab.stages.eager import EagerTalkerStage
from omnilab.stages.lifecycle import restart_stages
from omnilab.stages.omp_pool import release_caller_pool
from omnilab.stages.owner import AGAIN, FrameRouter, OwnedIterator, OwnerThread
from omnilab.stages.talker_control import OwnedRequests, TalkerControl  # noqa: F401  (TalkerControl: public here)
from omnilab.stages.vllm.deploy import build_stages, client_load_options
from omnilab.tuning.code2wav_timing import timed_code2wav_dtype as c2w_dtype

BACKENDS = ("eager", "vllm")
_SAMPLING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                  "subtalker_do_sample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p", "seed")
_REQUEST_KEYS = ("speaker", "language", "instruct", "ref_audio", "ref_text", "x_vector_only_mode",
                 "non_streaming_mode")


def flush_denormals() -> None:
    """Flush fp32 denormals to zero in this process (they make x86 convs several times slower). numpy's ``finfo``
    tables are computed first: after the switch they report a zero smallest subnormal and warn on every import."""
    for t in (np.float16, np.float32, np.float64, np.longdouble):
        np.finfo(t).smallest_subnormal
    torch.set_flush_denormal(True)


class Pipeline(OwnedRequests, PipelineRepr):
    """Qwen3-TTS 12 Hz on CPU. Build with :meth:`from_pretrained`. Its repr and notebook table: ``PipelineRepr``."""

    def __init__(self, model, talker_stage, code2wav_stage, *, backend: str,
                 chunk_schedule: ChunkSchedule | None = None, hooks: Any = None, deployment: Any = None):
        self.model = model
        self.deployment = deployment
        self.backend = backend
        self._owner = OwnerThread()  # every stage call runs on this one thread (docs/reliability.md)
        weakref.finalize(self, self._owner.stop, 0.0)
        self._router = FrameRouter()  # talker outputs of generate()/stream() requests, per request
        self._stepwise: dict[Hashable, int] = {}  # live pipe.talker.start() request -> the thread driving it
        self._talker = talker_stage
        self.code2wav = code2wav_stage
        self.talker = TalkerControl(self)
        self.chunk_schedule = chunk_schedule or ChunkSchedule(first_frames=1, ramp=(), steady_frames=25)
        self._ids = itertools.count()
        self._requests: dict[Hashable, dict[str, Any]] = {}
        self._cancelled: set[Hashable] = set()  # request ids cancel() asked to end (any thread)
        self._cancel_lock = threading.Lock()
        self._closed = False
        self.hooks = as_hooks(hooks)
        self.recorder = Recorder(self.hooks, meta={
            "backend": backend, "dtype": str(getattr(model, "dtype", "")).replace("torch.", ""),
            "torch_threads": torch.get_num_threads(), "processes": self.processes(),
            "checkpoint": str(getattr(model, "path", "")), **(deployment.trace_meta() if deployment else {})})
        self.hooks.attach(self)

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | os.PathLike | None = None, *, device: str = "cpu",
                        backend: str = "vllm", deploy_profile: Any = "auto", deploy: Any = None,
                        dtype: Any = None, num_threads: int | None = None, max_concurrency: int | None = None,
                        chunk_schedule: ChunkSchedule | None = None, hooks: Any = None, quantization: str | None = None,
                        quant_group_size: int | None = None) -> "Pipeline":
        """Load a checkpoint (directory or hub id; None = the embedded tiny default) and build the stages.

        Args:
            device: only ``"cpu"``.
            backend: ``"vllm"`` (default: the talker inside vLLM's CPU engine) or ``"eager"`` (plain torch
                in this process).
            deploy_profile: ``"auto"`` (probe this machine and plan threads, CPU lists, KV budget, dtype and
                chunking), a preset name (``omnilab.profiles.list_presets()``), a deploy YAML path, a
                ``DeployProfile``, or None (apply nothing). ``pipe.profile`` shows what was applied.
            deploy: ``backend="vllm"`` only: None/``"auto"`` (stage worker processes when the profile gives
                each stage its own CPUs, else the engine in this process), ``"inprocess"``, ``"workers"``
                (vLLM engine-core, talker worker and code2wav worker processes bound to the profile's CPUs;
                alias ``"multiprocess"``),
                or an explicit ``omnilab.stages.vllm.deploy.VllmDeploy`` / ``VllmStageConfig`` / dict.
            dtype: compute dtype (None = the profile's: bf16 only where the CPU has native bf16).
            num_threads: talker threads (None = the profile's; without a profile, leave torch as is).
            max_concurrency: concurrent requests the profile sizes the KV cache and ``max_num_seqs`` for.
            chunk_schedule: streaming chunk sizes (default: the profile's; without one 1 frame, then 25).
            hooks: instrumentation (``omnilab.instrument.hooks``): a ``Hook``, a callable ``fn(span)``, or a list;
                e.g. ``[TimingHook(), ThreadUsageHook()]``. Every result carries a ``Trace`` either way.
            quantization: None/"none", "int8", "int4" or "int4-g32|64|128": decode matrices quantized at load
                (``OMNILAB_QUANTIZATION`` wins; the profile's ``quantization`` field, and ``pipe.deployment``'s
                row); quant_group_size: int4's 32/64/128 (None = 128, or the largest dividing every K).
        """
        if not isinstance(device, str) or device.lower() != "cpu":
            raise UnsupportedError(f"device {device!r} is not supported: omnilab runs on CPUs; accepted: 'cpu'")
        if backend not in BACKENDS:
            raise InputError(f"backend {backend!r} is not known; accepted: {', '.join(BACKENDS)}")

        if path_or_hub_id is None:
            path_or_hub_id = default_checkpoint()
        path = validate_checkpoint_dir(resolve_checkpoint(path_or_hub_id))
        configs = read_configs(path)  # parsed once: the deploy profile's geometry and the loader both use them
        dep = prepare(path, backend=backend, deploy_profile=deploy_profile, deploy=deploy, dtype=dtype,
                      num_threads=num_threads, max_concurrency=max_concurrency, chunk_schedule=chunk_schedule,
                      model_config=as_geometry(*configs, where=path),
                      quantization=quantization_spelling(quantization, quant_group_size))
        if dep.num_threads is not None:
            torch.set_num_threads(dep.num_threads)
        # resolved here: a bad kernel/dtype/quantization variable fails before any worker starts; kernels built once
        kernels = kernel_choices(compute := resolve_dtype(dep.dtype)[0])
        chosen = {k.key: k.choice for k in kernels}
        quant_row = quantization_row(path, *dep.quantization_request(quantization, quant_group_size),
                                     chosen["weights"], compute, configs[0])
        quant = quant_row.choice
        dep = dataclasses.replace(dep, kernels=kernels, gemv=chosen["gemv"], hugepages=chosen["hugepages"],
                                  weights=chosen["weights"], snake=chosen["snake"], quantization=quant_row,
                                  code2wav_dtype=c2w_dtype(dtype), code2wav_conv=chosen["code2wav_conv"],
                                  paths=chosen["paths"])
        flush_denormals()
        if backend == "vllm":
            model = load_model(path, dtype=dep.dtype, configs=configs, quantization=quant,
                               **client_load_options(dep.vllm_deploy))
            talker_stage, code2wav_stage = build_stages(model, dep.vllm_deploy, code2wav_dtype=dep.code2wav_dtype)
        else:
            model = load_model(path, dtype=dep.dtype, configs=configs, quantization=quant)
            c2w = (dep.profile.threads("code2wav") if dep.profile is not None else None, dep.code2wav_dtype)
            talker_stage, code2wav_stage = EagerTalkerStage(model), Code2WavStage(model.code2wav, *c2w)
        pipe = cls(model, talker_stage, code2wav_stage, backend=backend, chunk_schedule=dep.chunk_schedule,
                   hooks=hooks, deployment=dep)
        # loading done: this thread's idle OpenMP pool would throttle the owner thread's when other threads drive
        # the pipeline (a server's worker threads, the bench's clients) and this one never calls it again
        release_caller_pool()
        return pipe

    @property
    def profile(self):
        """The ``DeployProfile`` applied to the stages (None if built with ``deploy_profile=None``)."""
        return self.deployment.profile if self.deployment is not None else None

    def check_profile(self) -> dict[str, Any]:
        """Read back every stage's CPU affinity and threads and compare them with :attr:`profile`.

        Returns ``{stage: ProcessReadback}`` for stages in worker processes, ``{stage: threads}`` for stages
        in this process, and ``"not_applied": {field: reason}`` for profile fields the placement cannot
        honour (e.g. CPU pinning in-process); raises ``WorkerError`` listing every difference from the plan."""
        if self.profile is None:
            raise InputError("this Pipeline has no deploy profile (built with deploy_profile=None)")
        return check_stages(self.profile, self.processes(), {
            "talker": lambda: self._owner.run(self._talker.summary), "code2wav": self.code2wav.info},
            self.deployment.not_applied)

    # ---- requests ---------------------------------------------------------------------------------
    def _sampling(self, kw: dict[str, Any]) -> SamplingParams:
        params = SamplingParams.from_defaults(self.model.generation, **{k: kw.get(k) for k in _SAMPLING_KEYS})
        return params.validate(self._talker.max_new_tokens_limit)

    def _start(self, text, kw: dict[str, Any], request_id: Hashable | None = None, auto_end: bool = False):
        self._check_open()
        t_admit = clock()
        unknown = set(kw) - set(_SAMPLING_KEYS) - set(_REQUEST_KEYS) - {"input_ids"}
        if unknown:
            raise InputError(f"unknown argument(s) {sorted(unknown)}; accepted: "
                             f"{', '.join(('text', 'input_ids') + _REQUEST_KEYS + _SAMPLING_KEYS)}")
        ureq = UserRequest(text=text, input_ids=kw.get("input_ids"), **{k: kw.get(k) for k in _REQUEST_KEYS})
        preq, clean_text = build_request(self.model, ureq)
        params = self._sampling(kw)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = self._talker.add_request(rid, preq, params)
        self._requests[rid] = {"text": clean_text, "ref_codes": preq.ref_codes, "seed": seed,
                               "t0": t_admit[0]}
        self.recorder.begin(rid, t_admit, auto_end=auto_end, text=clean_text)
        return rid, preq

    def _step(self, return_hidden: bool = False) -> list:
        """One talker step, recorded (step span + phases per request, worker spans forwarded)."""
        t = clock()
        outs = self._talker.step(return_hidden=return_hidden)
        self.recorder.step(outs, t)
        self._take_spans(self._talker)
        return outs

    def _take_spans(self, obj) -> None:
        self.recorder.remote(obj.take_spans())

    def processes(self) -> dict[int, str]:
        """``{pid: role}`` of every process doing this pipeline's work (this one and stage workers)."""
        return self._owner.run(self._processes)

    def _processes(self) -> dict[int, str]:
        me = os.getpid()
        out = {me: "client"}
        for name, stage in (("talker", self._talker), ("code2wav", self.code2wav)):
            procs = stage.processes()  # {} for a stage in this process
            if procs:
                out.update(procs)
            else:
                out[me] += f"+{name}"
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise InputError("this Pipeline is closed; create a new one with Pipeline.from_pretrained")

    # ---- whole utterances ---------------------------------------------------------------------------
    def generate(self, text: str | Sequence[str] | None = None, *, return_hidden: bool = False,
                 **kwargs) -> SynthesisResult | list[SynthesisResult]:
        """Synthesize one utterance (``text`` a string) or several (a list; run batched in the talker).

        Keyword arguments: ``input_ids`` (chat-wrapped ids instead of text), ``speaker``, ``language``,
        ``instruct``, ``ref_audio`` (path or ``(wav, sample_rate)``), ``ref_text``, ``x_vector_only_mode``,
        ``non_streaming_mode``, and sampling: ``max_new_tokens``, ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``repetition_penalty``, ``subtalker_do_sample``, ``subtalker_temperature``,
        ``subtalker_top_k``, ``subtalker_top_p``, ``seed``. For a batch, each keyword may be a list of
        the same length or a single value for all.
        """
        self._check_open()
        batch = isinstance(text, (list, tuple))
        if batch and not text:
            raise InputError("text is an empty list; give at least one sentence")
        texts = list(text) if batch else [text]
        n = len(texts)
        per_req = []
        for i in range(n):
            kw = {}
            for k, v in kwargs.items():
                if isinstance(v, list) and k not in ("input_ids",):
                    if len(v) != n:
                        raise InputError(f"{k} is a list of {len(v)} values but there are {n} texts")
                    v = v[i]
                kw[k] = v
            per_req.append(kw)
        results = self._owner.run(self._generate, texts, per_req, return_hidden)  # calls from any thread: in turn
        return results if batch else results[0]

    def _generate(self, texts: list, per_req: list[dict[str, Any]], return_hidden: bool) -> list[SynthesisResult]:
        rids = []
        try:
            with self.hooks.running():
                for t, kw in zip(texts, per_req):
                    rids.append(self._start_routed(t, kw)[0])
                return self._run_to_end(rids, return_hidden)
        except BaseException:
            for rid in rids:
                self._talker.abort(rid)
                self._requests.pop(rid, None)
                self.recorder.end(rid, "error")
            raise
        finally:
            for rid in rids:
                self._router.drop(rid)

    def _run_to_end(self, rids: list[Hashable], return_hidden: bool) -> list[SynthesisResult]:
        frames = {rid: [] for rid in rids}
        hidden = {rid: [] for rid in rids}
        reason: dict[Hashable, str] = {}
        while left := [r for r in rids if r not in reason]:
            for rid, outs in self._router.pull(left, lambda: self._pump(return_hidden),
                                               self._talker.has_unfinished).items():
                for o in outs:
                    if o.codes is not None:
                        frames[rid].append(o.codes)
                        if o.hidden is not None:
                            hidden[rid].append(o.hidden.float())
                    if o.finished:
                        reason[rid] = o.finish_reason or ""
        out = []
        for rid in rids:
            info = self._requests.pop(rid)
            codes = torch.stack(frames[rid]).numpy() if frames[rid] else np.zeros((0, 16), dtype=np.int64)
            t = clock()
            audio = self.code2wav.decode(codes, prefix_codes=info["ref_codes"]) if len(codes) else \
                np.zeros(0, dtype=np.float32)
            if len(codes):
                self.recorder.span("code2wav_chunk", rid, t, frame_index=0, num_frames=len(codes), mode="offline")
                self._take_spans(self.code2wav)
            self.recorder.deliver(rid, 0, len(codes), len(audio))
            trace = self.recorder.end(rid, reason.get(rid, ""))
            m = trace.request_metrics(str(rid))
            out.append(SynthesisResult(
                codes=codes.astype(np.int64), audio=audio, request_id=str(rid), text=info["text"],
                finish_reason=reason.get(rid, ""), seed=info["seed"], wall_s=m["wall_ms"] / 1e3,
                ttfa_ms=m["ttfa_ms"], trace=trace,
                hidden=torch.stack(hidden[rid]).numpy() if hidden[rid] else None))
        return out

    # ---- streaming ------------------------------------------------------------------------------------
    def stream(self, text: str | None = None, *, chunk_schedule: ChunkSchedule | None = None,
               request_id: Hashable | None = None, **kwargs) -> Iterator[AudioChunk]:
        """Yield ``AudioChunk``s of one utterance as soon as each chunk of frames is decoded.

        Chunk sizes follow ``chunk_schedule`` (default: the pipeline's, first chunk 1 frame then 25).
        Closing the iterator early (``break``, ``.close()``, garbage collection) aborts the request and
        frees its talker KV cache and decoder state; so does ``cancel(request_id)`` from any thread, within a
        talker step. Same keyword arguments as :meth:`generate`; ``request_id`` names the request (None: made up).
        """
        self._check_open()
        if isinstance(text, (list, tuple)):
            raise InputError("stream() takes one text; use generate() for a list")
        st = dict(sched=chunk_schedule or self.chunk_schedule, pending=[], chunk_idx=0, frame_start=0,
                  finished=False, reason="", t=None)
        # a stream's start and its calls until its first chunk go ahead of other streams' queued chunks
        st["rid"], st["preq"] = self._owner.run_first(self._start_routed, text, kwargs, request_id)
        st["info"] = self._requests[st["rid"]]
        return OwnedIterator(self._owner, functools.partial(self._stream_next, st),
                             functools.partial(self._stream_end, st), first=lambda: st["chunk_idx"] == 0)

    def _stream_next(self, st: dict) -> tuple[AudioChunk | None, bool]:
        """On the owner thread: step the talker until this stream's next chunk is due, decode it ->
        ``(chunk, is_last)``; ``(None, True)`` when the request ended without one (aborted, EOS); ``(AGAIN, False)``
        after a step when another call waits for the owner thread (a new request's start, another stream's
        chunk): streams take turns a step at a time, so none waits behind another's whole chunk."""
        rid, sched, rec = st["rid"], st["sched"], self.recorder
        if "session" not in st:
            st["session"] = None
            self.hooks.start()
            st["session"] = self.code2wav.open_session(rid, prefix_codes=st["preq"].ref_codes)
        elif st["t"] is not None:
            rec.span("consumer", rid, st["t"])
            st["t"] = None
        pulled = False
        while not (st["pending"] and (st["finished"] or len(st["pending"]) >= sched.chunk_frames(st["chunk_idx"]))):
            if st["finished"]:  # ended with no frame left to deliver: EOS after the last chunk, or aborted
                self._stream_end(st)
                return None, True
            if pulled and self._owner.contended():
                return AGAIN, False
            for o in self._router.pull([rid], self._pump, self._talker.has_unfinished, max_steps=1)[rid]:
                if o.codes is not None and o.finish_reason != "abort":
                    st["pending"].append(o.codes)
                st["finished"], st["reason"] = st["finished"] or o.finished, o.finish_reason or ""
            if st["reason"] == "abort":
                st["pending"] = []
            pulled = True
        frame_start, finished = st["frame_start"], st["finished"]
        t = clock()
        codes = torch.stack(st["pending"]).numpy()
        rec.span("hop", rid, t, frame_index=frame_start, num_frames=len(codes))
        t = clock()
        audio = st["session"].push(codes)
        rec.span("code2wav_chunk", rid, t, frame_index=frame_start, num_frames=len(codes))
        self._take_spans(st["session"])
        t_ready = time.perf_counter() - st["info"]["t0"]
        chunk = AudioChunk(str(rid), audio, frame_start, frame_start + len(codes), codes, t_ready, is_last=finished)
        st.update(pending=[], frame_start=frame_start + len(codes), chunk_idx=st["chunk_idx"] + 1)
        rec.deliver(rid, chunk.frame_start, chunk.frame_end, len(audio))
        if finished:  # the request ends with its last delivery; the chunk carries its trace
            chunk.trace = rec.end(rid, st["reason"])
            self._stream_end(st)
        st["t"] = clock()
        return chunk, finished

    # ---- lifetime ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Abort every live request, free all stage state and end the owner thread. Idempotent. A generate()
        running in another thread raises ``InputError`` at its next step, a live stream() at its next iteration."""
        if self._closed:
            return
        self._closed = True
        try:
            self._owner.run_if_open(self._close_stages)
        finally:
            self._owner.stop()

    def restart(self) -> None:
        """New worker processes in place of this pipeline's (same deployment: CPUs, threads, environment) and a new
        vLLM engine, e.g. after a ``WorkerError`` (a dead or frozen worker); live requests are dropped, the eager
        talker and an in-process code2wav are kept (docs/reliability.md#worker-lifecycle)."""
        self._check_open()
        self._owner.run(self._restart_stages)

    def _restart_stages(self) -> None:
        self._close_stages()  # ends routed requests; closing again below is idempotent
        self._talker, self.code2wav = restart_stages(self._talker, getattr(self.code2wav, "_obj", self.code2wav))

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
