"""``TalkerCPUModelRunner``: vLLM's CPU model runner with the Qwen3-TTS talker hooks.

Contract (three vLLM runner methods overridden, each calling ``super()``; see docs/vllm-seam.md#runner-overrides):
- ``execute_model``: creates per-request state for ``scheduled_new_reqs`` from
  ``sampling_params.extra_args["omnilab"]`` (the prompt embeddings are built here, worker-side, by
  :func:`omnilab.models.prompt.build_prompt`) and drops state for ``finished_req_ids``.
- ``_preprocess``: writes every scheduled token's input vector into vLLM's ``inputs_embeds`` buffer by
  absolute position: prompt rows for positions < L, else the stored input of frame ``p - L`` (sum of the
  16 codebook embeddings + trailing text or ``tts_pad``). Chunked prefill and recompute after preemption
  therefore need nothing special. The c0 that vLLM feeds back in ``input_ids`` is checked against the
  frame history.
- ``_sample``: the talker sampler with the eager backend's semantics (``omnilab.sampling.talker_scores``:
  repetition penalty over generated c0 only, EOS masked below ``min_new_tokens``, ids >= 2048 except EOS
  suppressed; then HF warpers and one ``torch.Generator`` per request, drawn in the reference order).
  Rows that vLLM will discard (partial prefill chunks) draw nothing.
- ``sample_tokens``: after ``super()``, runs the frame recurrence (:func:`omnilab.models.frame.next_frames`,
  the one the eager engine calls: KV-cached code predictor batched over all rows that sampled a non-EOS
  c0, or row by row with ``predictor_per_row``) on their last hidden states, stores the frame and its
  next input vector, and returns one :mod:`~omnilab.stages.vllm.payload` record per row in
  ``ModelRunnerOutput.pooler_output``.
- State is freed when a request samples EOS or reaches its token limit, on ``finished_req_ids`` and on
  :meth:`release` (client aborts).
- A row whose talker logits are not finite (NaN/Inf in its prompt or in the weights) is *poisoned*: from then on
  it draws c0 = 0, skips the code predictor (whose sampler would raise on NaN and take the engine down), stores
  a zero frame and returns ``nonfinite`` records until the client aborts it (``VllmTalkerStage.step`` raises
  ``InputError`` for it); the other rows and the engine go on. One ``isfinite`` over the logits per step; on a
  poisoned row the KV cache is made finite (``_scrub_kv``), so its NaN keys/values never reach later requests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.v1.outputs import SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from omnilab.kernels import gemv_choice
from omnilab.models import frame
from omnilab.models.prompt import Prompt, build_prompt
from omnilab.sampling import SamplingParams, sample_rows, talker_scores
from omnilab.stages._env import env_flag
from omnilab.stages.vllm import payload as vllm_payload


@dataclass
class TtsState:
    """One request's talker state inside the worker (keyed by vLLM's internal request id)."""
    prompt: Prompt
    params: SamplingParams
    seed: int
    generator: torch.Generator
    max_tokens: int                                   # vLLM max_tokens (= max_new_tokens - 1)
    generated: list[int] = field(default_factory=list)        # sampled c0 tokens (penalty history)
    frames: list[torch.Tensor] = field(default_factory=list)  # [16] int64 per frame
    inputs: list[torch.Tensor] = field(default_factory=list)  # [H] talker input vector of frame k
    poisoned: bool = False                            # its logits were not finite once (see the module doc)

    @property
    def prompt_len(self) -> int:
        return self.prompt.embeds.shape[0]


def compile_mlps(module: torch.nn.Module) -> int:
    """Replace ``forward`` of every decoder-layer ``mlp`` under ``module`` by its torch.compile'd version
    (instance attribute: parameters and state_dict are untouched). Returns how many were compiled."""
    n = 0
    for layer in getattr(getattr(module, "model", None), "layers", []):
        mlp = layer.mlp
        if not hasattr(mlp, "_omnilab_eager_forward"):
            mlp._omnilab_eager_forward = mlp.forward
            mlp.forward = torch.compile(mlp.forward, dynamic=True)
            n += 1
    return n


def _env_flag(name: str) -> bool:
    return bool(env_flag(None, name))  # the client checked the value (config.engine_env); a bad word: ConfigError


class TalkerCPUModelRunner(CPUModelRunner):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tts_states: dict[str, TtsState] = {}
        self.predictor_per_row = _env_flag("OMNILAB_VLLM_PREDICTOR_PER_ROW")
        self.compile_predictor = _env_flag("OMNILAB_CPU_INDUCTOR")
        self._compiled = False
        self.return_hidden = False
        self.tts_step = 0
        self.tts_recomputed_frames = 0
        self.tts_resumed = 0           # requests resumed after a preemption (their KV is recomputed)
        self.tts_partial_prefills = 0  # prefill chunks that did not finish a prompt (chunked prefill)
        self._t_end: float | None = None
        self._t_exec0 = 0.0
        self._timing: dict[str, float] = {}
        self._prefill_rows: set[str] = set()
        self._scheduled_tokens = 0

    # ---- model access --------------------------------------------------------------------------------
    @property
    def talker(self):
        return self.model.talker

    @property
    def tts_config(self):
        return self.model.tts_config

    # ---- lifecycle -----------------------------------------------------------------------------------
    def _add_state(self, new_req) -> None:
        if new_req.req_id in self.tts_states:  # resumed request re-sent in full: keep its history
            return
        sp = new_req.sampling_params
        extra = (sp.extra_args or {}).get(vllm_payload.EXTRA_KEY) if sp is not None else None
        if extra is None:
            raise RuntimeError(f"request {new_req.req_id} carries no omnilab request data (extra_args)")
        req, params, seed = vllm_payload.extra_to_request(extra, self.talker.dtype)
        prompt = build_prompt(self.talker, self.tts_config, req)
        if len(new_req.prompt_token_ids) != len(prompt):
            raise RuntimeError(f"request {new_req.req_id}: placeholder prompt has {len(new_req.prompt_token_ids)} "
                               f"positions but the built prompt has {len(prompt)}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.tts_states[new_req.req_id] = TtsState(prompt, params, seed, gen, max_tokens=sp.max_tokens)

    def release(self, req_ids) -> int:
        """Free the state of ``req_ids`` (aborted by the client); returns how many were live."""
        return sum(self.tts_states.pop(r, None) is not None for r in req_ids)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        t0 = self._t_exec0 = time.perf_counter()
        engine_ms = 1e3 * (t0 - self._t_end) if self._t_end is not None else 0.0
        for rid in scheduler_output.finished_req_ids:
            self.tts_states.pop(rid, None)
        for new_req in scheduler_output.scheduled_new_reqs:
            self._add_state(new_req)
        self.tts_resumed += len(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        self._timing = {"engine_ms": engine_ms, "talker_ms": 0.0}
        self._scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        self._prefill_rows = {r for r, n in scheduler_output.num_scheduled_tokens.items() if n > 1}
        out = super().execute_model(scheduler_output, intermediate_tensors)
        total_ms = 1e3 * (time.perf_counter() - t0)
        self._timing["talker_ms"] += self.model.logits_ms
        self._timing["input_prep_ms"] = max(total_ms - self._timing["talker_ms"], 0.0)
        return out

    def _model_forward(self, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        try:
            return super()._model_forward(*args, **kwargs)
        finally:
            self._timing["talker_ms"] = self._timing.get("talker_ms", 0.0) + 1e3 * (time.perf_counter() - t0)

    # ---- inputs ----------------------------------------------------------------------------------------
    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        _ids, _emb, positions, it, model_kwargs, ec = super()._preprocess(
            scheduler_output, num_input_tokens, intermediate_tensors)
        n = scheduler_output.total_num_scheduled_tokens
        num_reqs = self.input_batch.num_reqs
        qsl = self.query_start_loc.np[: num_reqs + 1].tolist()
        pos = self.positions[:n].tolist()
        ids = self.input_ids.cpu[:n].tolist()
        buf = self.inputs_embeds.gpu
        for i, rid in enumerate(self.input_batch.req_ids[:num_reqs]):
            s, e = qsl[i], qsl[i + 1]
            if e <= s:
                continue
            st = self.tts_states[rid]
            p0, p1, lp = pos[s], pos[e - 1] + 1, st.prompt_len
            if p1 - p0 != e - s:
                raise RuntimeError(f"request {rid}: non-contiguous positions {p0}..{p1} for {e - s} tokens")
            if p0 < lp:  # prompt rows
                a = min(p1, lp)
                buf[s:s + a - p0] = st.prompt.embeds[p0:a]
            if p1 > lp:  # decode rows: input vector of frame p - L
                k0, k1 = max(p0, lp) - lp, p1 - lp
                if k1 > len(st.inputs):
                    raise RuntimeError(f"request {rid}: position {p1 - 1} needs frame {k1 - 1} but only "
                                       f"{len(st.inputs)} exist")
                off = s + max(p0, lp) - p0
                for k in range(k0, k1):
                    if ids[off + k - k0] != int(st.frames[k][0]):
                        raise RuntimeError(f"request {rid}: vLLM fed c0={ids[off + k - k0]} at position "
                                           f"{lp + k} but frame {k} has c0={int(st.frames[k][0])}")
                buf[off:off + k1 - k0] = torch.stack(st.inputs[k0:k1]) if k1 - k0 > 1 else st.inputs[k0][None]
                if k0 < len(st.inputs) - 1:
                    self.tts_recomputed_frames += k1 - 1 - k0  # older frames run again (after preemption)
        return None, buf[:num_input_tokens], positions, it, model_kwargs, ec

    # ---- sampling ------------------------------------------------------------------------------------------
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None:
            raise RuntimeError("speculative decoding is not supported by the omnilab talker")
        t0 = time.perf_counter()
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        discard = self.discard_request_mask.np[:num_reqs]
        tokens = torch.zeros(num_reqs, 1, dtype=torch.int32)
        rows = [i for i in range(num_reqs) if not discard[i]]
        self.tts_partial_prefills += num_reqs - len(rows)
        if rows:
            states = [self.tts_states[req_ids[i]] for i in rows]
            sub = logits if len(rows) == num_reqs else logits[rows]
            bad = ~torch.isfinite(sub).all(dim=-1)
            if bool(bad.any()):  # poisoned rows: a finite stand-in so sampling cannot raise, then c0 = 0
                sub = torch.where(bad[:, None], torch.zeros((), dtype=sub.dtype), sub)
                for j in bad.nonzero().flatten().tolist():
                    states[j].poisoned = True
                self._scrub_kv()
            eos = self.tts_config.talker.codec_eos_token_id
            scores = talker_scores(sub, [s.generated for s in states], [s.params for s in states], eos)
            toks = sample_rows(scores, [s.params.talker_warp for s in states], [s.generator for s in states])
            toks[torch.tensor([s.poisoned for s in states])] = 0
            tokens[rows, 0] = toks.to(torch.int32)
        self._timing["sampling_ms"] = 1e3 * (time.perf_counter() - t0)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        if state is None:
            return super().sample_tokens(grammar_output)
        hidden = state.sample_hidden_states  # [num_reqs, H], read before super() clears it
        out = super().sample_tokens(grammar_output)
        self.tts_step += 1
        eos = self.tts_config.talker.codec_eos_token_id
        payload: list[torch.Tensor | None] = [None] * len(out.req_ids)
        frame_rows: list[int] = []
        done: list[str] = []
        for i, rid in enumerate(out.req_ids):
            toks = out.sampled_token_ids[i] if i < len(out.sampled_token_ids) else []
            if not toks:
                continue
            st = self.tts_states[rid]
            st.generated.append(int(toks[0]))
            if st.poisoned:  # a zero frame keeps the history consistent until the client aborts it
                st.frames.append(torch.zeros(16, dtype=torch.long))
                st.inputs.append(torch.zeros(hidden.shape[-1], dtype=hidden.dtype))
            elif toks[0] == eos:
                done.append(rid)
            else:
                frame_rows.append(i)
        self._predict(hidden, out, frame_rows)  # frame + next input vector per row
        want_hidden = self.return_hidden
        # whole worker cycle of this step: idle gap before it + execute_model + sample_tokens
        self._timing["cycle_ms"] = self._timing["engine_ms"] + 1e3 * (time.perf_counter() - self._t_exec0)
        # the step's window on this process's perf_counter (the host's CLOCK_MONOTONIC): the client places the
        # phases there, not where it happened to receive them
        self._timing["worker_start_s"], self._timing["worker_end_s"] = self._t_exec0, time.perf_counter()
        for i, rid in enumerate(out.req_ids):
            if not (out.sampled_token_ids[i] if i < len(out.sampled_token_ids) else []):
                continue
            st = self.tts_states[rid]
            timings = dict(self._timing, prefill_ms=self._timing["talker_ms"] if rid in self._prefill_rows else 0.0)
            if st.poisoned:
                payload[i] = vllm_payload.encode(len(st.frames) - 1, None, timings, len(frame_rows),
                                                 self._scheduled_tokens, self.tts_step, nonfinite=True)
                if len(st.generated) >= st.max_tokens:
                    done.append(rid)
            elif i in frame_rows:
                k = len(st.frames) - 1
                payload[i] = vllm_payload.encode(k, st.frames[k], timings, len(frame_rows), self._scheduled_tokens,
                                                 self.tts_step, hidden[i] if want_hidden else None)
                if len(st.generated) >= st.max_tokens:
                    done.append(rid)
            else:
                payload[i] = vllm_payload.encode(len(st.frames), None, timings, len(frame_rows),
                                                 self._scheduled_tokens, self.tts_step)
        for rid in done:
            self.tts_states.pop(rid, None)
        out.pooler_output = payload
        self._t_end = time.perf_counter()
        return out

    def _scrub_kv(self) -> None:
        """A poisoned row wrote NaN/Inf keys and values; freed blocks go to later requests, whose attention reads
        stale slots with weight 0 (0 x NaN is NaN), so every KV cache tensor is made finite in place (rare)."""
        for t in getattr(self, "kv_caches", None) or []:
            if isinstance(t, torch.Tensor):
                torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)

    def _compile_predictor(self) -> None:
        """torch.compile (inductor) the code predictor's SwiGLU MLPs (60 % of its weights), once
        (``OMNILAB_CPU_INDUCTOR=1``). Whole layers are not compiled: their KV-cache object makes dynamo
        recompile for every cache length and give up after 8 graphs. Dynamic shapes cover batch sizes."""
        self._compiled = True
        compile_mlps(self.talker.code_predictor)

    def _predict(self, hidden: torch.Tensor, out, rows: list[int]) -> None:
        """Frame k of each row in ``rows`` (sampled a non-EOS c0) and its next talker input vector, appended
        to the row's state (:func:`omnilab.models.frame.next_frames`: batched, or row by row)."""
        if not rows:
            self._timing["predictor_ms"] = 0.0
            return
        if self.compile_predictor and not self._compiled:
            self._compile_predictor()
        states = [self.tts_states[out.req_ids[i]] for i in rows]
        c0 = torch.tensor([s.generated[-1] for s in states], dtype=torch.long)
        fs = frame.next_frames(self.talker, hidden[rows], c0, [s.prompt for s in states],
                               [len(s.frames) for s in states], [s.params for s in states],
                               [s.generator for s in states], per_row=self.predictor_per_row)
        for j, st in enumerate(states):
            st.frames.append(fs.codes[j].clone())
            st.inputs.append(fs.inputs[j].clone())
        self._timing["predictor_ms"] = fs.predictor_ms
        self._timing["sampling_ms"] = self._timing.get("sampling_ms", 0.0) + fs.sampling_ms

    # ---- introspection (worker RPCs) ------------------------------------------------------------------------
    def tts_summary(self) -> dict[str, Any]:
        return {"states": sorted(self.tts_states), "vllm_requests": sorted(self.requests),
                "step": self.tts_step, "recomputed_frames": self.tts_recomputed_frames,
                "resumed": self.tts_resumed, "partial_prefills": self.tts_partial_prefills,
                "predictor_per_row": self.predictor_per_row, "compile_predictor": self.compile_predictor,
                "gemv": gemv_choice().label, "weights": self._weights_label(),
                "quantization": getattr(getattr(self.talker, "quantization", None), "label", "none")}

    def _weights_label(self) -> str:
        storage = getattr(self.talker, "weight_storage", None)
        return storage.label if storage is not None else "unknown (talker built without omnilab's loaders)"
