"""ECAPA-TDNN speaker encoder of the Base models: log-mel ``[B, T, 128]`` -> x-vector ``[B, enc_dim]``.

Contract:
- Parameter names equal the released ``speaker_encoder.*`` tensors with that prefix stripped (docs/model.md#tensor-names-and-prefix-stripping),
  so ``load_state_dict(strict=True)`` works on a Base ``model.safetensors`` slice.
- Numerics follow the reference ``Qwen3TTSSpeakerEncoder``: every conv is "same"-length with **reflect**
  padding (left = dilation*(k-1)//2), TDNN = conv + ReLU, SE-Res2Net blocks with a residual add, multi-layer
  feature aggregation over blocks 1..3, attentive statistics pooling (global mean/std context, tanh, softmax
  over time, std clamped at 1e-12 before sqrt), final 1x1 conv. No padding masks: one utterance per row.
- ``embed_audio(wav_24k)`` runs the reference mel front end (``omnilab.audio.log_mel_spectrogram``) and returns
  ``[enc_dim]``, the x-vector the talker puts into its speaker slot.
- ``init_random_(model, generator)``: deterministic, variance-preserving random weights (x-vector entries O(1)).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnilab.audio import log_mel_spectrogram
from omnilab.config import SAMPLE_RATE, SpeakerEncoderConfig
from omnilab.errors import ConfigError, InputError


class _TDNN(nn.Module):
    """Conv1d with reflect "same" padding, then ReLU. Parameters: ``conv.{weight,bias}``."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel_size, dilation=dilation)
        total = dilation * (kernel_size - 1)
        self.pad = (total // 2, total - total // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C', T]
        if self.pad[0] or self.pad[1]:
            if x.shape[-1] <= max(self.pad):
                raise InputError(f"speaker encoder input has {x.shape[-1]} frames; reflect padding needs more than "
                                 f"{max(self.pad)} (use at least ~0.1 s of audio)")
            x = F.pad(x, self.pad, mode="reflect")
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    """Split channels into ``scale`` groups; group 0 passes through, group i>0 gets TDNN(x_i + y_{i-1})."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(
            _TDNN(channels // scale, channels // scale, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        y = None
        for i in range(1, self.scale):
            y = self.blocks[i - 1](parts[i] if i == 1 else parts[i] + y)
            outs.append(y)
        return torch.cat(outs, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1)
        self.conv2 = nn.Conv1d(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        s = x.mean(dim=2, keepdim=True)  # [B, C, 1]
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(s))))
        return x * s


class _SERes2NetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, scale: int, se_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        if in_ch != out_ch:
            raise ConfigError(f"speaker encoder: SE-Res2Net residual needs equal channels; got {in_ch}->{out_ch}")
        if out_ch % scale:
            raise ConfigError(f"speaker encoder: channels {out_ch} not divisible by enc_res2net_scale {scale}")
        self.tdnn1 = _TDNN(in_ch, out_ch, 1, 1)
        self.res2net_block = _Res2Net(out_ch, scale, kernel_size, dilation)
        self.tdnn2 = _TDNN(out_ch, out_ch, 1, 1)
        self.se_block = _SqueezeExcite(out_ch, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _mean_std(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean and std over time. x ``[B, C, T]``, w ``[B, 1 or C, T]`` summing to 1 over T."""
    mean = (w * x).sum(dim=2)
    var = (w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, torch.sqrt(var.clamp(min=eps))


class _AttentiveStatsPool(nn.Module):
    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = _TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, 2C, 1]
        t = x.shape[-1]
        uniform = torch.full((x.shape[0], 1, t), 1.0 / t, dtype=x.dtype, device=x.device)
        mean, std = _mean_std(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)  # [B, C, T]
        mean, std = _mean_std(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN. ``forward(mels [B, T, mel_dim]) -> [B, enc_dim]``.

    Args:
        cfg: ``SpeakerEncoderConfig`` (``speaker_encoder_config`` of a Base ``config.json``).
    """

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        ch, ks, dil = tuple(cfg.enc_channels), tuple(cfg.enc_kernel_sizes), tuple(cfg.enc_dilations)
        if not (len(ch) == len(ks) == len(dil)) or len(ch) < 3:
            raise ConfigError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations must have "
                              f"the same length (>= 3); got {len(ch)}, {len(ks)}, {len(dil)}")
        if cfg.sample_rate != SAMPLE_RATE:
            raise ConfigError(f"speaker_encoder_config: sample_rate {cfg.sample_rate}; only {SAMPLE_RATE} is supported")
        self.cfg = cfg
        self.blocks = nn.ModuleList([_TDNN(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(_SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels,
                                               ks[i], dil[i]))
        mfa_in = sum(ch[1:-1])
        if mfa_in != ch[-1]:
            raise ConfigError(f"speaker_encoder_config: enc_channels[-1] {ch[-1]} must equal the sum of the "
                              f"SE-Res2Net block widths {mfa_in} (the released checkpoint has 3 x 512 = 1536)")
        self.mfa = _TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = _AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        if mels.ndim != 3 or mels.shape[-1] != self.cfg.mel_dim:
            raise InputError(f"speaker encoder expects mels [B, T, {self.cfg.mel_dim}]; got {tuple(mels.shape)}")
        h = mels.transpose(1, 2)  # [B, mel_dim, T]
        feats = []
        for block in self.blocks:
            h = block(h)
            feats.append(h)
        h = self.mfa(torch.cat(feats[1:], dim=1))  # [B, C_last, T]
        return self.fc(self.asp(h)).squeeze(-1)  # [B, enc_dim]

    @torch.inference_mode()
    def embed_audio(self, wav_24k: np.ndarray | torch.Tensor) -> torch.Tensor:
        """x-vector of one mono 24 kHz utterance ``[samples]`` -> ``[enc_dim]`` (float32)."""
        if isinstance(wav_24k, torch.Tensor):
            wav_24k = wav_24k.detach().cpu()
        wav = torch.as_tensor(np.asarray(wav_24k, dtype=np.float32))
        if wav.ndim != 1:
            raise InputError(f"embed_audio expects one mono utterance [samples]; got shape {tuple(wav.shape)}")
        p = next(self.parameters())
        mels = log_mel_spectrogram(wav).to(device=p.device, dtype=p.dtype)  # [1, frames, 128]
        return self(mels)[0].float()


def init_random_(model: SpeakerEncoder, generator: torch.Generator) -> SpeakerEncoder:
    """Deterministic random weights: conv weights ~ N(0, gain^2 / fan_in), biases ~ N(0, 0.01^2).

    ReLU convs use gain sqrt(2) (He init); the SE gate, attention and final convs use gain 1. The network is
    nearly scale-homogeneous, so the x-vector scales with the log-mel input (rms ~3-12, mostly negative); the
    first conv gets an extra 1/10 so the x-vector rms is ~1-2 for speech-like input (~5 for silence). No
    parameter is small enough to produce fp32 denormals.
    """
    relu_convs = {id(m.conv) for m in model.modules() if isinstance(m, _TDNN)}
    first_conv = model.blocks[0].conv
    with torch.no_grad():
        for name, mod in sorted(model.named_modules(), key=lambda kv: kv[0]):
            if not isinstance(mod, nn.Conv1d):
                continue
            fan_in = mod.in_channels * mod.kernel_size[0]
            gain = math.sqrt(2.0) if id(mod) in relu_convs else 1.0
            if mod is first_conv:
                gain *= 0.1
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=generator) * (gain / math.sqrt(fan_in)))
            mod.bias.copy_(torch.randn(mod.bias.shape, generator=generator) * 0.01)
    return model
