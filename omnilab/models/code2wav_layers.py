"""Building blocks of code2wav (the 12 Hz speech-tokenizer decoder), all causal and streamable.

Contract: every block that looks back in time takes ``(x, st)`` where ``st`` is a plain dict of
per-request state tensors (batch first) and updates its own entry in place:

- ``CausalConv1d``: left context of ``(k - 1) * dilation`` input samples. A fresh (zero) state is
  exactly the reference's left zero padding, so one code path serves offline and streaming.
- ``CausalConvTranspose1d`` with ``k == 2 * stride``: the previous input sample (the reference
  trims ``k - stride`` outputs on the right, so output ``t`` depends on inputs ``t // s`` and
  ``t // s - 1`` only). With ``k == stride`` there is no overlap and no state.
- ``DecoderAttention``: a key/value cache of the last ``sliding_window - 1`` frames (RoPE already
  applied at absolute positions). Query ``i`` sees key ``j`` iff ``0 <= pos_i - pos_j < window``.

State sizes are fixed by the geometry (``state_shapes``), so the cost of one chunk does not depend
on how many frames came before it. Parameter names equal the released ``decoder.*`` tensor names.
Derived tensors (exp of the Snake parameters, codebooks, regrouped transposed-conv weights) are
cached and recomputed when the source parameter changes (data pointer, version counter, dtype).
A conv whose weight is bf16 (``Code2Wav.set_compute_dtype``) takes fp32 input and returns fp32 through
one bf16 GEMM (``conv1d_fused``; docs/kernels.md#code2wav-bf16).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnilab.kernels.snake import snake_beta
from omnilab.models.conv_paths import conv1d_fused, conv1d_taps, linear_rows
from omnilab.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope
from omnilab.tuning.code2wav_conv import NEVER


def _tensor_key(*tensors: torch.Tensor) -> tuple | None:
    """Identity of parameter values for cache invalidation; ``None`` means 'cannot tell'."""
    key = []
    for t in tensors:
        try:
            key.append((t.data_ptr(), t._version, t.dtype, t.device))
        except RuntimeError:  # inference tensors have no version counter
            return None
    return tuple(key)


class _Derived:
    """Caches ``fn()`` until the source tensors change."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, fn, *sources: torch.Tensor):
        key = _tensor_key(*sources)
        if key is None or key != self.key:
            with torch.no_grad():
                self.value = fn()
            self.key = key
        return self.value


class StatefulModule(nn.Module):
    """A module that owns one entry of the streaming state; ``state_key`` is set by ``Code2Wav``."""
    state_key: str = ""

    def state_shape(self) -> tuple[int, ...] | None:
        """Per-request state shape without the batch dim, or ``None`` for no state."""
        return None


def set_direct_min_samples(root: nn.Module, min_samples: int) -> None:
    """Every fp32 conv under ``root`` runs as oneDNN's direct convolution from ``min_samples`` input samples
    (``Code2Wav.set_conv``; tuning/code2wav_conv.py)."""
    for m in root.modules():
        if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
            m.direct_min_samples = min_samples


class CausalConv1d(StatefulModule):
    """Conv1d (stride 1) padded on the left by ``(k - 1) * dilation``; released name ``<x>.conv``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.dilation = dilation
        self.context_samples = (kernel_size - 1) * dilation
        self.direct_min_samples = NEVER  # fp32: oneDNN's conv from this input length (Code2Wav.set_conv)
        self._taps, self._fused = _Derived(), _Derived()

    def state_shape(self):
        return (self.conv.in_channels, self.context_samples) if self.context_samples else None

    def drop_derived(self) -> None:
        """Forget the layouts derived from the weights (after a dtype change: no copy of the old ones kept alive)."""
        self._taps.__init__(), self._fused.__init__()

    def taps(self) -> torch.Tensor:  # [k, Cout, Cin] (a view of the weight when k == 1)
        w = self.conv.weight
        return self._taps.get(lambda: w.detach().permute(2, 0, 1).contiguous(), w)

    def fused(self) -> torch.Tensor:  # [Cout, k*Cin]: the low-precision layout (see conv1d_fused)
        w = self.conv.weight
        return self._fused.get(lambda: w.detach().permute(0, 2, 1).reshape(w.shape[0], -1).contiguous(), w)

    def forward(self, x: torch.Tensor, st: dict) -> torch.Tensor:  # [B, Cin, L] -> [B, Cout, L] (x's dtype)
        c = self.context_samples
        if c:
            x = torch.cat([st[self.state_key], x], dim=-1)
            st[self.state_key] = x[..., -c:].clone()
        if self.conv.groups != 1:
            return self.conv(x)
        if self.conv.weight.dtype != x.dtype:  # bf16 weights, fp32 activations: one bf16 GEMM
            return conv1d_fused(x, self.fused(), self.conv.bias, self.conv.kernel_size[0], self.dilation)
        if x.shape[-1] >= self.direct_min_samples:  # long input: oneDNN (tuning/code2wav_conv.py)
            return F.conv1d(x, self.conv.weight, self.conv.bias, dilation=self.dilation)
        return conv1d_taps(x, self.taps(), self.conv.bias, self.dilation)


class CausalConvTranspose1d(StatefulModule):
    """ConvTranspose1d(k, stride s) with the right ``k - s`` outputs trimmed; ``L`` in -> ``L * s`` out.

    Computed as a conv over ``[x[t-1], x[t]]`` (k = 2s) or ``x[t]`` (k = s) producing ``Cout * s``
    channels that are then interleaved, so no output is computed and thrown away.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        if kernel_size not in (stride, 2 * stride):
            raise ValueError(f"kernel_size {kernel_size} must be stride or 2 * stride ({stride})")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.overlap = kernel_size > stride
        self.direct_min_samples = NEVER  # as CausalConv1d's
        self._taps, self._fused, self._direct = _Derived(), _Derived(), _Derived()

    def state_shape(self):
        return (self.conv.in_channels, 1) if self.overlap else None

    def drop_derived(self) -> None:
        """As ``CausalConv1d.drop_derived``."""
        self._taps.__init__(), self._fused.__init__(), self._direct.__init__()

    def _tap_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        w, b, s = self.conv.weight, self.conv.bias, self.stride
        cin, cout, k = w.shape
        # row o*s + j of tap h holds w[c, o, h*s + j]; the h = 1 half multiplies x[t-1]
        t = w.detach().view(cin, cout, k // s, s).permute(2, 1, 3, 0).reshape(k // s, cout * s, cin)
        return t.flip(0).contiguous(), b.detach().repeat_interleave(s)

    def taps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps ``[k/s, Cout*s, Cin]``, bias ``[Cout*s]``); tap 0 applies to the oldest input."""
        return self._taps.get(self._tap_major, self.conv.weight, self.conv.bias)

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight ``[Cout*s, (k/s)*Cin]``, bias ``[Cout*s]``): the taps side by side (see conv1d_fused)."""
        def build():
            taps, bias = self._tap_major()
            return taps.permute(1, 0, 2).reshape(taps.shape[1], -1).contiguous(), bias
        return self._fused.get(build, self.conv.weight, self.conv.bias)

    def direct(self) -> torch.Tensor:
        """The taps as an ``F.conv1d`` weight ``[Cout*s, Cin, k/s]`` (tap 0 on the oldest input, as in ``taps``)."""
        return self._direct.get(lambda: self.taps()[0].permute(1, 2, 0).contiguous(), self.conv.weight)

    def forward(self, x: torch.Tensor, st: dict) -> torch.Tensor:  # [B, Cin, L] -> [B, Cout, L*s] (x's dtype)
        if self.overlap:
            x = torch.cat([st[self.state_key], x], dim=-1)
            st[self.state_key] = x[..., -1:].clone()
        if self.conv.weight.dtype != x.dtype:  # bf16 weights, fp32 activations: one bf16 GEMM
            w, bias = self.fused()
            y = conv1d_fused(x, w, bias, 2 if self.overlap else 1)  # [B, Cout*s, L]
        elif x.shape[-1] >= self.direct_min_samples:
            y = F.conv1d(x, self.direct(), self.taps()[1])  # [B, Cout*s, L]
        else:
            taps, bias = self.taps()
            y = conv1d_taps(x, taps, bias)  # [B, Cout*s, L]
        bsz, _, n = y.shape
        return y.view(bsz, -1, self.stride, n).transpose(2, 3).reshape(bsz, -1, n * self.stride)


class SnakeBeta(nn.Module):
    """``x + sin(exp(alpha) * x)^2 / (exp(beta) + 1e-9)`` per channel; alpha/beta are log-scale."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self._coef = _Derived()

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:  # each [C, 1]
        def build():
            a = self.alpha.detach()
            return torch.exp(a)[:, None], (1.0 / (torch.exp(self.beta.detach()) + 1e-9))[:, None]
        return self._coef.get(build, self.alpha, self.beta)

    def forward(self, x: torch.Tensor, st: dict | None = None, inplace: bool = False) -> torch.Tensor:  # [B, C, L]
        a, inv_b = self.coefficients()
        return snake_beta(x, a, inv_b, inplace)  # one fused pass where omnilab's kernel applies


class ResidualUnit(nn.Module):
    """``x + conv2(snake(conv1(snake(x))))`` with conv1 = causal k7 dilated, conv2 = k1."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        h = self.conv1(self.act1(x), st)
        h = self.conv2(self.act2(h, inplace=True), st)  # h is a fresh conv output
        return h.add_(x)


class DecoderBlock(nn.Module):
    """SnakeBeta -> causal ConvTranspose (k = 2r, stride r) -> residual units with dilation 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
                                   + [ResidualUnit(out_dim, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        for m in self.block:
            x = m(x, st)
        return x


class ConvNeXtBlock(nn.Module):
    """Causal depthwise k7 -> LayerNorm(1e-6) -> Linear x4 -> GELU -> Linear -> * gamma -> + x."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, st: dict) -> torch.Tensor:  # [B, C, L]
        h = self.dwconv(x, st).transpose(1, 2)  # [B, L, C]
        h = F.gelu(linear_rows(self.norm(h), self.pwconv1.weight, self.pwconv1.bias))  # 1-8 rows: GEMV kernel
        h = linear_rows(h, self.pwconv2.weight, self.pwconv2.bias)
        return x + (self.gamma * h).transpose(1, 2)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class DecoderAttention(StatefulModule):
    """Multi-head attention (no q/k norm, no bias) over a sliding window, with a KV cache."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int, bias: bool):
        super().__init__()
        if heads != kv_heads:
            raise ValueError(f"code2wav attention expects num_key_value_heads == num_attention_heads "
                             f"({kv_heads} != {heads})")
        self.heads, self.head_dim, self.window = heads, head_dim, window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def state_shape(self):
        # keys and values stacked: [2, heads, window - 1, head_dim]
        return (2, self.heads, self.window - 1, self.head_dim)

    def forward(self, x, cos, sin, mask, st):  # x [B, F, D]; mask [B, 1, F, window - 1 + F] bool
        bsz, n, _ = x.shape
        shape = (bsz, n, self.heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, H, F, hd]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        cache = st[self.state_key]  # [B, 2, H, W-1, hd]
        k = torch.cat([cache[:, 0], k], dim=2)  # [B, H, W-1+F, hd]
        v = torch.cat([cache[:, 1], v], dim=2)
        keep = self.window - 1
        st[self.state_key] = torch.stack([k[:, :, -keep:], v[:, :, -keep:]], dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, F, hd]
        return self.o_proj(o.transpose(1, 2).reshape(bsz, n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = DecoderAttention(d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                          cfg.sliding_window, cfg.attention_bias)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(d, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(d, cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask, st):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, st))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class DecoderTransformer(nn.Module):
    """``input_proj`` (latent -> hidden) -> sliding-window layers -> RMSNorm -> ``output_proj``."""

    def __init__(self, cfg):
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: torch.Tensor, frames_done: torch.Tensor, st: dict) -> torch.Tensor:
        """x ``[B, F, latent]``; ``frames_done`` ``[B]`` long = absolute position of ``x[:, 0]``."""
        bsz, n, _ = x.shape
        steps = torch.arange(n, device=x.device)
        positions = frames_done[:, None] + steps  # [B, F]
        h = self.input_proj(x)
        cos, sin = self.rotary_emb(positions, h.dtype)
        keep = self.window - 1
        j = torch.arange(keep + n, device=x.device)  # key slot; its position is frames_done - keep + j
        i = steps[:, None]
        band = (j >= i) & (j <= i + keep)  # [F, W-1+F]: 0 <= pos_q - pos_k < window
        valid = j[None, :] >= (keep - frames_done)[:, None]  # [B, W-1+F]: pos_k >= 0
        mask = (band[None] & valid[:, None, :])[:, None]  # [B, 1, F, W-1+F]
        for layer in self.layers:
            h = layer(h, cos, sin, mask, st)
        return self.output_proj(self.norm(h))


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))
        self._table = _Derived()

    def table(self) -> torch.Tensor:  # [size, dim] = embedding_sum / clamp(cluster_usage, eps)
        return self._table.get(
            lambda: self.embedding_sum.detach() / self.cluster_usage.detach().clamp(min=self.eps)[:, None],
            self.embedding_sum, self.cluster_usage)


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, size)


class _VQStack(nn.Module):
    def __init__(self, n: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList([_VQ(dim, size) for _ in range(n)])


class ResidualVQ(nn.Module):
    """Sum of codebook rows (in codebook order) -> 1x1 ``output_proj``. ``input_proj`` is encode-only."""

    def __init__(self, n: int, dim: int, io_dim: int, size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = _VQStack(n, dim, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, n, T] -> [B, io_dim, T]
        q = None
        for k, layer in enumerate(self.vq.layers):
            e = F.embedding(codes[:, k], layer._codebook.table())  # [B, T, dim]
            q = e if q is None else q + e
        return self.output_proj(q.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    """Codebook 0 (semantic) through ``rvq_first``, codebooks 1.. through ``rvq_rest``; outputs added."""

    def __init__(self, num_quantizers: int, codebook_dim: int, codebook_size: int, num_semantic: int = 1):
        super().__init__()
        self.num_semantic = num_semantic
        self.rvq_first = ResidualVQ(num_semantic, codebook_dim // 2, codebook_dim, codebook_size)
        self.rvq_rest = ResidualVQ(num_quantizers - num_semantic, codebook_dim // 2, codebook_dim, codebook_size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, 16, T] -> [B, codebook_dim, T]
        return self.rvq_first.decode(codes[:, :self.num_semantic]) + self.rvq_rest.decode(codes[:, self.num_semantic:])
