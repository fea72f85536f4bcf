"""The talker as a vLLM model: omnilab's decoder layers with vLLM's paged attention and KV cache.

Contract:
- ``OmnilabTalkerForVLLM`` (architecture ``OmnilabQwen3TTSTalker``) owns an omnilab :class:`Talker`
  (text/codec embeddings, decoder layers, codec head and the code predictor, parameter names equal to
  the released ``talker.*`` tensors) plus one vLLM ``Attention`` per layer. The forward is the omnilab
  decoder op for op (RMSNorm, q/k norm, rotate-half RoPE from the same fp32 tables, SwiGLU); only the
  attention core runs in vLLM's CPU attention backend on the paged KV cache that vLLM's scheduler
  manages. Inputs are always ``inputs_embeds`` (the runner builds them); ``input_ids`` are placeholders.
- vLLM's CPU attention supports head sizes 32, 64, ...; a smaller head (the tiny test geometry, 16) is
  zero-padded to 32 with the softmax scale of the true head size, which leaves the result unchanged.
- Weights: the ``"omnilab"`` load format (:class:`OmnilabModelLoader`) fills the talker from the
  checkpoint (:func:`omnilab.checkpoint.worker_weights.load_talker_weights`: strict, no mmap, bf16 text table),
  or, in-process, reuses a talker already loaded in this process (:func:`share_talker`), so the weights
  are never held twice. Quantization: the client's ``Quantization.key()`` arrives as ``omnilab_quantization``
  in the view config (``hf_overrides``); a worker quantizes at load the same way (same loader, same values).
- ``hf_config`` is a Qwen3 text config written by :mod:`omnilab.stages.vllm.view` carrying the released
  ``config.json`` as ``omnilab_tts_config`` and the checkpoint path as ``omnilab_checkpoint``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from omnilab.checkpoint.load import meta_init
from omnilab.config import Qwen3TTSConfig
from omnilab.kernels import gemv_choice
from omnilab.kernels.qgemv import qgemv_choice
from omnilab.kernels.quant import from_key
from omnilab.kernels.norm import rms_norm
from omnilab.models.decode_step import StackStep
from omnilab.models.talker import Talker
from omnilab.stages.vllm.config import padded_head_size
from omnilab.stages.vllm.tensor_parallel import all_reduce, check_shardable, rank_info, shard_talker
from omnilab.stages.vllm.view import ARCH
from omnilab.checkpoint.worker_weights import load_talker_weights, release_memory

LOAD_FORMAT = "omnilab"

# In-process weight sharing: key -> Talker already loaded in this process (see share_talker).
_SHARED: dict[str, Talker] = {}


def share_talker(talker: Talker) -> str:
    """Make ``talker`` available to an in-process engine of this process; returns the key to put in
    the view config (``omnilab_share_key``). A spawned worker never finds it and loads from disk."""
    key = f"{os.getpid()}:{id(talker)}"
    _SHARED[key] = talker
    return key


def unshare_talker(key: str | None) -> None:
    if key:
        _SHARED.pop(key, None)


@support_torch_compile(dynamic_arg_dims={"positions": -1, "inputs_embeds": 0})
class PagedTalkerStack(nn.Module):
    """The talker decoder over vLLM's paged KV cache: owns the omnilab :class:`Talker` and one vLLM
    ``Attention`` per layer. Decorated for vLLM's torch.compile path (``enforce_eager=False``), which then
    traces this forward once with dynamic token counts (inputs are always ``inputs_embeds``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()

        hf = vllm_config.model_config.hf_config
        self.tts_config = Qwen3TTSConfig.from_dict(dict(hf.omnilab_tts_config))
        tc = self.tts_config.talker
        with meta_init():  # parameters arrive from the loader (no allocation, no random init here)
            self.talker = Talker(self.tts_config)
        self.head_dim = tc.head_dim
        self.attn_head_dim = padded_head_size(tc.head_dim)
        self.tp_rank, self.tp_size = rank_info()  # a tensor-parallel rank holds its heads only (tensor_parallel.py)
        check_shardable(tc, self.tp_size, _quant_from(hf))
        base = f"{prefix}." if prefix else ""
        self.attn = nn.ModuleList(
            Attention(tc.num_attention_heads // self.tp_size, self.attn_head_dim, tc.head_dim ** -0.5,
                      num_kv_heads=tc.num_key_value_heads // self.tp_size, cache_config=vllm_config.cache_config,
                      prefix=f"{base}attn.{i}")
            for i in range(tc.num_hidden_layers))
        self.max_positions = vllm_config.model_config.max_model_len
        self.rope_cos = self.rope_sin = None

    def prepare_rope(self, dtype: torch.dtype) -> None:
        """Cos/sin rows for every position the engine can schedule (the same fp32-built, cast tables that
        ``RopeTable.get`` indexes, so lookups are bitwise identical)."""
        cos, sin = self.talker.rope.span(0, self.max_positions, dtype, signed=True)
        self.rope_cos, self.rope_sin = cos[0], sin[0]  # [P, D]; sin with its first half negated (RopeTable)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds  # [N, H]
        n = x.shape[0]
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]  # [N, 1, D]
        d, dp = self.head_dim, self.attn_head_dim
        for layer, attn in zip(self.talker.model.layers, self.attn):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            hq, hkv = a.num_heads, a.num_kv_heads
            mods = (a.q_proj, a.k_proj, a.v_proj)
            qkv = a._qkv.output(h, mods)  # [N, (Hq + 2 Hkv) D] from one fused kernel call at decode, or None
            if qkv is not None:
                qk, v = qkv[:, :(hq + hkv) * d].view(n, hq + hkv, d), qkv[:, (hq + hkv) * d:].view(n, -1, d)
            else:
                q, k, v = a.project(h)
                qk, v = torch.cat([q.view(n, hq, d), k.view(n, hkv, d)], dim=1), v.view(n, -1, d)
            # q and k heads normalised and rotated together, as the eager decoder does (bitwise rotate-half:
            # roll(x, D/2) * signed sin == rotate_half(x) * sin, omnilab.models.decoder.RopeTable)
            qk = rms_norm(qk, a._qk_weight(), a.q_norm.eps)  # [N, Hq + Hkv, D]
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            if dp != d:
                pad = (0, dp - d)
                q, k, v = (nn.functional.pad(t, pad) for t in (q, k, v))
            o = attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))  # [N, Hq * Dp]
            if dp != d:
                o = o.view(n, -1, dp)[..., :d]
            y = a.o_proj(o.reshape(n, -1))
            x = x + (y if self.tp_size == 1 else all_reduce(y))  # row parallel: the ranks' partial sums added
            y = layer.mlp(layer.post_attention_layernorm(x))
            x = x + (y if self.tp_size == 1 else all_reduce(y))
        return self.talker.model.norm(x)


class OmnilabTalkerForVLLM(nn.Module):
    """vLLM text-generation model over codec ids (vocab 3072); see the module docstring."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.checkpoint = str(hf.omnilab_checkpoint)
        self.share_key = getattr(hf, "omnilab_share_key", None)
        self.quant_key = getattr(hf, "omnilab_quantization", None)  # Quantization.key() of the client, or None
        self.quantization = _quant_from(hf)
        self.dtype = vllm_config.model_config.dtype
        self.stack = PagedTalkerStack(vllm_config=vllm_config, prefix=f"{prefix}.stack" if prefix else "stack")
        self.tts_config = self.stack.tts_config
        self.logits_ms = 0.0
        self.paged_step = StackStep()  # decode-only steps: the one-call stack over vLLM's paged caches
        self.paged_steps = 0           # forwards that took it (the rest ran vLLM's attention layers)
        self._caches_checked: tuple | None = None  # the KV cache tensors _paged_caches last accepted
        if self.dtype == torch.bfloat16:
            vec_kv_layout()

    @property
    def talker(self) -> Talker:
        return self.stack.talker

    # ---- vLLM model interface ----------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Codec-table rows (only used by vLLM's dummy/warm-up runs: the runner supplies embeddings)."""
        return self.talker.model.codec_embedding(input_ids.clamp(0, self.tts_config.talker.vocab_size - 1))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """``inputs_embeds`` [N, H] (flattened tokens of all scheduled requests) -> final-norm hidden [N, H]."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        positions = positions.reshape(-1).long()
        out = self._paged_decode(inputs_embeds, positions)
        if out is not None:
            self.paged_steps += 1
            return out
        return self.stack(None, positions, None, inputs_embeds)

    def _paged_decode(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A decode-only step (one token per request) through omnilab's one-call stack over vLLM's paged caches
        (``StackStep.paged``: the eager talker's kernels, ``attn.cpp``'s paged attention), or None where it does not
        apply (a prefill in the batch, no forward context, a cache layout other than "vec" of the talker's dtype, a
        geometry or dtype the kernels do not take): then vLLM's attention layers run."""
        st = self.stack
        if st.tp_size > 1:  # the one-call stack has no all-reduce between layers: vLLM's attention layers run
            return None
        try:
            md_all = get_forward_context().attn_metadata
        except (AssertionError, RuntimeError):  # no forward context (dummy runs outside one)
            return None
        if not isinstance(md_all, dict):
            return None
        md = md_all.get(st.attn[0].layer_name)
        if (md is None or getattr(md, "max_query_len", None) != 1 or getattr(md, "num_actual_tokens", -1) != x.shape[0]
                or not getattr(md, "causal", False) or getattr(md, "dynamic_causal", None) is not None
                or any(md_all.get(a.layer_name) is not md for a in st.attn)):
            return None
        caches = self._paged_caches()
        if caches is None:
            return None
        return self.paged_step.paged(st.talker.model.layers, st.talker.model.norm, x, st.rope_cos[positions],
                                     st.rope_sin[positions], caches, md.block_table, positions.tolist())

    def _paged_caches(self) -> list[torch.Tensor] | None:
        """Every layer's bound KV cache tensor when all are [blocks, Hkv, bs, 2 Dp] of the talker's dtype (fp32 or
        bf16) in vLLM's "vec" layout (what ``omnilab_paged_attn`` reads), else None."""
        st = self.stack
        caches = [a.kv_cache for a in st.attn]
        held = self._caches_checked
        if held is not None and len(held) == len(caches) and all(a is b for a, b in zip(held, caches)):
            return caches  # the tensors vLLM bound at start: checked once
        c0 = caches[0]
        if (c0.dim() != 4 or c0.dtype != self.dtype or c0.shape[1] != st.tts_config.talker.num_key_value_heads
                or c0.shape[3] != 2 * st.attn_head_dim or c0.shape[2] % 16
                or any(getattr(a, "isa", None) != "vec" for a in st.attn)
                or any(c.shape != c0.shape or c.dtype != c0.dtype or not c.is_contiguous() for c in caches)):
            return None
        self._caches_checked = tuple(caches)
        return caches

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.talker.codec_head(hidden_states)
        self.logits_ms = 1e3 * (time.perf_counter() - t0)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Default-loader path (``load_format="safetensors"``): released ``talker.*`` names."""
        state = {}
        for name, tensor in weights:
            if name.startswith("talker."):
                t = tensor.to(self.dtype) if tensor.is_floating_point() else tensor
                state[name[len("talker."):]] = t
        self.talker.load_state_dict(state, strict=True, assign=True)
        self.talker.requires_grad_(False).eval()
        shard_talker(self.talker, self.stack.tp_rank, self.stack.tp_size)
        self.stack.prepare_rope(self.dtype)
        gemv_choice()  # resolve (and build) the decode-linear kernel at load, not in the first step
        return {n for n, _ in self.named_parameters()}

    # ---- omnilab loading ---------------------------------------------------------------------------
    def load_talker(self) -> str:
        """Fill ``self.talker``: the in-process shared talker when available, else from the checkpoint.
        Returns ``"shared"`` or ``"disk"``."""
        shared = _SHARED.get(self.share_key) if self.share_key else None
        quant = self.quantization  # the client's choice (view config)
        same = shared is not None and shared.dtype == self.dtype and _quant_key(shared) == (self.quant_key or None)
        source = "shared" if same and self.stack.tp_size == 1 else "disk"
        self.stack.talker = shared if source == "shared" else \
            load_talker_weights(self.checkpoint, self.tts_config, self.dtype, quantization=quant)
        if source == "disk":
            shard_talker(self.stack.talker, self.stack.tp_rank, self.stack.tp_size)
            release_memory()  # the file's bf16 copies read while casting, the other ranks' slices
        self.stack.prepare_rope(self.dtype)
        gemv_choice()
        if quant is not None and quant.enabled:
            qgemv_choice()  # resolve (and build) the quantized kernel at load, not in the first step
        return source


def vec_kv_layout() -> None:
    """Have vLLM's CPU attention lay out this process's KV caches in its "vec" form where it would pick "amx" (bf16
    on AMX CPUs; elsewhere "vec" is its choice already): the layout omnilab's paged decode step reads, so a bf16
    talker's decode steps run the one-call stack as fp32 ones do (measured on the AMX Xeon at int4: vLLM bf16 94.6
    ms per step on vLLM's attention layers against eager bf16's 57.1). vLLM's own attention reads and writes "vec"
    caches in bf16 too (the layout of CPUs without AMX); it runs the prefills. Idempotent; only the model's worker
    process calls it (the engine there serves this one model)."""
    from vllm.v1.attention.backends import cpu_attn

    inner = cpu_attn._get_attn_isa
    if getattr(inner, "omnilab_vec", False):
        return

    def isa(*args: Any, **kwargs: Any) -> str:
        got = inner(*args, **kwargs)
        return "vec" if got == "amx" else got
    isa.omnilab_vec = True
    cpu_attn._get_attn_isa = isa


def _quant_from(hf: Any) -> Any:
    """The client's quantization choice the view config carries (``omnilab_quantization``), or None."""
    key = getattr(hf, "omnilab_quantization", None)
    return from_key(key) if key else None


def _quant_key(talker: Talker) -> str | None:
    q = getattr(talker, "quantization", None)
    return q.key() if q is not None and q.enabled else None


@register_model_loader(LOAD_FORMAT)
class OmnilabModelLoader(BaseModelLoader):
    """``load_format="omnilab"``: weights come from omnilab's strict checkpoint loader."""

    def download_model(self, model_config) -> None:  # local directories only
        pass

    def load_weights(self, model: nn.Module, model_config) -> None:
        if not isinstance(model, OmnilabTalkerForVLLM):
            raise TypeError(f"load_format {LOAD_FORMAT!r} only loads {ARCH}, not {type(model).__name__}")
        model.load_talker()
