"""code2wav: the Qwen3-TTS 12 Hz speech-tokenizer decoder, codes ``[B, 16, T]`` -> wav ``[B, 1, T * 1920]``.

Contract:
- ``Code2Wav(cfg)`` has the released parameter names of ``speech_tokenizer/model.safetensors`` with
  the ``decoder.`` prefix stripped, so ``load_state_dict(strict=True)`` takes a real checkpoint.
- ``forward(codes)`` is the reference ``Qwen3TTSTokenizerV2Decoder.forward``: one causal pass over
  the whole input (computed internally in blocks of ``block_frames`` through the exact streaming
  path, so memory stays bounded), output clamped to [-1, 1], 24 kHz, 1920 samples per frame.
- ``decode(codes, chunk_frames=300, left_context_frames=25)`` is the reference ``chunked_decode``:
  each chunk is decoded from scratch with up to 25 frames of recomputed left context (RoPE
  positions restart per chunk). For ``T <= chunk_frames`` it equals ``forward``.
- Streaming: ``start_stream(batch_size) -> Code2WavState``; ``decode_chunk(state, codes [B, 16, F])
  -> [B, 1, F * 1920]``. The decoder is fully causal and the state is exact (conv left contexts,
  previous transposed-conv input, sliding-window KV caches at absolute positions), so any chunking
  gives ``forward`` of the whole utterance up to fp rounding, and a chunk's cost does not depend on
  the frames before it. ``decode_chunks`` batches several streams (see ``code2wav_stream``).
- Codes: integer tensors. Negative codes are padding and are clamped to 0, as the reference
  tokenizer's ``decode`` does (output keeps full length; trimming padded frames is the caller's
  job). Codes >= ``codebook_size`` raise ``InputError``.
- Inference only: every public method runs under ``torch.no_grad()``.
- Precision: fp32 by default. ``set_compute_dtype(torch.bfloat16)`` runs the GEMMs of the conv decoder
  blocks (each block's transposed conv and residual-unit convs, ~90 % of the FLOPs) in bf16 with fp32
  accumulation; the quantizer, pre-conv, transformer, upsamplers, first and last conv, SnakeBeta, residual
  sums, the streaming state and the output stay fp32 (docs/kernels.md#code2wav-bf16).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from omnilab.config import Code2WavConfig
from omnilab.errors import InputError
from omnilab.kernels import gemv
from omnilab.models.code2wav_layers import (
    CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, DecoderBlock, DecoderTransformer, EuclideanCodebook,
    LayerScale, ResidualUnit, SnakeBeta, SplitResidualVQ, StatefulModule, set_direct_min_samples,
)
from omnilab.models.code2wav_stream import ChunkSchedule, Code2WavState, decode_chunks
from omnilab.tuning.code2wav_conv import Code2WavConv, conv_choice

__all__ = ["Code2Wav", "Code2WavState", "ChunkSchedule", "init_random_"]


class Code2Wav(nn.Module):
    """The 12 Hz codec decoder (RVQ -> causal conv -> sliding-window transformer -> upsamplers ->
    SnakeBeta conv decoder).

    Args:
        cfg: ``speech_tokenizer/config.json`` ``decoder_config``.
        block_frames: frames per internal pass in ``forward``/``decode_chunk`` (bounds activation
            memory; results do not depend on it beyond fp rounding).
    """

    def __init__(self, cfg: Code2WavConfig, block_frames: int = 25):
        super().__init__()
        self.cfg = cfg
        self.block_frames = block_frames
        self.samples_per_frame = math.prod(tuple(cfg.upsample_rates) + tuple(cfg.upsampling_ratios))
        self.quantizer = SplitResidualVQ(cfg.num_quantizers, cfg.codebook_dim, cfg.codebook_size,
                                         cfg.num_semantic_quantizers)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = DecoderTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)])
            for r in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)])
        # input samples per frame of each decoder stage, and its time tile (frames; None = whole block)
        rate = math.prod(cfg.upsampling_ratios)
        rates = [rate * math.prod(cfg.upsample_rates[:i]) for i in range(len(cfg.upsample_rates) + 1)]
        self._stage_rate = [rate] + rates + [rates[-1]]  # [4, 4, 32, 160, 640, 1920, 1920]
        # Optional time tiling of the conv decoder stages (e.g. (None, None, 5, 2, 1, 1, 1)); exact, but on
        # the 2-core dev machine it measured no faster than whole blocks and worse under CPU contention.
        self.tile_frames: tuple[int | None, ...] = (None,) * len(self.decoder)
        self._state_shapes: dict[str, tuple[int, ...]] = {}
        for name, m in self.named_modules():
            if isinstance(m, StatefulModule) and m.state_shape() is not None:
                m.state_key = name
                self._state_shapes[name] = m.state_shape()
        self.set_conv()  # the fp32 conv path: OMNILAB_CODE2WAV_CONV's (set_conv again to change it)

    # ------------------------------------------------------------------ core pass
    def _run(self, codes: torch.Tensor, st: dict, frames_done: torch.Tensor) -> torch.Tensor:
        """One block: codes ``[B, 16, F]`` (validated) -> wav ``[B, 1, F * spf]``; updates ``st``."""
        h = self.quantizer.decode(codes)  # [B, codebook_dim, F]
        h = self.pre_conv(h, st)  # [B, latent, F]
        h = self.pre_transformer(h.transpose(1, 2), frames_done, st).transpose(1, 2)  # [B, latent, F]
        for tconv, convnext in self.upsample:
            h = convnext(tconv(h, st), st)  # [B, latent, F * prod(ratios so far)]
        return self._conv_decoder(0, h, st).clamp_(-1.0, 1.0)  # [B, 1, F * spf]

    def _conv_decoder(self, k: int, x: torch.Tensor, st: dict) -> torch.Tensor:
        """Stages ``decoder[k:]`` on ``x``, stage ``k`` split in time tiles of ``tile_frames[k]``
        frames (exact: the conv state carries across tiles); keeps high-rate activations in cache."""
        if k == len(self.decoder):
            return x
        tile = self.tile_frames[k] if k < len(self.tile_frames) else None
        if tile is None:
            return self._conv_decoder(k + 1, self.decoder[k](x, st), st)
        tile_samples = tile * self._stage_rate[k]
        if x.shape[-1] <= tile_samples:
            return self._conv_decoder(k + 1, self.decoder[k](x, st), st)
        return torch.cat([self._conv_decoder(k + 1, self.decoder[k](p, st), st)
                          for p in x.split(tile_samples, dim=-1)], dim=-1)

    def _decode_stream(self, codes: torch.Tensor, st: dict, frames_done: torch.Tensor) -> torch.Tensor:
        """Run ``codes`` through state ``st`` (dict, updated in place) in blocks of ``block_frames``."""
        codes = self._check_codes(codes)
        n = codes.shape[-1]
        if n == 0:
            return torch.zeros(codes.shape[0], 1, 0, dtype=self._dtype(), device=codes.device)
        outs = []
        for start in range(0, n, self.block_frames):
            end = min(start + self.block_frames, n)
            outs.append(self._run(codes[..., start:end], st, frames_done + start))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex():
            raise InputError("codes must be an integer tensor [B, 16, T]")
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers:
            raise InputError(f"codes must have shape [B, {self.cfg.num_quantizers}, T]; got {tuple(codes.shape)}")
        if codes.numel() and int(codes.max()) >= self.cfg.codebook_size:
            raise InputError(f"codes must be < codebook_size {self.cfg.codebook_size}; got max {int(codes.max())}")
        return codes.long().clamp(min=0)

    def _dtype(self) -> torch.dtype:
        return self.pre_conv.conv.weight.dtype

    def _new_buffers(self, batch_size: int) -> dict[str, torch.Tensor]:
        w = self.pre_conv.conv.weight
        return {k: torch.zeros((batch_size, *s), dtype=w.dtype, device=w.device) for k, s in self._state_shapes.items()}

    # ------------------------------------------------------------------ offline
    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes ``[B, 16, T]`` -> wav ``[B, 1, T * 1920]`` in [-1, 1] (one causal pass)."""
        st = self._new_buffers(codes.shape[0])
        frames_done = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        return self._decode_stream(codes, st, frames_done)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, chunk_frames: int = 300, left_context_frames: int = 25) -> torch.Tensor:
        """Reference ``chunked_decode``: chunks of ``chunk_frames``, each with up to
        ``left_context_frames`` of recomputed left context whose audio is dropped."""
        if chunk_frames < 1 or left_context_frames < 0:
            raise InputError(f"decode: chunk_frames must be >= 1 and left_context_frames >= 0 "
                             f"(got {chunk_frames}, {left_context_frames})")
        n = codes.shape[-1]
        if n <= chunk_frames:
            return self.forward(codes)
        outs, start = [], 0
        while start < n:
            end = min(start + chunk_frames, n)
            ctx = min(left_context_frames, start)
            wav = self.forward(codes[..., start - ctx:end])
            outs.append(wav[..., ctx * self.samples_per_frame:])
            start = end
        return torch.cat(outs, dim=-1)

    # ------------------------------------------------------------------ streaming
    def start_stream(self, batch_size: int = 1) -> Code2WavState:
        """A fresh stream state at frame 0 for ``batch_size`` rows that advance together."""
        if batch_size < 1:
            raise InputError(f"start_stream: batch_size must be >= 1, got {batch_size}")
        return Code2WavState(self._new_buffers(batch_size), batch_size, owner=id(self))

    def _check_state(self, state: Code2WavState, codes: torch.Tensor) -> None:
        state._check_live()
        if state._owner != id(self) or state._buffers.keys() != self._state_shapes.keys():
            raise InputError("this Code2WavState was made by another Code2Wav model")
        if codes.dim() != 3 or codes.shape[0] != state.batch_size:
            raise InputError(f"codes must be [{state.batch_size}, {self.cfg.num_quantizers}, F] for this state; "
                             f"got {tuple(codes.shape)}")

    @torch.no_grad()
    def decode_chunk(self, state: Code2WavState, codes: torch.Tensor) -> torch.Tensor:
        """Decode the next ``F`` frames of a stream: codes ``[B, 16, F]`` -> wav ``[B, 1, F * 1920]``.

        ``state`` is advanced in place (``frames_done += F``); on error it is left unchanged.
        """
        self._check_state(state, codes)
        st = dict(state._buffers)
        frames_done = torch.full((state.batch_size,), state.frames_done, dtype=torch.long, device=codes.device)
        wav = self._decode_stream(codes, st, frames_done)
        state._buffers = st
        state.frames_done += codes.shape[-1]
        return wav

    @torch.no_grad()
    def decode_chunks(self, states: Sequence[Code2WavState], codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Decode one chunk for each of several streams, batching chunks of equal length."""
        return decode_chunks(self, states, codes)

    # ------------------------------------------------------------------ precision
    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the conv decoder blocks' GEMMs (``set_compute_dtype``)."""
        return next(m for m in self.decoder if isinstance(m, DecoderBlock)).block[1].conv.weight.dtype

    @torch.no_grad()
    def set_compute_dtype(self, dtype: torch.dtype) -> "Code2Wav":
        """Store the conv decoder blocks' conv / transposed-conv weights in ``dtype`` (``torch.float32`` or
        ``torch.bfloat16``) and run those GEMMs in it; everything else stays fp32 (module docstring,
        docs/kernels.md#code2wav-bf16). bf16 -> fp32 keeps the rounded weights: reload for exact fp32."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise InputError(f"code2wav compute dtype {dtype!r} is not supported; accepted: torch.float32, "
                             f"torch.bfloat16")
        for blk in self.decoder:
            if isinstance(blk, DecoderBlock):
                for m in blk.modules():
                    if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
                        m.conv.to(dtype)
                        m.drop_derived()  # no layout of the old weights kept alive
        return self

    def set_conv(self, choice=None) -> "Code2Wav":
        """How the fp32 convs run: ``choice`` an ``omnilab.tuning.code2wav_conv.Code2WavConv``, a mode name
        (``"auto"``, ``"taps"``, ``"direct"``) or None (``OMNILAB_CODE2WAV_CONV``'s): oneDNN's direct conv from
        ``choice.min_samples`` input samples, per-tap GEMMs below (the GEMV kernel for at most 8 outputs;
        docs/kernels.md#code2wav-convolutions). ``conv_path`` says which is set."""
        if choice is None or isinstance(choice, str):
            choice = conv_choice(env=choice)  # a mode name: as OMNILAB_CODE2WAV_CONV (ConfigError naming the modes)
        elif not isinstance(choice, Code2WavConv):
            raise InputError(f"set_conv takes a Code2WavConv, a mode name or None; got {choice!r}")
        self.conv_path = choice
        set_direct_min_samples(self, choice.min_samples)
        return self

    # ------------------------------------------------------------------ derived tensors
    @torch.no_grad()
    def prepare(self) -> "Code2Wav":
        """Precompute derived tensors now (they are otherwise built on first use and rebuilt
        automatically after the weights change): codebooks, Snake coefficients, and tap-major copies
        of the k > 1 conv / transposed-conv weights (about 0.23 GB extra for the released geometry; in bf16 the
        side-by-side layout of ``conv1d_fused``, half that); and loads the GEMV kernel of the short convs
        (``models/conv_paths.py``). The direct-conv layout of a transposed conv is built on first use: with 25-frame
        blocks only blocks 3 and 4 (2.8 MB) reach the direct path's input length."""
        for m in self.modules():
            if isinstance(m, SnakeBeta):
                m.coefficients()
            elif isinstance(m, EuclideanCodebook):
                m.table()
            elif isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
                m.taps() if m.conv.weight.dtype == torch.float32 else m.fused()
        gemv.loaded_library()  # the short convs' kernel (conv_paths.py): loaded now, not in a stream's first chunk
        return self


@torch.no_grad()
def init_random_(model: Code2Wav, generator: torch.Generator, *, layer_scale: float | None = None,
                 final_gain: float = 0.03, residual_gain: float = 0.5) -> Code2Wav:
    """Deterministic, well-scaled random weights that give non-degenerate audio (docs/model.md#checkpoint-layout).

    ``embedding_sum`` ~ N(0, 1), ``cluster_usage`` = 1; conv/linear weights ~ N(0, 1/fan_in) (fan-in
    of a transposed conv = in_channels * kernel / stride); biases ~ N(0, 0.02^2); norms = 1/0;
    SnakeBeta alpha, beta ~ N(0, 0.1^2) (log scale); transformer layer scales = ``layer_scale``
    (default ``cfg.layer_scale_initial_scale``), ConvNeXt gamma 0.1. The last conv of each
    residual unit is scaled by ``residual_gain`` (keeps activations O(1-10) through the 12 units,
    about x1.5 per decoder block) and the final conv by ``final_gain``: output RMS ~0.08-0.15 on
    both the real and tiny geometries, nothing clipped. No value is small enough to create fp32
    denormals.
    """
    scale = model.cfg.layer_scale_initial_scale if layer_scale is None else layer_scale

    def normal_(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).mul_(std).to(t))

    final = model.decoder[-1].conv
    residual_out = {id(u.conv2.conv) for u in model.modules() if isinstance(u, ResidualUnit)}
    for m in model.modules():
        if isinstance(m, EuclideanCodebook):
            normal_(m.embedding_sum, 1.0)
            m.cluster_usage.fill_(1.0)
        elif isinstance(m, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
            w = m.weight
            if isinstance(m, nn.ConvTranspose1d):
                fan_in = w.shape[0] * w.shape[2] // m.stride[0]
            else:
                fan_in = w[0].numel()
            gain = final_gain if m is final else residual_gain if id(m) in residual_out else 1.0
            normal_(w, gain / math.sqrt(fan_in))
            if m.bias is not None:
                normal_(m.bias, 0.02)
        elif isinstance(m, SnakeBeta):
            normal_(m.alpha, 0.1)
            normal_(m.beta, 0.1)
        elif isinstance(m, LayerScale):
            m.scale.fill_(scale)
        elif isinstance(m, ConvNeXtBlock):
            m.gamma.fill_(0.1)
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif hasattr(m, "weight") and isinstance(m.weight, nn.Parameter) and m.weight.dim() == 1:  # RMSNorm
            m.weight.fill_(1.0)
    return model
