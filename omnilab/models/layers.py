"""Small building blocks shared by the talker, the code predictor and code2wav.

Numerics follow the reference (transformers Qwen3): RMSNorm computes in fp32 and multiplies by
the weight after casting back; RoPE tables are built in fp32 and cast to the activation dtype;
rotate-half convention.
"""
from __future__ import annotations

import torch
from torch import nn

from omnilab.kernels import linear
from omnilab.kernels.norm import rms_norm
from omnilab.kernels.stack import swiglu, swiglu_pair
from omnilab.tuning.fuse import FusedProjection


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward is :func:`omnilab.kernels.linear`: decoding
    batches of 4..8 rows stream the weights once instead of MKL's ~half-bandwidth small GEMM."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # omnilab.kernels.norm: one kernel call, or the reference's ops


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the released tensor names."""

    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self._gate_up = FusedProjection()  # gate/up in one kernel call at decode (omnilab.tuning.fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Functional calls (no nn.Module __call__): the per-op overhead matters at batch 1. The activation is
        # omnilab.kernels.stack's (one pass over the fused output where there is one), as on the decode step.
        gu = self._gate_up.output(x, (self.gate_proj, self.up_proj))
        if gu is not None:
            act = swiglu(gu, self.gate_proj.weight.shape[0])
        else:
            act = swiglu_pair(linear(x, self.gate_proj.weight, self.gate_proj.bias),
                              linear(x, self.up_proj.weight, self.up_proj.bias))
        down = self.down_proj
        return linear(act, down.weight, down.bias)


class RotaryEmbedding(nn.Module):
    """Plain 1-D RoPE. ``forward(positions [B, T]) -> (cos, sin)`` each ``[B, T, head_dim]``."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)
        freqs = (inv @ positions[:, None, :].float()).transpose(1, 2)  # [B, T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k: ``[B, heads, T, head_dim]``; cos, sin: ``[B, T, head_dim]``."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
