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
else takes the general path.

:class:`StackStep` goes one further: every layer of a stack and its final norm in one ``stack.cpp`` call over the
layers' plans (the same kernels through their function pointers, same arguments and order: bitwise the layer
steps), where ``OMNILAB_CPU_STACK`` gives the library. ``OMNILAB_DECODE_STEP=auto|layer|off``: ``auto`` the one-call
stack where it applies, else per layer; ``layer`` the per-layer calls only; ``off`` the general path (to time all
three side by side).
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.kernels import attention as attn_k
from omnilab.kernels import gemv, norm as norm_k, qgemv, stack as stack_k
from omnilab.kernels.gemv import _paths
from omnilab.kernels.quant import AUTO_ACTIVATIONS, QuantizedWeight
from omnilab.tuning import fuse

ENV = "OMNILAB_DECODE_STEP"
MODES = ("auto", "layer", "off")


def mode() -> str:
    """``OMNILAB_DECODE_STEP``: ``auto`` (a stack in one call where it applies, else per layer), ``layer`` (the
    per-layer direct calls only), ``off`` (the general path): to time them side by side."""
    given = settings.raw(ENV)
    raw = (given or "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={given!r} is not a mode; accepted: {', '.join(MODES)}")
    return raw


def enabled() -> bool:
    return mode() != "off"


def _matmul(w: Any, glib: Any, qlib: Any):
    """``(call, mat)`` for the kernel :func:`omnilab.kernels.linear` would use on ``w`` (fp32 rows, no bias):
    ``call(x_ptr, y_ptr, rows, threads)`` through that kernel's own ``launch``, and its ``stack.Mat`` descriptor
    (what ``stack.cpp`` calls); None where it is not one of omnilab's kernels."""
    if isinstance(w, QuantizedWeight):
        if qlib is None:
            return None
        act = w.activations or AUTO_ACTIVATIONS[w.method]
        mat = stack_k.Mat(1, w.qweight.data_ptr(), w.scales.data_ptr(), w.shape[0], w.shape[1], w.bits,
                          w.group_size or 0, qgemv.ACT_MODE[act], int(w.scales.dtype == torch.float16))
        return (lambda xp, yp, rows, nt: qgemv.launch(qlib, xp, w, None, yp, rows, act, nt)), mat
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and glib:
        mat = stack_k.Mat(0, w.data_ptr(), None, w.shape[0], w.shape[1], 0, 0, 0)
        return (lambda xp, yp, rows, nt: gemv.launch(glib, xp, w, None, yp, rows, nt)), mat
    return None


class DecodeStep:
    """The prepared calls of one :class:`~omnilab.models.decoder.DecoderLayer` (rebuilt when a weight changes)."""

    __slots__ = ("_key", "_plan")

    def __init__(self):
        self._key = None
        self._plan = None

    @staticmethod
    def _weights(layer) -> tuple:
        # Straight from the modules' dicts (nn.Module.__getattr__ costs ~1 us a lookup, and this runs every step):
        # a parameter in _parameters, or a QuantizedWeight installed as a plain attribute.
        sub = layer._modules
        a, m = sub["self_attn"]._modules, sub["mlp"]._modules
        return tuple(_weight(mod) for mod in (a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"], m["gate_proj"],
                                              m["up_proj"], m["down_proj"], sub["input_layernorm"],
                                              sub["post_attention_layernorm"], a["q_norm"], a["k_norm"]))

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
        dtype = ln1.weight.dtype  # the compute dtype: fp32 (every path) or bf16 (the one-call stack only)
        if any(c is None for c in calls) or dtype not in _STACK_CODES or any(
                w.dtype != dtype or not w.is_contiguous() for w in (ln1.weight, ln2.weight)):
            return None
        qk_w = a._qk_weight()
        if qk_w.dtype != dtype or a.head_dim > attn_k.MAX_HEAD_DIM or a.num_heads % a.num_kv_heads:
            return None
        inter = m.gate_proj.weight.shape[0]
        (qkv_c, qkv_m), (o_c, o_m), (gu_c, gu_m), (down_c, down_m) = calls
        record = stack_k.Layer(qkv_m, o_m, gu_m, down_m, ln1.weight.data_ptr(), ln2.weight.data_ptr(),
                               qk_w.data_ptr(), ln1.eps, ln2.eps, a.q_norm.eps, a.scale, a.num_heads,
                               a.num_kv_heads, a.head_dim, inter)
        return dict(qkv=qkv_c, o=o_c, gu=gu_c, down=down_c, nqkv=qkv.shape[0], ngu=gate_up.shape[0],
                    inter=inter, ln1=(ln1.weight, ln1.eps), ln2=(ln2.weight, ln2.eps), qk=(qk_w, a.q_norm.eps),
                    heads=(a.num_heads, a.num_kv_heads, a.head_dim), scale=a.scale, nlib=nlib, alib=alib,
                    glib=glib, qlib=qlib, record=record, dtype=dtype,
                    bf16_weights=any(m.kind == 0 for m in (qkv_m, o_m, gu_m, down_m)),
                    keep=(qkv, gate_up, qk_w))  # keep: the fused matrices outlive the pointers taken from them

    def __reduce__(self):  # a copied model starts unplanned (the plan holds raw pointers of these weights)
        return (DecodeStep, ())

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
        if not _inputs_fit(x, cos, sin_signed, caches):
            return None
        b, _, hdim = x.shape
        p = self.plan(layer)
        if p is None or p["dtype"] != torch.float32:  # bf16 layers: the one-call stack only
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
        act = stack_k.swiglu(gu, p["inter"])
        y = torch.empty(b, 1, hdim)
        p["down"](act.data_ptr(), y.data_ptr(), b, nt)
        return x + y


def _weight(mod) -> Any:
    w = mod._parameters.get("weight")
    return w if w is not None else mod.__dict__.get("weight")


_STACK_CODES = {torch.float32: 0, torch.bfloat16: 1}  # stack.cpp's dtype argument


def _torch_bf16_linears(dtype: torch.dtype, plans) -> bool:
    """Whether bf16 compute's general path runs these bf16 matrices through torch's linears (the path timing chose
    torch over the kernel): then the one-call stack, whose matrices go through the kernel, is not the same calls."""
    if dtype != torch.bfloat16 or not any(p["bf16_weights"] for p in plans):
        return False
    return _paths().bf16_decode != "kernel"


def _inputs_fit(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, caches, stack: bool = False) -> bool:
    """Whether one step's inputs are what the direct calls take: fp32 contiguous rows (at most ``fuse.MAX_ROWS``),
    fp32 caches, no autograd or torch.compile, fused projections and the decode step on. ``stack``: the one-call
    stack also takes bf16 rows, tables and caches (:meth:`StackStep.__call__` checks that bf16 compute's linears take
    the kernel, so the general path makes the same calls)."""
    dtype = x.dtype
    if dtype not in _STACK_CODES or (dtype != torch.float32 and not stack):
        return False
    return not (not x.is_contiguous() or cos.dtype != dtype or sin_signed.dtype != dtype
                or not cos.is_contiguous() or not sin_signed.is_contiguous() or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and x.requires_grad) or not fuse.enabled() or not enabled()
                or x.shape[0] > fuse.MAX_ROWS or kb_dtype(caches) != dtype)


def _address(fn: Any) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


class StackStep:
    """A whole decoder stack's one-token step (every layer, then the final norm) in one ``stack.cpp`` call, over
    the layers' :class:`DecodeStep` plans (rebuilt when one of them changes). Bitwise the per-layer steps."""

    __slots__ = ("_plans", "_records", "_kernels", "_valid")

    def __init__(self):
        self._plans: tuple = ()
        self._records = self._kernels = None
        self._valid = False  # the last call checked the plans against the layers' weights and used them

    def __reduce__(self):
        return (StackStep, ())

    def _ready(self, layers, norm, recheck: bool):
        """``(lib, plans)`` for one call (the records and kernel table rebuilt when a plan changed), or None."""
        lib = stack_k.loaded_library()
        w = norm.weight
        if lib is None or mode() != "auto" or w.dtype not in _STACK_CODES or not w.is_contiguous():
            self._valid = False
            return None
        if recheck or not self._valid:
            self._valid = False
            plans = tuple(layer._step.plan(layer) for layer in layers)
            if not plans or any(p is None or p["dtype"] != w.dtype for p in plans):
                return None
        else:
            plans = self._plans
        if len(plans) != len(self._plans) or any(a is not b for a, b in zip(plans, self._plans)):
            p0 = plans[0]
            self._records = (stack_k.Layer * len(plans))(*[p["record"] for p in plans])
            self._kernels = stack_k.Kernels(_address(getattr(p0["glib"], "fn_bf16w", None)),
                                            _address(getattr(p0["qlib"], "fn", None)), _address(p0["nlib"].fn),
                                            _address(p0["alib"].fn), _address(getattr(p0["alib"], "paged", None)))
            self._plans = plans  # held: the records point into these plans' weights
        return lib, plans

    def __call__(self, layers, norm, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                 caches, recheck: bool = True, tokens: int = 1) -> torch.Tensor | None:
        """``x`` [B, 1, H] fp32 -> ``norm(layers(x))`` [B, 1, H] with every layer's k/v written into ``caches``
        (the caller advances their lengths), or None where the per-layer path must run.

        ``recheck=False``: the caller vouches that no weight changed since the previous call (the code predictor's
        steps within one frame), so the plans that call checked are used without looking at the layers again
        (~20 us a layer); a previous call that did not run the stack makes this one check anyway.

        ``tokens`` > 1: a short prefill. Rows ``b * tokens + j`` are token j of sequence b (``caches`` a KVCache of
        B / tokens rows), at position ``length + j`` (``cos`` / ``sin_signed`` one row per row of ``x``). The
        attention kernel writes every row's k/v before any row attends, so token j attends to positions 0..j of its
        own sequence: causal, as a prefill."""
        if tokens > 1 and (caches is None or isinstance(caches, Sequence) or x.shape[0] % tokens
                           or caches.batch != x.shape[0] // tokens or cos.shape[0] != x.shape[0]):
            self._valid = False
            return None
        if not _inputs_fit(x, cos, sin_signed, caches, stack=True):
            self._valid = False
            return None
        ready = self._ready(layers, norm, recheck)
        if ready is not None and ready[1][0]["dtype"] != x.dtype:
            return None
        if ready is None or _torch_bf16_linears(x.dtype, ready[1]):
            return None
        lib, plans = ready
        b, _, hdim = x.shape
        n = len(plans)
        if isinstance(caches, Sequence):
            kp = [c.k[i].data_ptr() for i in range(n) for c in caches]
            vp = [c.v[i].data_ptr() for i in range(n) for c in caches]
            caps = [c.k[0].shape[2] for c in caches]
            positions = [c.length for c in caches]
        else:
            stride = caches.k[0][0].numel() * caches.k[0].element_size()  # one sequence's cache row
            kp = [caches.k[i].data_ptr() + r // tokens * stride for i in range(n) for r in range(b)]
            vp = [caches.v[i].data_ptr() + r // tokens * stride for i in range(n) for r in range(b)]
            caps = [caches.k[0].shape[2]] * b
            positions = [caches.length + r % tokens for r in range(b)]
        arr, rows = ctypes.c_int64 * (n * b), ctypes.c_int64 * b
        out = torch.empty(b, 1, hdim, dtype=x.dtype)
        rc = lib.step(ctypes.byref(self._kernels), self._records, n, x.data_ptr(), b, hdim, cos.data_ptr(),
                      sin_signed.data_ptr(), 0 if cos.shape[0] == 1 else plans[0]["heads"][2], arr(*kp), arr(*vp),
                      rows(*caps), rows(*positions), norm.weight.data_ptr(), norm.eps, out.data_ptr(),
                      _STACK_CODES[x.dtype], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"omnilab_stack_step: kernel call {rc} rejected its arguments (B={b}, H={hdim}, "
                               f"{n} layers, positions {positions}, capacities {caps})")
        self._valid = True
        return out

    def paged(self, layers, norm, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
              caches: Sequence[torch.Tensor], block_table: torch.Tensor, positions: Sequence[int],
              recheck: bool = True) -> torch.Tensor | None:
        """The same step over vLLM's paged "vec" caches (``attn.cpp``'s layout note): ``x`` [B, H] fp32 or bf16 (the
        stack's dtype, as ``cos`` / ``sin_signed`` [B, D], each row's position, and the caches), ``caches[l]`` layer
        l's [blocks, Hkv, bs, 2 Dp] tensor, ``block_table`` [>= B, max_blocks] int32, ``positions[b]`` where row b's
        token goes. -> [B, H], or None where it does not apply (the caller runs vLLM's layers)."""
        dt = x.dtype
        if (x.dim() != 2 or dt not in _STACK_CODES or not x.is_contiguous() or cos.dtype != dt
                or sin_signed.dtype != dt or not cos.is_contiguous() or not sin_signed.is_contiguous()
                or torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad)
                or not fuse.enabled() or not enabled() or x.shape[0] > fuse.MAX_ROWS
                or block_table.dtype != torch.int32 or block_table.stride(1) != 1 or len(caches) != len(layers)
                or any(c.dtype != dt or c.dim() != 4 or not c.is_contiguous() for c in caches)):
            self._valid = False
            return None
        ready = self._ready(layers, norm, recheck)
        if ready is None or ready[1][0]["dtype"] != dt or getattr(ready[1][0]["alib"], "paged", None) is None:
            return None
        if _torch_bf16_linears(dt, ready[1]):
            return None
        lib, plans = ready
        b, hdim = x.shape
        n = len(plans)
        nblocks, _, bs, two_dp = caches[0].shape
        out = torch.empty(b, hdim, dtype=dt)
        rc = lib.step_paged(ctypes.byref(self._kernels), self._records, n, x.data_ptr(), b, hdim, cos.data_ptr(),
                            sin_signed.data_ptr(), plans[0]["heads"][2], (ctypes.c_int64 * n)(*[c.data_ptr() for c in caches]),
                            block_table.data_ptr(), block_table.stride(0), (ctypes.c_int64 * b)(*positions), bs,
                            two_dp // 2, nblocks, norm.weight.data_ptr(), norm.eps, out.data_ptr(),
                            _STACK_CODES[dt], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"omnilab_stack_step_paged: kernel call {rc} rejected its arguments (B={b}, H={hdim}, "
                               f"{n} layers, positions {list(positions)}, cache {tuple(caches[0].shape)})")
        self._valid = True
        return out


def kb_dtype(caches) -> torch.dtype:
    """The dtype of the caches' keys (all rows share the talker's or predictor's compute dtype)."""
    c = caches[0] if isinstance(caches, Sequence) else caches
    return c.k[0].dtype
