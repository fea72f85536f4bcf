"""Weight-only quantization of decode matrices (int8 per output channel, int4 per group along K): the
numerical reference of ``qgemv.cpp`` and the layout it streams.

Codes and scales (symmetric, no zero point):

- ``quantize_int8(w)``: ``scale[n] = max|w[n, :]| / 127``, ``q = round(w / scale)`` in [-127, 127].
- ``quantize_int4(w, group_size)``: ``scale[n, g] = max|w[n, g*gs:(g+1)*gs]| / 7``, ``q = round(w / scale)``
  in [-7, 7]. The symmetric scale never needs -8, but the layout and the kernels take [-8, 7] (stored
  ``q + 8`` in [0, 15]), so a checkpoint's -8 (e.g. compressed-tensors' pack-quantized) repacks unchanged.

``round`` is half to even; an all-zero row or group gets scale 0 and codes 0. Per element,
``|w - q * scale| <= scale / 2`` (``dequantize`` multiplies in fp32, so add an ulp of ``w``).

Kernel layout (a repack done at quantize / load time; the on-disk format is separate). Output rows go in
blocks of ``ROWS = 16`` (N padded to ``Np``, a multiple of 16, with zero rows), and inside a block the 16
rows are interleaved 4 bytes at a time, so one 64-byte line holds 16 rows x 4 bytes: the 16 lanes of an
AVX-512 register are the block's 16 output rows (AVX2: two halves of 8), and ``vpdpbusd`` multiplies each
lane's 4 bytes with 4 activation bytes broadcast. A thread reads its blocks as one sequential stream.

- int8: ``qweight`` uint8 ``[Np/16, Kp/4, 16, 4]``; byte ``[i, c, r, j] = q[16 i + r, 4 c + j] + 128``. K is
  padded to ``Kp``, a multiple of ``ACT_BLOCK = 32``, with zero codes (stored 128).
  ``scales`` fp32 ``[Np/16, 1, 16]`` (one group spanning K).
- int4: ``qweight`` uint8 ``[Np/16, K/8, 16, 4]``; byte ``[i, c, r, j]`` holds ``q[16 i + r, 8 c + j] + 8`` in its
  low nibble and ``q[16 i + r, 8 c + 4 + j] + 8`` in its high nibble (K % group_size == 0, so Kp = K).
  ``scales`` fp32 ``[Np/16, K/group_size, 16]``: a block's scales, group after group, 16 rows each.

int4 scales are fp16 (2 B per 16 B of codes at g = 32: 11 % of the bytes read, 6 % at g = 64, 3 % at g = 128; fp32
would be 20 / 11 / 6 %): the quantizers choose them fp16-exact and the kernel widens them exactly on load, so the
dequantized matrix is what the kernel computes with. A file's int4 scales that fp16 cannot hold exactly stay fp32.
int8's per-channel scales are fp32, 4 B per K-byte row.

Quantize at load (:class:`Quantization`, :func:`quantization_choice`): ``from_pretrained(quantization=,
quant_group_size=)`` / ``OMNILAB_QUANTIZATION=none|int8|int4`` (the variable wins), the activations per method
(:data:`AUTO_ACTIVATIONS`, ``OMNILAB_QUANT_ACTIVATIONS``); the strict loader installs the ``QuantizedWeight`` in
place of each selected ``weight`` parameter and ``kernels.linear`` sends it to ``qgemv.qlinear``.

``quantize_activations(x, bits=8|16)`` is the reference of the kernel's integer-activation modes (dynamic, per row
and 32-wide block of K, symmetric); :func:`int_act_reference` is that mode's result computed with torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from omnilab import settings
from omnilab.config import DEFAULT_INT4_GROUP_SIZE as DEFAULT_GROUP_SIZE  # the names and sizes every layer shares
from omnilab.config import INT4_GROUP_SIZES, QUANT_RECIPES, has_int4, int4_groups_fitting, parse_quantization, part_format
from omnilab.config import QUANT_METHODS as METHODS
from omnilab.errors import ConfigError

ROWS = 16            # output rows per interleaved block (AVX-512 lanes)
SCALE_DTYPES = (torch.float32, torch.float16)
ACT_BLOCK = 32       # K padding unit and activation quantization block of the int8-activation mode


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [N, K] matrix in the kernel layout (see the module docstring). ``group_size`` is K for int8 (one
    scale per output channel)."""

    method: str                 # "int8" | "int4"
    group_size: int
    shape: tuple[int, int]      # (N, K) of the original matrix
    qweight: torch.Tensor       # uint8, int8: [Np/16, Kp/4, 16, 4]; int4: [Np/16, K/8, 16, 4]
    scales: torch.Tensor        # [Np/16, groups, 16]: float32 (int8), float16 (int4) or float32 (int4 scales a file
                                # holds that fp16 cannot hold exactly)
    activations: str | None = None  # qlinear's mode when called through kernels.linear (None: per method)

    def __post_init__(self):
        n, k = self.shape
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; accepted: {', '.join(METHODS)}")
        kp = self.padded_k
        per_chunk = 4 if self.method == "int8" else 8
        want_q = (self.padded_n // ROWS, kp // per_chunk, ROWS, 4)
        want_s = (self.padded_n // ROWS, self.groups, ROWS)
        if (self.qweight.dtype != torch.uint8 or tuple(self.qweight.shape) != want_q
                or self.scales.dtype not in SCALE_DTYPES or tuple(self.scales.shape) != want_s
                or not self.qweight.is_contiguous() or not self.scales.is_contiguous()):
            raise ValueError(f"{self.method} layout of a {n}x{k} matrix needs contiguous uint8 qweight {want_q} "
                             f"and float32 / float16 scales {want_s}, got {self.qweight.dtype} {tuple(self.qweight.shape)} "
                             f"and {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def padded_n(self) -> int:
        return _ceil(self.shape[0], ROWS)

    @property
    def padded_k(self) -> int:
        return _ceil(self.shape[1], ACT_BLOCK) if self.method == "int8" else self.shape[1]

    @property
    def groups(self) -> int:
        return 1 if self.method == "int8" else self.shape[1] // self.group_size

    @property
    def bits(self) -> int:
        return 8 if self.method == "int8" else 4

    @property
    def nbytes(self) -> int:
        """Bytes a call streams: packed codes + scales (padding included)."""
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def codes(self, blocks: slice = slice(None)) -> torch.Tensor:
        """The signed codes, int8 [N, K] (unpacked; exact); ``blocks``: only those 16-row blocks (padded
        rows included, K unpadded)."""
        n, k = self.shape
        if self.method == "int8":
            q = self.qweight[blocks].permute(0, 2, 1, 3).reshape(-1, self.padded_k).to(torch.int16) - 128
        else:
            b = self.qweight[blocks].permute(0, 2, 1, 3)  # [blocks, 16, K/8, 4]
            q = torch.stack([b & 0x0F, b >> 4], dim=3).reshape(-1, k).to(torch.int16) - 8
        return (q if blocks != slice(None) else q[:n])[:, :k].to(torch.int8)

    def row_scales(self, blocks: slice = slice(None)) -> torch.Tensor:
        """Scales per (row, group), fp32 [N, groups] (``blocks``: as for :meth:`codes`)."""
        s = self.scales[blocks].permute(0, 2, 1).reshape(-1, self.groups).float()
        return s if blocks != slice(None) else s[: self.shape[0]]

    def dequantize(self, blocks: slice = slice(None)) -> torch.Tensor:
        """fp32 [N, K]: ``codes * scale`` of each element's row and group (``blocks``: as for :meth:`codes`)."""
        s = self.row_scales(blocks).repeat_interleave(self.group_size, dim=1)
        return self.codes(blocks).float() * s

    def __repr__(self) -> str:
        g = "" if self.method == "int8" else f", group_size={self.group_size}"
        return f"QuantizedWeight({self.method}{g}, shape={self.shape}, nbytes={self.nbytes})"


def packed_nbytes(shape: tuple[int, int], method: str, group_size: int | None = None) -> int:
    """:attr:`QuantizedWeight.nbytes` of a [N, K] matrix quantized with ``method`` (without quantizing it)."""
    n, k = shape
    np_, kp = _ceil(n, ROWS), (_ceil(k, ACT_BLOCK) if method == "int8" else k)
    groups = 1 if method == "int8" else k // (group_size or DEFAULT_GROUP_SIZE)
    return np_ * kp // (1 if method == "int8" else 2) + np_ * groups * (4 if method == "int8" else 2)


def fp16_exact(scales: torch.Tensor) -> bool:
    """Whether every scale is a finite fp16 value (so fp16 storage keeps it exactly)."""
    s = scales.float()
    return bool(torch.isfinite(s).all()) and bool((s.half().float() == s).all())


def from_codes(method: str, codes: torch.Tensor, scales: torch.Tensor, group_size: int | None = None
               ) -> QuantizedWeight:
    """Pack signed codes (int8 [N, K]: [-127, 127] for int8, [-8, 7] for int4) and scales ([N] or [N, groups])
    into the kernel layout; the way in for a checkpoint's quantized tensors (repack at load). Scales are kept as
    fp32 for int8 and as fp16 for int4 where fp16 holds every one exactly (else fp32: never rounded here)."""
    n, k = codes.shape
    if method == "int8":
        group_size, lo, hi = k, -128, 127
    elif method == "int4":
        _check_group(k, group_size)
        lo, hi = -8, 7
    else:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")
    q = codes.to(torch.int16)
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{method} codes must lie in [{lo}, {hi}], got [{int(q.min())}, {int(q.max())}]")
    groups = k // group_size
    s = scales.to(torch.float32).reshape(n, groups)
    sdt = torch.float16 if method == "int4" and fp16_exact(s) else torch.float32
    np_ = _ceil(n, ROWS)
    s_pad = torch.zeros(np_, groups, dtype=sdt)
    s_pad[:n] = s
    scales_l = s_pad.reshape(np_ // ROWS, ROWS, groups).permute(0, 2, 1).contiguous()
    if method == "int8":
        kp = _ceil(k, ACT_BLOCK)
        u = torch.full((np_, kp), 128, dtype=torch.int16)
        u[:n, :k] = q + 128
        packed = u.to(torch.uint8).reshape(np_ // ROWS, ROWS, kp // 4, 4).permute(0, 2, 1, 3)
    else:
        u = torch.full((np_, k), 8, dtype=torch.int16)
        u[:n] = q + 8
        u = u.to(torch.uint8).reshape(np_ // ROWS, ROWS, k // 8, 2, 4)
        packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 1, 3)
    return QuantizedWeight(method, group_size, (n, k), packed.contiguous(), scales_l)


def _check_group(k: int, group_size: int | None) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"int4 needs K divisible by group_size: K={k} is not a multiple of {group_size} "
                         f"(accepted group sizes: {', '.join(map(str, INT4_GROUP_SIZES))}, each must divide K)")


def _symmetric(w: torch.Tensor, qmax: int, fp16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) for the rows of ``w`` [..., G]: scale = max|w| / qmax (``fp16``: rounded to fp16 first, so
    it is stored exactly in half the bytes), codes = round(w / scale) within [-qmax, qmax]."""
    scale = w.abs().amax(dim=-1) / qmax
    if fp16:
        scale = scale.clamp(max=65504.0).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe.unsqueeze(-1)).clamp_(-qmax, qmax)
    return q.to(torch.int8), scale


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel of ``w`` [N, K] (any float dtype; computed in fp32)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a [N, K] matrix, got shape {tuple(w.shape)}")
    q, scale = _symmetric(w.detach().float().cpu(), 127)
    return from_codes("int8", q, scale)


# int4 scale choices (docs/quantization.md#int4-scales): "rtn" round to nearest, scale = max|w| / 7; "wls": weighted
# least squares over a grid of clipping scales. Both fp16: half the scale bytes, in memory and on disk.
INT4_SCALES = ("wls", "rtn")
WLS_WEIGHTS = "uniform"  # u_i = 1 (least squares on the weights); "magnitude" (u_i = x_i^2) measured worse
WLS_STEPS = tuple(d / 10 for d in range(-10, 21))  # candidate scales max|w| / (7 + d): clip (d > 0) or widen


def wls_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 in [-7, 7], fp16-exact scales as fp32) of the groups ``x`` [..., G] minimising the weighted error
    ``sum_i u_i (x_i - s q_i)^2`` (``u``: :data:`WLS_WEIGHTS`; uniform, as activations of random weights carry no
    per-channel importance) over the candidate scales
    ``max|x| / (7 + d)``, d in :data:`WLS_STEPS`: codes ``round(x / s_d)``, then ``s`` refitted in closed form
    (``sum u x q / sum u q^2``) and rounded to fp16. d = 0 gives round to nearest's codes, so the weighted error is
    at most RTN's plus the fp16 rounding of the scale."""
    x = x.float()
    u = torch.ones_like(x) if WLS_WEIGHTS == "uniform" else x * x + 1e-12  # [..., G]
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    best_err = torch.full(amax.shape[:-1], float("inf"))
    best_q = torch.zeros_like(x, dtype=torch.int8)
    best_s = torch.zeros(amax.shape[:-1])
    for d in WLS_STEPS:
        s0 = amax / (7 + d)
        q = torch.round(x / torch.where(s0 > 0, s0, torch.ones_like(s0))).clamp_(-7, 7)
        den = (u * q * q).sum(-1)
        scale = torch.where(den > 0, (u * x * q).sum(-1) / den.clamp_min(1e-30), torch.zeros_like(den))
        scale = scale.clamp(max=65504.0).half().float()
        err = (u * (x - scale.unsqueeze(-1) * q) ** 2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scale, best_s)
        best_q = torch.where(better.unsqueeze(-1), q.to(torch.int8), best_q)
    return best_q, best_s


def quantize_int4(w: torch.Tensor, group_size: int = 128, scales: str = "rtn") -> QuantizedWeight:
    """Symmetric int4 per ``group_size`` elements along K (32, 64 or 128; must divide K) of ``w`` [N, K]; ``scales``:
    ``"rtn"`` (max|w| / 7 rounded to fp16) or ``"wls"`` (:func:`wls_int4`); fp16 scales either way."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int4 takes a [N, K] matrix, got shape {tuple(w.shape)}")
    if scales not in INT4_SCALES:
        raise ValueError(f"int4 scales {scales!r}; accepted: {', '.join(INT4_SCALES)}")
    n, k = w.shape
    _check_group(k, group_size)
    groups = w.detach().float().cpu().reshape(n, k // group_size, group_size)
    q, scale = wls_int4(groups) if scales == "wls" else _symmetric(groups, 7, fp16=True)
    return from_codes("int4", q.reshape(n, k), scale, group_size)


def quantize(w: torch.Tensor, method: str, group_size: int | None = None, scales: str = "rtn") -> QuantizedWeight:
    """``quantize_int8(w)`` or ``quantize_int4(w, group_size, scales)`` by name."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, 128 if group_size is None else group_size, scales)
    raise ValueError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")


def quantize_activations(x: torch.Tensor, kp: int | None = None, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's dynamic activation quantization: ``x`` [R, K] fp32, zero-padded to ``kp`` (a multiple
    of 32), per row and 32-wide block: ``amax = max|x|``, ``inv = qmax / amax`` (0 for an all-zero block; qmax 127
    for ``bits`` 8, 32767 for 16), ``xq = round(x * inv)`` (half to even) in [-qmax, qmax], ``xs = amax / qmax``.
    Returns (xq int8 / int16 [R, kp] in k order, xs fp32 [R, kp/32]); the kernel computes exactly these values
    (same fp32 operations; it stores int16 codes pairwise permuted, qgemv.cpp)."""
    if bits not in (8, 16):
        raise ValueError(f"bits={bits!r}; accepted: 8, 16")
    qmax = 127 if bits == 8 else 32767
    r, k = x.shape
    kp = _ceil(k, ACT_BLOCK) if kp is None else kp
    xp = torch.zeros(r, kp, dtype=torch.float32)
    xp[:, :k] = x
    blocks = xp.reshape(r, kp // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(float(qmax)) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8 if bits == 8 else torch.int16)
    return xq.reshape(r, kp), amax / qmax


def int_act_reference(x: torch.Tensor, qw: QuantizedWeight, bits: int = 8) -> torch.Tensor:
    """The kernel's int8 / int16 activation mode computed with torch: ``sum_b (xq_b . q_b) * xs[r, b] *
    scale[n, g(b)]`` over the 32-wide blocks b, fp32 [R, N]. Each block's integer dot is exact (in float64 here,
    |.| < 2^31), so this differs from the kernel only by the fp32 rounding of the sum over blocks."""
    n, k = qw.shape
    kp, nb = qw.padded_k, qw.padded_k // ACT_BLOCK
    xq, xs = quantize_activations(x.reshape(-1, k).float(), kp, bits)
    q = torch.zeros(n, kp, dtype=torch.float64)
    q[:, :k] = qw.codes().double()
    ws = qw.row_scales().repeat_interleave(qw.group_size // ACT_BLOCK if qw.method == "int4" else nb, dim=1)
    dots = torch.einsum("rbk,nbk->rnb", xq.double().reshape(-1, nb, ACT_BLOCK), q.reshape(n, nb, ACT_BLOCK))
    return (dots.float() * xs.unsqueeze(1) * ws.unsqueeze(0)).sum(-1).reshape(*x.shape[:-1], n)


def int8_act_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """:func:`int_act_reference` with 8-bit activations."""
    return int_act_reference(x, qw, 8)


# ---- quantize at load: the talker's decode matrices ------------------------------------------------------
QUANT_ENV = "OMNILAB_QUANTIZATION"
SCALES_ENV = "OMNILAB_INT4_SCALES"
# round to nearest at load: least squares costs ~20x the quantizing time (0.6B talker: 4-7 minutes on 2 cores) for
# +7 points of c0 agreement at group 32 on the confident 0.6B (docs/quantization.md#int4-scales);
# OMNILAB_INT4_SCALES=wls opts in, for files written once with omnilab quantize above all
DEFAULT_INT4_SCALES = "rtn"
ACT_ENV = "OMNILAB_QUANT_ACTIVATIONS"
QUANT_MODES = ("none",) + tuple(QUANT_RECIPES)
# qlinear's activations per method (OMNILAB_QUANT_ACTIVATIONS=auto|int8|int16|fp32 overrides): int8 activations add
# ~0.55 % relative error, negligible next to int4 weights' ~10 % but about doubling int8 weights' ~0.8 %; int16
# ones add ~0.005 % at the integer path's speed (docs/kernels.md#activations-of-quantized-matrices).
AUTO_ACTIVATIONS = {"int8": "int16", "int4": "int8"}
ACTIVATION_MODES = ("auto", "int8", "int16", "fp32")


@dataclass(frozen=True)
class Quantization:
    """Whether and how the talker's decode matrices (:func:`omnilab.tuning.storage.talker_streamed_name`) are
    quantized at load (from the file's values; fp32 compute through :func:`omnilab.kernels.qgemv.qlinear`)."""

    method: str                 # recipe: "none" | "int8" | "int4" | "int4-all" (config.QUANT_RECIPES: format per part)
    group_size: int | None      # the int4 parts' group: 32 | 64 | 128; None without int4 parts
    activations: str | None     # "fp32" | "int8" | "int16" (None when method is "none"): the int4 parts' (int8: all)
    reason: str
    source: str                 # "default" | "argument" | "env" | "checkpoint" | "client" (a worker: from_key)
    # which tensors (names without ``talker.``) to quantize: the loader sets storage.talker_streamed_name (:meth:`only`)
    names: Any = field(default=None, compare=False, repr=False)
    int8_activations: str | None = None  # a mixed recipe's int8 parts (None: ``activations``)
    int4_scales: str = "rtn"    # how int4 parts choose their scales (INT4_SCALES; OMNILAB_INT4_SCALES)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def mixed(self) -> bool:
        """Parts in different formats (``int4``: int4 talker, int8 predictor)."""
        return self.enabled and len(set(QUANT_RECIPES[self.method])) > 1

    @property
    def label(self) -> str:
        if not self.enabled:
            return "none"
        if self.mixed:
            return (f"{self.method}: int4 talker (group {self.group_size}, {self.activations} activations), int8 "
                    f"code predictor ({self.int8_activations or self.activations} activations)")
        g = f", group {self.group_size}" if has_int4(self.method) else ", per output channel"
        return f"{self.method} weights{g}, {self.activations} activations"

    def key(self) -> str:
        """A compact string (``method/group/activations[/int8 parts' activations]``) that :func:`from_key` turns back
        into this choice: how the setting travels to stage worker processes (the view config)."""
        return f"{self.method}/{self.group_size or 0}/{self.activations or ''}/{self.int8_activations or ''}/" + (
            self.int4_scales)

    def format_for(self, name: str) -> str:
        """``"int8"`` / ``"int4"``: the recipe's format for the decode matrix ``name`` (without ``talker.``)."""
        return part_format(self.method, name)

    def only(self, names: Any) -> "Quantization":
        """This choice applied to the tensors ``names(name)`` selects."""
        return dataclasses.replace(self, names=names)

    def selects(self, name: str) -> bool:
        """Whether the tensor ``name`` is quantized (enabled, and selected by :attr:`names`)."""
        return self.enabled and self.names is not None and bool(self.names(name))

    def apply(self, w: "torch.Tensor | QuantizedWeight", name: str | None = None) -> QuantizedWeight:
        """``w`` (the decode matrix ``name``, without ``talker.``) quantized in its part's format; a
        ``QuantizedWeight`` (a checkpoint's codes) is kept as stored. No ``name``: the recipe's lowest format."""
        fmt = self.format_for(name) if name is not None else "int4" if has_int4(self.method) else "int8"
        if isinstance(w, QuantizedWeight):
            qw, fmt = w, w.method
        else:
            qw = quantize(w, fmt, self.group_size if fmt == "int4" else None, self.int4_scales)
        act = self.int8_activations if fmt == "int8" and self.int8_activations else self.activations
        return dataclasses.replace(qw, activations=act)

    def install(self, module: torch.nn.Module, name: str, w: torch.Tensor) -> QuantizedWeight:
        """Quantize ``w`` and put it in place of the parameter ``name`` of ``module`` (a plain attribute: the
        parameter leaves ``state_dict``/``parameters``; :func:`omnilab.kernels.linear` dispatches it)."""
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        qw = self.apply(w, name)
        del owner._parameters[attr]
        setattr(owner, attr, qw)
        return qw


def _parse_method(raw: Any, where: str) -> str:
    return parse_quantization(raw, where)[0]


def quantization_choice(method: Any = None, group_size: Any = None, env: str | None = None,
                        act_env: str | None = None, ks: Any = ()) -> Quantization:
    """The quantization for ``from_pretrained(quantization=, quant_group_size=)``: ``$OMNILAB_QUANTIZATION``
    (``env``; same values) wins over the argument, like the other ``OMNILAB_*`` overrides. ``ks``: the K (input
    width) of every matrix to quantize: int4's group must divide each; the default is the largest accepted
    size up to 128 that does (tiny geometries), a given one that does not is an error."""
    given = ((settings.raw(QUANT_ENV) or "") if env is None else env).strip()
    if given:  # a spelling may name the int4 group ("int4-g64"); the variable's group wins like its method
        (m, spelled), source = parse_quantization(given, QUANT_ENV), "env"
        group_size = spelled if spelled is not None else None if not has_int4(m) else group_size
    else:
        (m, spelled), source = parse_quantization(method, "quantization"), "default" if method is None else "argument"
        if spelled is not None and group_size is not None and spelled != group_size:
            raise ConfigError(f"quantization={method!r} and quant_group_size={group_size!r} disagree; give one")
        group_size = spelled if spelled is not None else group_size
    if not has_int4(m) and group_size is not None and m != "none":
        raise ConfigError(f"quant_group_size={group_size!r} applies to int4 only (quantization is {m!r}); "
                          f"int8 has one scale per output channel")
    if m == "none":
        why = f"{QUANT_ENV}={given}" if source == "env" else "no quantization requested"
        return Quantization("none", None, None, f"{why}: decode matrices as stored", source)
    if has_int4(m):
        if group_size is not None and (isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES):
            raise ConfigError(f"quant_group_size={group_size!r}; accepted: {', '.join(map(str, INT4_GROUP_SIZES))}"
                              f" (or None = {DEFAULT_GROUP_SIZE})")
        ks, fits = sorted(set(int(k) for k in ks)), int4_groups_fitting(ks)
        if group_size is not None and group_size not in fits:
            raise ConfigError(f"quant_group_size={group_size} does not divide the input width of every decode matrix "
                              f"(K = {ks}); accepted here: {', '.join(map(str, fits)) or 'none'}")
        if not fits:
            raise ConfigError(f"int4 needs a group size dividing every decode matrix's K = {ks}; none of "
                              f"{INT4_GROUP_SIZES} does: use int8")
        g = int(group_size) if group_size is not None else max(fits)
        gwhy = (f"group {g} (argument quant_group_size)" if group_size is not None else
                f"group {g} (default: scales are 6 % of the bytes read at 128, 20 % at 32)" if g == DEFAULT_GROUP_SIZE
                else f"group {g} (default 128 does not divide K = {ks}: the largest accepted size that does)")
    else:
        g, gwhy = None, "one scale per output channel"
    raw_act = ((settings.raw(ACT_ENV) or "") if act_env is None else act_env).strip().lower() or "auto"
    if raw_act not in ACTIVATION_MODES:
        raise ConfigError(f"{ACT_ENV}={raw_act!r}; accepted: {', '.join(ACTIVATION_MODES)}")
    act = AUTO_ACTIVATIONS["int4" if has_int4(m) else "int8"] if raw_act == "auto" else raw_act
    awhy = (f"{ACT_ENV}={raw_act}" if raw_act != "auto" else
            "int8 activations add ~0.55 % relative error: negligible next to int4 weights' ~10 %" if has_int4(m)
            else "int16 activations: ~0.005 % relative error (int8 ones would add ~0.55 %, doubling int8 weights' "
            "~0.8 %), exact integer dots at the integer path's speed (docs/kernels.md#activations-of-quantized-matrices)")
    mixed = len(set(QUANT_RECIPES[m])) > 1
    act8 = (AUTO_ACTIVATIONS["int8"] if raw_act == "auto" else raw_act) if mixed else None
    if mixed:
        gwhy += ("; the code predictor stays int8 (the vendor advises against quantizing it; GGUF ports ship a "
                 "q8_0 predictor with a q5_k talker; docs/quantization.md#recipes; int4-all quantizes it too)")
    src = f"{QUANT_ENV}={given}" if source == "env" else f"quantization={method!r}"
    raw_scales = (settings.raw(SCALES_ENV) or "").strip().lower() or DEFAULT_INT4_SCALES
    if raw_scales not in INT4_SCALES:
        raise ConfigError(f"{SCALES_ENV}={raw_scales!r}; accepted: {', '.join(INT4_SCALES)}")
    if has_int4(m):
        gwhy += (f"; int4 scales {raw_scales} ({SCALES_ENV})" if (settings.raw(SCALES_ENV) or "").strip() else
                 f"; int4 scales round to nearest (the default at load; least squares with {SCALES_ENV}=wls: c0 agreement "
                 f"0.789 -> 0.859 at group 32 on the confident 0.6B, Zen 4, at 20x the quantizing time; "
                 f"docs/quantization.md#int4-scales)")
    return Quantization(m, g, act, f"{src}: talker decode matrices quantized at load ({gwhy}); {awhy}", source,
                        int8_activations=act8, int4_scales=raw_scales)


def from_key(key: str, reason: str = "set by the client process") -> Quantization:
    """The :class:`Quantization` of :meth:`Quantization.key` (worker processes: no environment re-read)."""
    m, g, act, *rest = key.split("/")
    m = _parse_method(m, "quantization key")
    act8, scales = (rest + ["", "rtn"])[:2] if len(rest) < 2 else rest[:2]
    return Quantization(m, int(g) or None, act or None, reason, "client", int8_activations=act8 or None,
                        int4_scales=scales or "rtn")
