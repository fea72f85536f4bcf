"""Mimi encoder of the 12 Hz speech tokenizer (Base ICL voice cloning): 24 kHz audio -> codes ``[B, T, 16]``.

Contract:
- ``MimiEncoder(encoder_config)`` takes the ``encoder_config`` dict of ``speech_tokenizer/config.json`` (a
  transformers ``MimiConfig``; missing keys take MimiConfig's defaults, as the reference does). Its state_dict
  keys equal the released ``encoder.*`` tensors with ``encoder.`` stripped: transformers ``MimiModel`` names
  minus the decoder parts the reference deletes (``upsample``, ``decoder_transformer``, ``decoder``). The
  quantizer keeps all ``num_quantizers`` (32) codebooks with their persistent EMA buffers ``initialized``,
  ``cluster_usage``, ``embed_sum`` and the unused ``output_proj`` weights, so ``load_state_dict(strict=True)``
  works on a real checkpoint.
- ``encode(wav [B, samples], lengths_samples=None) -> codes [B, T, 16]`` (int64) reproduces
  ``Qwen3TTSTokenizerV2Model.encode``: the right-padded batch goes through the SEANet encoder (causal convs),
  the encoder transformer, the stride-2 downsample (replicate padding) and the split RVQ (1 semantic + 31
  acoustic quantizers, each RVQ with its own 1x1 ``input_proj``); only the first ``valid_num_quantizers`` codes
  are kept, and row b keeps ``ceil(lengths_samples[b] / samples_per_frame)`` frames (1920 samples per frame
  for the 12 Hz codec). ``T`` is the longest row's count; shorter rows are filled with -1.
- Encoder transformer: pre-LayerNorm (with bias), RoPE (theta ``rope_theta``, rotate-half), MHA, GELU MLP
  (fc1/fc2, no bias), LayerScale on both residual branches. The reference (transformers 4.57) builds a plain
  causal mask here and ignores ``sliding_window`` (250 frames = 20 s); we do the same by default. Pass
  ``use_sliding_window=True`` for the windowed variant (query i sees keys j with 0 <= i - j < window).
- ``init_random_(model, generator)``: deterministic, variance-preserving weights; codebooks ``embed_sum`` ~ N(0,1),
  ``cluster_usage`` = 1, ``initialized`` = 1, so random audio gives varied codes.
The transformer and quantizer building blocks live in ``omnilab.models.mimi_layers``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnilab.config import NUM_CODE_GROUPS
from omnilab.errors import ConfigError, InputError, UnsupportedError
from omnilab.models.mimi_layers import (_ACTS, _MLP, _RVQ, _VQ, _Attention, _Codebook,  # noqa: F401
                                        _LayerScale, _SplitRVQ, _Transformer, _TransformerLayer)


@dataclass(frozen=True)
class MimiEncoderConfig:
    """The MimiConfig fields the encoder path reads. Defaults are transformers' MimiConfig defaults."""
    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 250
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    frame_rate: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MimiEncoderConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        if kw.get("frame_rate") is None and d.get("_frame_rate") is not None:
            kw["frame_rate"] = d["_frame_rate"]
        if kw.get("head_dim", 0) is None:
            kw.pop("head_dim")
        if kw.get("codebook_dim", 0) is None:  # MimiConfig: codebook_dim defaults to hidden_size
            kw["codebook_dim"] = kw.get("hidden_size", 512)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def encodec_frame_rate(self) -> int:
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def effective_frame_rate(self) -> float:
        if self.frame_rate is not None:
            return float(self.frame_rate)
        return self.sampling_rate / (math.prod(self.upsampling_ratios) * 2)

    @property
    def has_downsample(self) -> bool:
        return self.effective_frame_rate != self.encodec_frame_rate

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * (2 if self.has_downsample else 1)

    def validate(self) -> None:
        w = "speech_tokenizer encoder_config"
        if self.audio_channels != 1:
            raise UnsupportedError(f"{w}: audio_channels {self.audio_channels}; only mono (1) is supported")
        if self.pad_mode not in ("constant", "replicate"):
            raise UnsupportedError(f"{w}: pad_mode {self.pad_mode!r}; accepted: constant, replicate")
        if self.hidden_act not in _ACTS:
            raise UnsupportedError(f"{w}: hidden_act {self.hidden_act!r}; accepted: {', '.join(_ACTS)}")
        if not isinstance(self.residual_kernel_size, int):
            raise UnsupportedError(f"{w}: residual_kernel_size must be an int; got {self.residual_kernel_size!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{w}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if not 1 <= self.num_semantic_quantizers < self.num_quantizers:
            raise ConfigError(f"{w}: need 1 <= num_semantic_quantizers < num_quantizers; got "
                              f"{self.num_semantic_quantizers} and {self.num_quantizers}")


# ------------------------------------------------------------------------------------------ SEANet encoder

class _CausalConv(nn.Module):
    """MimiConv1d: pads so that ``out_len = ceil(in_len / stride)``; parameters ``conv.{weight,bias}``."""

    def __init__(self, cfg: MimiEncoderConfig, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, bias: bool = True, pad_mode: str | None = None):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel_size, stride, dilation=dilation, bias=bias)
        self.causal = cfg.use_causal_conv
        self.pad_mode = pad_mode or cfg.pad_mode
        self.k_eff = (kernel_size - 1) * dilation + 1
        self.stride = stride
        self.pad_total = self.k_eff - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        length = x.shape[-1]
        n_frames = math.ceil((length - self.k_eff + self.pad_total) / self.stride + 1) - 1
        extra = n_frames * self.stride + self.k_eff - self.pad_total - length
        if self.causal:
            left, right = self.pad_total, extra
        else:
            right0 = self.pad_total // 2
            left, right = self.pad_total - right0, right0 + extra
        return self.conv(_pad1d(x, left, right, self.pad_mode))


def _pad1d(x: torch.Tensor, left: int, right: int, mode: str) -> torch.Tensor:
    return F.pad(x, (left, right)) if mode == "constant" else F.pad(x, (left, right), mode=mode)


class _ResBlock(nn.Module):
    """SEANet residual unit: ``x + conv1x1(elu(conv_k(elu(x))))``; parameters ``block.{1,3}.conv.*``."""

    def __init__(self, cfg: MimiEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), _CausalConv(cfg, dim, hidden, cfg.residual_kernel_size, dilation=dilation),
            nn.ELU(), _CausalConv(cfg, hidden, dim, 1)])
        self.shortcut = _CausalConv(cfg, dim, dim, 1) if cfg.use_conv_shortcut else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return self.shortcut(x) + h


class _SEANetEncoder(nn.Module):
    """``[B, 1, samples]`` -> ``[B, hidden, samples / prod(ratios)]``. ``layers.{i}`` indices match MimiEncoder."""

    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [_CausalConv(cfg, cfg.audio_channels, cfg.num_filters, cfg.kernel_size)]
        mult = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = mult * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(_ResBlock(cfg, dim, cfg.dilation_growth_rate ** j))
            layers += [nn.ELU(), _CausalConv(cfg, dim, dim * 2, ratio * 2, stride=ratio)]
            mult *= 2
        layers += [nn.ELU(), _CausalConv(cfg, mult * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------------------------------------ model

class MimiEncoder(nn.Module):
    """Args:
        encoder_config: ``speech_tokenizer/config.json`` ``encoder_config`` dict (or a ``MimiEncoderConfig``).
        valid_num_quantizers: codes kept per frame (``encoder_valid_num_quantizers``, 16).
        use_sliding_window: apply the ``sliding_window`` mask in the transformer (the reference does not).
    """

    def __init__(self, encoder_config: Mapping[str, Any] | MimiEncoderConfig,
                 valid_num_quantizers: int = NUM_CODE_GROUPS, use_sliding_window: bool = False):
        super().__init__()
        cfg = encoder_config if isinstance(encoder_config, MimiEncoderConfig) else \
            MimiEncoderConfig.from_dict(encoder_config)
        if not cfg.num_semantic_quantizers <= valid_num_quantizers <= cfg.num_quantizers:
            raise ConfigError(f"encoder_valid_num_quantizers {valid_num_quantizers} must lie in "
                              f"[{cfg.num_semantic_quantizers}, {cfg.num_quantizers}]")
        self.cfg = cfg
        self.valid_num_quantizers = valid_num_quantizers
        self.window = cfg.sliding_window if use_sliding_window else None
        self.encoder = _SEANetEncoder(cfg)
        self.encoder_transformer = _Transformer(cfg)
        self.downsample = None
        if cfg.has_downsample:
            k = 2 * int(cfg.encodec_frame_rate / cfg.effective_frame_rate)
            self.downsample = _CausalConv(cfg, cfg.hidden_size, cfg.hidden_size, k, stride=2, bias=False,
                                          pad_mode="replicate")
        self.quantizer = _SplitRVQ(cfg)

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    def latents(self, wav: torch.Tensor) -> torch.Tensor:
        """``[B, samples]`` -> pre-quantizer latents ``[B, hidden, frames]``."""
        h = self.encoder(wav[:, None, :])  # [B, hidden, samples / 960]
        h = self.encoder_transformer(h.transpose(1, 2), self.window).transpose(1, 2)
        return self.downsample(h) if self.downsample is not None else h

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor, lengths_samples: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded mono 24 kHz batch ``[B, samples]`` (or ``[samples]``) -> codes ``[B, T, 16]`` int64.

        ``lengths_samples[b]`` is the valid length of row b (default: all of it); row b keeps
        ``ceil(lengths_samples[b] / samples_per_frame)`` frames and is -1 after that.
        """
        wav = torch.as_tensor(wav)
        if wav.ndim == 1:
            wav = wav[None]
        if wav.ndim != 2 or wav.shape[-1] == 0:
            raise InputError(f"MimiEncoder.encode expects [B, samples] with samples > 0; got {tuple(wav.shape)}")
        p = next(self.parameters())
        wav = wav.to(device=p.device, dtype=p.dtype)
        b, n = wav.shape
        lengths = torch.full((b,), n) if lengths_samples is None else torch.as_tensor(lengths_samples).reshape(-1)
        if lengths.numel() != b or bool((lengths < 0).any()) or bool((lengths > n).any()):
            raise InputError(f"lengths_samples must hold {b} values in [0, {n}]; got {lengths.tolist()}")
        frames = -(-lengths.long() // self.samples_per_frame)  # ceil
        codes = self.quantizer.encode(self.latents(wav), self.valid_num_quantizers)  # [B, nq, T_all]
        codes = codes[:, :, : int(frames.max())].transpose(1, 2).contiguous()  # [B, T, nq]
        valid = torch.arange(codes.shape[1], device=codes.device)[None, :] < frames.to(codes.device)[:, None]
        return codes.masked_fill(~valid[:, :, None], -1)

    def encode_list(self, wavs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Mono 24 kHz waveforms -> one ``[T_i, 16]`` tensor each, batched like the reference (zero right-pad)."""
        wavs = [torch.as_tensor(w, dtype=torch.float32).reshape(-1) for w in wavs]
        if not wavs:
            return []
        n = max(w.shape[0] for w in wavs)
        batch = torch.stack([F.pad(w, (0, n - w.shape[0])) for w in wavs])
        codes = self.encode(batch, [w.shape[0] for w in wavs])
        return [c[: -(-w.shape[0] // self.samples_per_frame)] for c, w in zip(codes, wavs)]


def init_random_(model: MimiEncoder, generator: torch.Generator) -> MimiEncoder:
    """Deterministic random weights (variance preserving); codebooks ``embed_sum`` ~ N(0, 1), usage 1.

    Conv/linear weights ~ N(0, gain^2 / fan_in) with gain sqrt(2) before ELU layers and 1 elsewhere, biases 0,
    LayerNorm (1, 0), LayerScale = ``layer_scale_initial_scale``. With zero biases the latents scale with the
    input level: audio at 0.1-0.4 RMS gives quantizer inputs with std ~2-4 against N(0, 1) codebooks, so codes
    vary from frame to frame (silence gives constant codes).
    """
    def normal_(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=generator) * std)

    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Conv1d):
                fan_in = mod.in_channels // mod.groups * mod.kernel_size[0]
                gain = 1.0 if name.startswith(("quantizer", "downsample")) else math.sqrt(2.0)
                normal_(mod.weight, gain / math.sqrt(fan_in))
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.Linear):
                normal_(mod.weight, 1.0 / math.sqrt(mod.in_features))
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.fill_(1.0)
                mod.bias.zero_()
            elif isinstance(mod, _LayerScale):
                mod.scale.fill_(model.cfg.layer_scale_initial_scale)
            elif isinstance(mod, _Codebook):
                normal_(mod.embed_sum, 1.0)
                mod.cluster_usage.fill_(1.0)
                mod.initialized.fill_(1.0)
    return model
