"""How code2wav's convs and small linears run (``models/code2wav_layers.py`` picks;
docs/kernels.md#code2wav-convolutions):

- :func:`conv1d_taps`: fp32, one BLAS GEMM per tap on shifted views of the input; for an output of at most 8
  columns (a 1-frame chunk's first blocks) one call of omnilab's GEMV kernel per tap instead, which reads the tap's
  matrix once at the machine's bandwidth where MKL's GEMM with a handful of columns does not;
- :func:`conv1d_fused`: bf16 weights, the taps side by side in one GEMM (fp32 accumulation);
- oneDNN's direct convolution (``F.conv1d``), called by the modules for long inputs;
- :func:`linear_rows`: the ConvNeXt blocks' pointwise linears, through the GEMV kernel for 1-8 rows (MKL's GEMM
  with 2-4 rows read those 16 MB matrices at a quarter of the kernel's speed here: 1024 x 4096, 4 rows, 2.7 vs
  0.44 ms).

The conv functions take x ``[B, Cin, Lp]`` (the streaming context already prepended) and return the valid outputs
``[B, Cout, Lp - (k-1)*dilation]``; batch rows are laid side by side so the weights are read once per call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnilab.kernels import gemv


def conv1d_taps(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1) -> torch.Tensor:
    """Valid (unpadded) conv as one GEMM per tap: x ``[B, Cin, Lp]``, taps ``[k, Cout, Cin]`` ->
    ``[B, Cout, Lp - (k-1)*dilation]``.

    Uses BLAS directly on strided views (no im2col copy, no per-call weight reorder as oneDNN does), which is
    faster than ``F.conv1d`` for the short inputs of streaming chunks (the modules switch to ``F.conv1d`` for long
    ones: tuning/code2wav_conv.py). Up to ``gemv.MAX_ROWS`` (8) outputs, omnilab's GEMV kernel runs the taps
    (``OMNILAB_CPU_GEMV``; torch there: the GEMMs). Batch rows are laid side by side so the weights are read once
    per call for the whole batch.
    """
    k = taps.shape[0]
    bsz, cin, lp = x.shape
    span = (k - 1) * dilation
    xf = x[0] if bsz == 1 else x.transpose(0, 1).reshape(cin, bsz * lp)  # [Cin, B*Lp]
    n = xf.shape[1] - span
    if gemv.fp32_kernel_rows(xf.T[:n], taps[0], bias):  # the output positions as the kernel's rows
        out = _taps_gemv(xf, taps, bias, dilation, n)
    else:
        out = torch.mm(taps[0], xf[:, :n]) if bias is None else torch.addmm(bias[:, None], taps[0], xf[:, :n])
        for j in range(1, k):
            out.addmm_(taps[j], xf[:, j * dilation:j * dilation + n])
    if bsz == 1:
        return out[None]
    return torch.stack([out[:, r * lp:r * lp + lp - span] for r in range(bsz)])


def conv1d_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                 dilation: int = 1) -> torch.Tensor:
    """Valid conv as ONE GEMM in ``weight``'s (low-precision) dtype: x ``[B, Cin, Lp]`` (fp32), weight ``[Cout,
    k*Cin]`` (column ``j*Cin + c`` = tap ``j`` of input channel ``c``) -> ``[B, Cout, Lp - (k-1)*dilation]`` in
    ``x``'s dtype (docs/kernels.md#code2wav-bf16).

    ``x`` is rounded to the weight dtype once and its ``k`` shifted views are stacked along K, so the whole tap
    sum accumulates in fp32 inside oneDNN and is rounded once (``conv1d_taps``' per-tap ``addmm_`` would round
    the partial sums to bf16 after every tap)."""
    bsz, cin, lp = x.shape
    span = (k - 1) * dilation
    xl = x.to(weight.dtype)
    xf = xl[0] if bsz == 1 else xl.transpose(0, 1).reshape(cin, bsz * lp)  # [Cin, B*Lp]
    n = xf.shape[1] - span
    xu = xf if k == 1 else torch.cat([xf[:, j * dilation:j * dilation + n] for j in range(k)], dim=0)  # [k*Cin, n]
    out = (torch.mm(weight, xu) if bias is None else torch.addmm(bias[:, None], weight, xu)).to(x.dtype)
    if bsz == 1:
        return out[None]
    return torch.stack([out[:, r * lp:r * lp + lp - span] for r in range(bsz)])


def _taps_gemv(xf: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, dilation: int, n: int) -> torch.Tensor:
    """The tap sum of :func:`conv1d_taps` for ``n`` <= 8 outputs: per tap, the ``n`` input columns as rows through the
    GEMV kernel (``[n, Cin] @ taps[j]^T``), summed in fp32 -> ``[Cout, n]``."""
    xt = xf.T  # [B*Lp, Cin]
    out = None
    for j in range(taps.shape[0]):
        y = gemv.gemv_rows(xt[j * dilation:j * dilation + n], taps[j], bias if j == 0 else None)  # [n, Cout]
        out = y if out is None else out.add_(y)
    return out.T.contiguous()


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` (fp32), through omnilab's GEMV kernel when ``x`` has 1..8 rows and the kernel is in use."""
    return gemv.gemv_rows(x, weight, bias) if gemv.fp32_kernel_rows(x, weight, bias) else F.linear(x, weight, bias)
