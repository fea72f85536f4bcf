"""The eager talker stage (plain torch, in this process): prompts in, one 16-code frame per live request per step.

``EagerTalkerStage`` (the stage contract of :mod:`omnilab.stages.base`) builds the prompt embeddings from the
request data, the way the vLLM worker builds them worker-side, and drives ``EagerTalkerEngine``:
Contract (docs/model.md#talker-step, reference semantics):
- A request added with :meth:`EagerTalkerEngine.add_request` is prefilled in its next step: talker over the
  prompt -> hidden ``h`` -> sample c0 of frame 0. Every step then, for every live request k-th frame:
  :func:`omnilab.models.frame.next_frames` (code predictor on ``(h, C(c0))`` -> c1..c15 -> frame k; input
  vector ``embed_frame(frame k) + trailing[k]``, ``tts_pad`` once the queue is used up; the recurrence the
  vLLM runner calls too) -> talker decode -> new ``h`` -> sample the next c0. The code predictor runs
  batched over all live rows; the talker decode is batched too, each row attending only to its own KV
  cache (``batched=False`` runs rows one by one: bitwise independent of batch mates, since a Linear over
  1 row rounds differently from one over several).
- Stop rules: sampled c0 == codec EOS -> ``finish_reason="eos"``, reported on the last real frame.
  ``max_new_tokens`` counts talker tokens as HF ``generate`` does: the last token's frame is never
  produced, so a length-limited request yields ``max_new_tokens - 1`` frames (``"length"``, reported on
  the last frame; the useless final talker forward is skipped). ``codes`` is None only when a request
  ends without a frame (EOS or length at the prefill, or :meth:`abort`).
- Each request has one ``torch.Generator`` seeded from ``params.seed`` (None -> a random seed, reported
  in every output). It is drawn in the reference order (talker, then 15 sub-talker draws, then talker...),
  so a batch-1 request reproduces the official package run after ``torch.manual_seed(seed)``.
- Per-request state (KV cache, generator) is freed when the request finishes or is aborted.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Hashable

import torch

from omnilab.checkpoint.load import LoadedModel
from omnilab.config import Qwen3TTSConfig
from omnilab.errors import InputError
from omnilab.models import frame
from omnilab.models.decoder import KVCache
from omnilab.models.prompt import Prompt, PromptRequest, build_prompt
from omnilab.models.talker import Talker
from omnilab.sampling import SamplingParams, sample_rows, talker_scores
from omnilab.stages.base import DEFAULT_MAX_NEW_TOKENS_LIMIT, FrameOutput

@dataclass
class _Request:
    request_id: Hashable
    prompt: Prompt
    params: SamplingParams
    seed: int
    generator: torch.Generator
    cache: KVCache | None = None
    h: torch.Tensor | None = None            # [H]
    generated: list[int] = field(default_factory=list)  # c0 tokens so far (repetition-penalty history)

    @property
    def frame_index(self) -> int:           # frame of the newest token
        return len(self.generated) - 1


class EagerTalkerEngine:
    def __init__(self, talker: Talker, cfg: Qwen3TTSConfig, *, batched: bool = True,
                 max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT, cache_block_frames: int = 128):
        self.talker = talker.eval()
        self.cfg = cfg
        self.batched = batched
        self.max_new_tokens_limit = max_new_tokens_limit
        self.cache_block_frames = cache_block_frames
        self.eos_id = cfg.talker.codec_eos_token_id
        self._waiting: dict[Hashable, _Request] = {}
        self._live: dict[Hashable, _Request] = {}

    # ---- request management ----------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt: Prompt, params: SamplingParams) -> int:
        """Queue a request; it is prefilled in the next :meth:`step`. Returns the seed in use."""
        if request_id in self._waiting or request_id in self._live:
            raise InputError(f"request_id {request_id!r} is already running")
        room = self.cfg.talker.max_position_embeddings - len(prompt)
        if room < 1:
            raise InputError(f"prompt of {len(prompt)} positions leaves no room under max_position_embeddings "
                             f"{self.cfg.talker.max_position_embeddings}")
        params.validate(min(self.max_new_tokens_limit, room))
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        gen = torch.Generator(device=prompt.embeds.device)
        gen.manual_seed(seed)
        self._waiting[request_id] = _Request(request_id, prompt, params, seed, gen)
        return seed

    def abort(self, request_id: Hashable) -> FrameOutput | None:
        """Drop a queued or running request and free its state. None if the id is unknown."""
        r = self._waiting.pop(request_id, None) or self._live.pop(request_id, None)
        if r is None:
            return None
        out = FrameOutput(request_id, max(len(r.generated) - 1, 0), None, True, "abort", r.seed)
        r.cache = r.h = None
        return out

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._live)

    @property
    def num_live(self) -> int:
        """Requests being decoded or waiting for their prefill."""
        return len(self._waiting) + len(self._live)

    @property
    def kv_bytes(self) -> int:
        return sum(r.cache.nbytes for r in self._live.values() if r.cache is not None)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, return_hidden: bool = False) -> list[FrameOutput]:
        """Advance every request by one frame; returns one :class:`FrameOutput` per request touched."""
        outs: list[FrameOutput] = []
        prefill_ms: dict[Hashable, float] = {}
        sampling_ms = 0.0
        for rid in list(self._waiting):
            r = self._waiting.pop(rid)
            t0 = time.perf_counter()
            done, s_ms = self._prefill(r)
            prefill_ms[rid] = 1e3 * (time.perf_counter() - t0)
            sampling_ms += s_ms
            if done is not None:
                outs.append(FrameOutput(rid, 0, None, True, done, r.seed, prefill_ms=prefill_ms[rid]))
            else:
                self._live[rid] = r
        rows = list(self._live.values())
        if not rows:
            return outs
        t = self.talker

        # 1.-2. frame k of each row (code predictor, batched over every live row or row by row) and the input
        # vectors of the rows whose next token can still become a frame (omnilab.models.frame)
        h = torch.stack([r.h for r in rows])  # [B, H]
        c0 = torch.tensor([r.generated[-1] for r in rows], dtype=torch.long, device=h.device)
        cont = [i for i, r in enumerate(rows) if len(r.generated) + 1 < r.params.max_new_tokens]
        fs = frame.next_frames(t, h, c0, [r.prompt for r in rows], [r.frame_index for r in rows],
                               [r.params for r in rows], [r.generator for r in rows], per_row=not self.batched,
                               need_input=[i in cont for i in range(len(rows))])
        frames = fs.codes  # [B, 16]
        emb = fs.inputs[:, None]  # [b, 1, H]
        predictor_ms, input_ms = fs.predictor_ms, fs.input_ms
        sampling_ms += fs.sampling_ms

        # 3. talker decode + next c0
        talker_ms = 0.0
        reasons: dict[int, str] = {i: "length" for i in range(len(rows)) if i not in set(cont)}
        new_h: dict[int, torch.Tensor] = {}
        new_tok: dict[int, int] = {}
        if cont:
            t0 = time.perf_counter()
            if self.batched:
                hid = t(emb, [rows[i].cache for i in cont])[:, 0]  # [b, H]
                logits = t.logits(hid)
            else:
                hid = torch.cat([t(emb[j:j + 1], [rows[i].cache])[:, 0] for j, i in enumerate(cont)])
                logits = torch.cat([t.logits(hid[j:j + 1]) for j in range(len(cont))])
            talker_ms = 1e3 * (time.perf_counter() - t0)
            t0 = time.perf_counter()
            toks = self._sample_talker([rows[i] for i in cont], logits)
            sampling_ms += 1e3 * (time.perf_counter() - t0)
            for j, i in enumerate(cont):
                new_h[i], new_tok[i] = hid[j], toks[j]
                if toks[j] == self.eos_id:
                    reasons[i] = "eos"

        for i, r in enumerate(rows):
            reason = reasons.get(i)
            outs.append(FrameOutput(
                r.request_id, r.frame_index, frames[i].clone(), reason is not None, reason, r.seed,
                hidden=r.h.clone() if return_hidden else None, prefill_ms=prefill_ms.get(r.request_id, 0.0),
                input_prep_ms=input_ms, talker_ms=talker_ms, predictor_ms=predictor_ms, sampling_ms=sampling_ms))
            if reason is not None:
                del self._live[r.request_id]
                r.cache = r.h = None
            else:
                r.h = new_h[i]
                r.generated.append(new_tok[i])
        return outs

    # ---- internals -------------------------------------------------------------------------------
    def _prefill(self, r: _Request) -> tuple[str | None, float]:
        """Run the prompt; sample token 0. Returns (finish reason or None, sampling ms)."""
        if r.params.max_new_tokens <= 1:  # token 0 would be the last one: it never becomes a frame
            return "length", 0.0
        embeds = r.prompt.embeds
        n = len(r.prompt) + min(r.params.max_new_tokens, self.cache_block_frames)
        r.cache = self.talker.new_cache(n)
        hidden = self.talker(embeds[None], [r.cache])[0]  # [L, H]
        logits = self.talker.logits(hidden)  # all L rows, as the reference computes them
        r.h = hidden[-1]
        t0 = time.perf_counter()
        tok = int(self._sample_talker([r], logits[-1:])[0])
        s_ms = 1e3 * (time.perf_counter() - t0)
        if tok == self.eos_id:
            r.cache = r.h = None
            return "eos", s_ms
        r.generated.append(tok)
        return None, s_ms

    def _sample_talker(self, rows: list[_Request], logits: torch.Tensor) -> list[int]:
        scores = talker_scores(logits, [r.generated for r in rows], [r.params for r in rows], self.eos_id)
        toks = sample_rows(scores, [r.params.talker_warp for r in rows], [r.generator for r in rows])
        return toks.tolist()


def run_to_completion(engine: EagerTalkerEngine, return_hidden: bool = False) -> dict[Hashable, dict]:
    """Step until every request finishes; returns ``{request_id: {"codes": [T, 16], "finish_reason",
    "seed", "hidden": [T, H] | None}}``. A convenience for tests and notebooks."""
    acc: dict[Hashable, dict] = {}
    while engine.has_unfinished():
        for o in engine.step(return_hidden=return_hidden):
            a = acc.setdefault(o.request_id, {"codes": [], "hidden": [], "seed": o.seed})
            if o.codes is not None:
                a["codes"].append(o.codes)
                if o.hidden is not None:
                    a["hidden"].append(o.hidden)
            if o.finished:
                a["finish_reason"] = o.finish_reason
    for a in acc.values():
        a["codes"] = torch.stack(a["codes"]) if a["codes"] else torch.empty(0, 16, dtype=torch.long)
        a["hidden"] = torch.stack(a["hidden"]) if a["hidden"] else None
    return acc


class EagerTalkerStage:
    backend = "eager"

    def __init__(self, model: LoadedModel, *, batched: bool = True):
        self.model = model
        limit = int(model.generation.max_new_tokens) if model.generation.max_new_tokens else 0
        self.engine = EagerTalkerEngine(model.talker, model.config, batched=batched,
                                        max_new_tokens_limit=max(limit, DEFAULT_MAX_NEW_TOKENS_LIMIT))

    @property
    def max_new_tokens_limit(self) -> int:
        return self.engine.max_new_tokens_limit

    def add_request(self, request_id: Hashable, req: PromptRequest, params: SamplingParams) -> int:
        """Queue a request (prefilled on the next step). Returns the seed in use."""
        prompt = build_prompt(self.model.talker, self.model.config, req)
        return self.engine.add_request(request_id, prompt, params)

    def step(self, return_hidden: bool = False) -> list[FrameOutput]:
        return self.engine.step(return_hidden=return_hidden)

    def abort(self, request_id: Hashable) -> FrameOutput | None:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def num_live(self) -> int:
        return self.engine.num_live

    def processes(self) -> dict[int, str]:
        return {}  # runs in this process

    def take_spans(self) -> list:
        return []

    def summary(self) -> dict:
        import os
        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(), "live": self.engine.num_live}

    def close(self) -> None:
        for rid in list(self.engine._waiting) + list(self.engine._live):
            self.engine.abort(rid)
