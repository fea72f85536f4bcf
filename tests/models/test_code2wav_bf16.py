"""code2wav with its conv decoder GEMMs in bf16 (``Code2Wav.set_compute_dtype``): which tensors change, the fused
GEMM layout, the waveform error against fp32 (SNR bounds) and streaming against offline.

Bounds and why (docs/kernels.md#code2wav-bf16):
- bf16 keeps 8 significant bits: rounding a GEMM input moves it by at most 2^-9 relative (RMS ~2^-9/sqrt(3),
  about -59 dB per element). The random-weight decoder amplifies a relative perturbation of its conv blocks'
  inputs by ~30 dB on its way to the output, so bf16 audio measured 27.9-29.0 dB SNR from fp32 on the tiny, mid
  and 0.6B checkpoints (3 code sequences x 80 frames each, natively and under the AVX2 caps).
  ``SNR_MIN_DB`` = 24 leaves 4 dB (2.5x the noise power) for other CPUs' blockings; bf16 everywhere (residual
  stream and front end included) measured 21.6-23.3 dB. ``SNR_MAX_DB`` = 45 proves the bf16 path ran (fp32
  against itself is exact).
- Streaming vs offline: both round the same fp32 inputs to the same bf16 values, but oneDNN blocks a GEMM by its
  width, so one output's fp32 sum can differ in its last bits between a 1-frame chunk and a 25-frame block;
  where that straddles a bf16 rounding boundary the output moves by one bf16 step and the decoder carries the
  difference on. So the streamed audio is another bf16 rounding of the same fp32 audio: it must be as close to
  fp32 as the offline one (``SNR_MIN_DB``), and then it is within SNR_MIN_DB - 3 dB of the offline one (two
  equally large, uncorrelated errors; partly correlated in practice: measured 38-46 dB on tiny, 33-37 mid,
  31 on 0.6B), max abs <= ``STREAM_MAX_ABS`` (measured <= 0.027 on every geometry; audio is in [-1, 1]).
  The state logic itself is dtype-independent and held to atol 1e-5 in fp32 (test_code2wav_stream.py); a lost
  left context in bf16 measured 3.7 dB and max abs 0.62 here.
"""
from __future__ import annotations

import pytest
import torch

from omnilab.config import Code2WavConfig
from omnilab.errors import InputError
from omnilab.models.code2wav import Code2Wav, init_random_
from omnilab.models.code2wav_layers import CausalConv1d, CausalConvTranspose1d, DecoderBlock, SnakeBeta

SNR_MIN_DB, SNR_MAX_DB = 24.0, 45.0
STREAM_SNR_MIN_DB, STREAM_MAX_ABS = SNR_MIN_DB - 3.0, 0.1


def _snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - test)^2) (the definition omnilab.quality uses)."""
    ref, test = ref.double(), test.double()
    noise = float(((ref - test) ** 2).sum())
    return float("inf") if noise == 0 else 10.0 * torch.log10((ref ** 2).sum() / noise).item()


def _model(size: str, seed: int = 0) -> Code2Wav:
    from omnilab.checkpoint.configs import decoder_config_dict

    cfg = Code2WavConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in decoder_config_dict(size).items()})
    return init_random_(Code2Wav(cfg).eval(), torch.Generator().manual_seed(seed))


def _pair(size: str, seed: int = 0) -> tuple[Code2Wav, Code2Wav]:
    ref = _model(size, seed)
    low = _model(size, seed).set_compute_dtype(torch.bfloat16).prepare()
    return ref, low


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (1, 16, frames), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return _pair("tiny")


def test_only_the_conv_decoder_blocks_change_dtype(tiny):
    _, m = tiny
    assert m.compute_dtype == torch.bfloat16
    blocks = {id(x) for b in m.decoder if isinstance(b, DecoderBlock) for x in b.modules()}
    for name, mod in m.named_modules():
        if isinstance(mod, (CausalConv1d, CausalConvTranspose1d)):
            want = torch.bfloat16 if id(mod) in blocks else torch.float32
            assert mod.conv.weight.dtype == want and mod.conv.bias.dtype == want, name
        elif isinstance(mod, SnakeBeta):
            assert mod.alpha.dtype == torch.float32, name  # the fused fp32 kernel keeps running
    assert m.pre_transformer.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in m.start_stream(1).buffers.values())  # fp32 state
    out = m(_codes(3, 0))
    assert out.dtype == torch.float32 and out.shape == (1, 1, 3 * 1920) and float(out.abs().max()) <= 1.0


def test_derived_layouts_of_the_old_weights_are_dropped():
    m = _model("tiny").prepare()
    tconv = m.decoder[1].block[1]
    assert tconv._taps.value is not None
    m.set_compute_dtype(torch.bfloat16)
    assert tconv._taps.value is None and tconv._fused.value is None  # no fp32 copy kept alive
    m.prepare()
    assert tconv._fused.value[0].dtype == torch.bfloat16 and tconv._taps.value is None


def test_bad_dtype_is_an_input_error():
    with pytest.raises(InputError, match="torch.float32, torch.bfloat16"):
        _model("tiny").set_compute_dtype(torch.float16)


def test_fused_layout_equals_the_taps_layout():
    """The side-by-side weight of one GEMM holds the same products as the per-tap GEMMs: with fp32 weights (no
    bf16 rounding) the two paths agree to fp32 summation-order rounding (~K * 2^-24 relative, K <= 7 * 16)."""
    g = torch.Generator().manual_seed(5)
    conv, tconv = CausalConv1d(16, 24, 7, dilation=3), CausalConvTranspose1d(16, 8, 10, 5)
    for mod in (conv, tconv):
        for p in mod.parameters():
            p.data = torch.randn(p.shape, generator=g)
    conv.state_key, tconv.state_key = "c", "t"
    x = torch.randn(2, 16, 30, generator=g)
    with torch.no_grad():
        ref_c = conv(x, {"c": torch.zeros(2, 16, 18)})
        ref_t = tconv(x, {"t": torch.zeros(2, 16, 1)})
        conv.conv.to(torch.float64)  # weight dtype != x dtype: the fused path, in fp64
        tconv.conv.to(torch.float64)
        got_c = conv(x, {"c": torch.zeros(2, 16, 18)})
        got_t = tconv(x, {"t": torch.zeros(2, 16, 1)})
    assert got_c.dtype == got_t.dtype == torch.float32
    torch.testing.assert_close(got_c, ref_c, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_t, ref_t, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("size,seeds,frames", [("tiny", (1, 2), 60), ("mid", (1,), 40)])
def test_bf16_audio_snr_against_fp32(size, seeds, frames, tiny):
    ref, low = tiny if size == "tiny" else _pair(size)
    for seed in seeds:
        c = _codes(frames, seed)
        snr = _snr_db(ref(c), low(c))
        assert SNR_MIN_DB <= snr <= SNR_MAX_DB, f"{size} seed {seed}: bf16 vs fp32 SNR {snr:.1f} dB"


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8, 16, 25, 4], [1] * 12 + [30]], ids=["ramp", "ones"])
def test_bf16_streaming_close_to_offline(tiny, sizes):
    ref, low = tiny
    c = _codes(sum(sizes), 7)
    offline = low(c)
    state, outs, pos = low.start_stream(1), [], 0
    for f in sizes:
        outs.append(low.decode_chunk(state, c[..., pos:pos + f]))
        pos += f
    stream = torch.cat(outs, dim=-1)
    to_fp32, snr = _snr_db(ref(c), stream), _snr_db(offline, stream)
    err = float((offline - stream).abs().max())
    assert to_fp32 >= SNR_MIN_DB, f"streamed bf16 vs fp32 {to_fp32:.1f} dB"
    assert snr >= STREAM_SNR_MIN_DB, f"stream vs offline {snr:.1f} dB"
    assert err <= STREAM_MAX_ABS, f"stream vs offline max abs {err:.3g}"
