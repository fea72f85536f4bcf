"""A decoder layer's one-token step as a short list of direct kernel calls (the decode hot path).

Why: at one token per row a layer is ~8 kernel calls (two RMSNorms, the fused q/k/v and gate/up reads, the
one-token attention, o_proj, down_proj) around a few elementwise ops, but going there through the general
dispatch (``kernels.linear``, module attributes, the checks each function makes) costs ~250 Python calls per layer,
~200 us on 2 shared cores: more than the int4 kernels themselves (0.6B predictor layer: 443 us per layer, 218 us
in the kernels). :class:`DecodeStep` resolves the calls once per set of weights and then makes them directly.

Numerics: the same kernels with the same arguments as the general path (``gemv.cpp``'s bf16-weight GEMV or
``qgemv.cpp`` with the weight's activation mode, ``norm.cpp``, ``attn.cpp``) and the same torch ops between them, so
the result is bitwise the general path's (tests/models/test_decode_step.py). It applies where every piece is one
of omnilab's kernels: fp32 rows, no autograd, no torch.compile, bias-free matrices stored in bf16 or quantized,
the fused projections on (``OMNILAB_FUSE_PROJECTIONS``) and the RMSNorm / attention / GEMV kernels in use; anything
else takes the general path. ``OMNILAB_DECODE_STEP=auto|off`` (``off``: the general path, to time both side by side).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from omnilab.kernels import attention as attn_k
from omnilab.kernels import fuse, gemv, norm as norm_k, qgemv
from omnilab.errors import ConfigError
from omnilab.kernels.quant import AUTO_ACTIVATIONS, QuantizedWeight

ENV = "OMNILAB_DECODE_STEP"
MODES = ("auto", "off")


def enabled() -> bool:
    raw = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={os.environ.get(ENV)!r} is not a mode; accepted: {', '.join(MODES)}")
    return raw == "auto"


def _matmul(w: Any, glib: Any, qlib: Any):
    """``call(x_ptr, y_ptr, rows, threads)``: the kernel :func:`omnilab.kernels.linear` would use on ``w`` (fp32 rows,
    no bias) through that kernel's own ``launch``, or None where it is not one of omnilab's kernels."""
    if isinstance(w, QuantizedWeight):
        if qlib is None:
            return None
        act8 = (w.activations or AUTO_ACTIVATIONS[w.method]) == "int8"
        return lambda xp, yp, rows, nt: qgemv.launch(qlib, xp, w, None, yp, rows, act8, nt)
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and glib:
        return lambda xp, yp, rows, nt: gemv.launch(glib, xp, w, None, yp, rows, nt)
    return None


class DecodeStep:
    """The prepared calls of one :class:`~omnilab.models.decoder.DecoderLayer` (rebuilt when a weight changes)."""

    __slots__ = ("_key", "_plan")

    def __init__(self):
        self._key = None
        self._plan = None

    @staticmethod
    def _weights(layer) -> tuple:
        a, m = layer.self_attn, layer.mlp
        return (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, m.gate_proj.weight,
                m.up_proj.weight, m.down_proj.weight, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                a.q_norm.weight, a.k_norm.weight)

    @staticmethod
    def _identity(ws: tuple) -> tuple:
        return tuple((id(w), w.qweight.data_ptr() if isinstance(w, QuantizedWeight) else w.data_ptr()) for w in ws)

    def _build(self, layer):
        a, m = layer.self_attn, layer.mlp
        if any(getattr(mod, "bias", None) is not None for mod in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj,
                                                                   m.up_proj, m.down_proj)):
            return None
        glib, qlib = gemv.loaded_library(), qgemv.loaded_library()
        nlib, alib = norm_k._SLOT.loaded(), attn_k._SLOT.loaded()
        qkv = a._qkv.get((a.q_proj, a.k_proj, a.v_proj))
        gate_up = m._gate_up.get((m.gate_proj, m.up_proj))
        if nlib is None or alib is None or qkv is None or gate_up is None:
            return None
        calls = [_matmul(w, glib, qlib) for w in (qkv, a.o_proj.weight, gate_up, m.down_proj.weight)]
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        if any(c is None for c in calls) or ln1.weight.dtype != torch.float32 or ln2.weight.dtype != torch.float32:
            return None
        qk_w = a._qk_weight()
        if qk_w.dtype != torch.float32 or a.head_dim > attn_k.MAX_HEAD_DIM or a.num_heads % a.num_kv_heads:
            return None
        inter = m.gate_proj.weight.shape[0]
        return dict(qkv=calls[0], o=calls[1], gu=calls[2], down=calls[3], nqkv=qkv.shape[0], ngu=gate_up.shape[0],
                    inter=inter, ln1=(ln1.weight, ln1.eps), ln2=(ln2.weight, ln2.eps), qk=(qk_w, a.q_norm.eps),
                    heads=(a.num_heads, a.num_kv_heads, a.head_dim), scale=a.scale, nlib=nlib, alib=alib,
                    keep=(qkv, gate_up, qk_w))  # keep: the fused matrices outlive the pointers taken from them

    def plan(self, layer):
        ws = self._weights(layer)
        key = self._identity(ws)
        if key != self._key:
            self._key, self._plan = None, None
            self._plan = self._build(layer)
            self._key = self._identity(self._weights(layer))  # after the fused matrices re-pointed the weights
        return self._plan

    def __call__(self, layer, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, index: int,
                 caches) -> torch.Tensor | None:
        """``x`` [B, 1, H] fp32 -> the layer's output, with k/v written into ``caches`` (a KVCache or one per row),
        or None where the general path must run."""
        if (x.dtype != torch.float32 or not x.is_contiguous() or cos.dtype != torch.float32
                or not cos.is_contiguous() or not sin_signed.is_contiguous() or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and x.requires_grad) or not fuse.enabled() or not enabled()):
            return None
        b, _, hdim = x.shape
        if b > fuse.MAX_ROWS or kb_dtype(caches) != torch.float32:
            return None
        p = self.plan(layer)
        if p is None:
            return None
        hq, hkv, d = p["heads"]
        if isinstance(caches, Sequence):
            kbs = [c.k[index] for c in caches]
            vbs = [c.v[index] for c in caches]
            positions = [c.length for c in caches]
        else:
            kb, vb = caches.k[index], caches.v[index]  # [B, Hkv, cap, D]
            stride = kb[0].numel() * kb.element_size()
            kbs = vbs = None
            positions = [caches.length] * b
            kp = [kb.data_ptr() + i * stride for i in range(b)]
            vp = [vb.data_ptr() + i * stride for i in range(b)]
            caps = [kb.shape[2]] * b
        if kbs is not None:
            if any(t.dtype != torch.float32 for t in kbs):
                return None
            kp, vp = [t.data_ptr() for t in kbs], [t.data_ptr() for t in vbs]
            caps = [t.shape[2] for t in kbs]
        nt = torch.get_num_threads()
        nlib, alib = p["nlib"], p["alib"]
        # input norm -> fused q/k/v -> one-token attention (writes the caches) -> o_proj, residual
        h = torch.empty_like(x)
        w, eps = p["ln1"]
        norm_k.launch(nlib, x.data_ptr(), w.data_ptr(), h.data_ptr(), b, hdim, 1, eps, 0, nt)
        qkv = torch.empty(b, 1, p["nqkv"])
        p["qkv"](h.data_ptr(), qkv.data_ptr(), b, nt)
        att = torch.empty(b, 1, hq * d)
        qk_w, qk_eps = p["qk"]
        attn_k.launch(alib, qkv.data_ptr(), qk_w.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                      0 if cos.shape[0] == 1 else d, kp, vp, caps, positions, att.data_ptr(), p["heads"], qk_eps,
                      p["scale"], 0, nt)
        o = torch.empty(b, 1, hdim)
        p["o"](att.data_ptr(), o.data_ptr(), b, nt)
        x = x + o
        # post-attention norm -> fused gate/up -> silu(gate) * up -> down_proj, residual
        h = torch.empty_like(x)
        w, eps = p["ln2"]
        norm_k.launch(nlib, x.data_ptr(), w.data_ptr(), h.data_ptr(), b, hdim, 1, eps, 0, nt)
        gu = torch.empty(b, 1, p["ngu"])
        p["gu"](h.data_ptr(), gu.data_ptr(), b, nt)
        inter = p["inter"]
        act = F.silu(gu[..., :inter]) * gu[..., inter:]
        y = torch.empty(b, 1, hdim)
        p["down"](act.data_ptr(), y.data_ptr(), b, nt)
        return x + y


def kb_dtype(caches) -> torch.dtype:
    """The dtype of the caches' keys (all rows share the talker's or predictor's compute dtype)."""
    c = caches[0] if isinstance(caches, Sequence) else caches
    return c.k[0].dtype
