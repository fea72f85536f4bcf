"""code2wav's fp32 conv paths (omnilab/tuning/code2wav_conv.py, omnilab/models/conv_paths.py): oneDNN's direct
convolution for long inputs, per-tap GEMMs, and the GEMV kernel for at most 8 outputs agree to fp32 rounding, layer
by layer and through the whole decoder, streamed or offline.

Tolerance: the paths sum the same k * Cin products in other orders, so they may differ by ~sqrt(K) * 2^-24 of the
sum's magnitude (K <= 7 * 64 here) on any CPU, not bit for bit (tests/models/test_code2wav.py: REORDER_ATOL)."""
from __future__ import annotations

import pytest
import torch

from omnilab.models.code2wav_layers import CausalConv1d, CausalConvTranspose1d
from omnilab.tuning.code2wav_conv import NEVER, conv_choice
from tests.models.test_code2wav import REORDER_ATOL, SPF, rand_codes, tiny_model


def _run(m, x, path_min, state):
    m.direct_min_samples = path_min
    st = {m.state_key: state.clone()}
    return m(x, st), st[m.state_key]


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_causal_conv_paths_agree(dilation):
    torch.manual_seed(0)
    m = CausalConv1d(48, 40, 7, dilation=dilation).requires_grad_(False)
    m.state_key = "c"
    x, state = torch.randn(2, 48, 300), torch.randn(2, 48, 6 * dilation)
    (a, sa), (b, sb) = _run(m, x, NEVER, state), _run(m, x, 0, state)
    assert a.shape == b.shape == (2, 40, 300)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)  # O(1) outputs, K = 7 * 48
    assert torch.equal(sa, sb)  # the carried context does not depend on the path


@pytest.mark.parametrize("k, stride", [(16, 8), (3, 3)])
def test_transposed_conv_paths_agree(k, stride):
    torch.manual_seed(1)
    m = CausalConvTranspose1d(32, 24, k, stride).requires_grad_(False)
    m.state_key = "t"
    x, state = torch.randn(1, 32, 50), torch.randn(1, 32, 1)
    (a, _), (b, _) = _run(m, x, NEVER, state), _run(m, x, 0, state)
    assert a.shape == b.shape == (1, 24, 50 * stride)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_decoder_paths_agree_streamed_and_offline():
    """The default rule streamed in uneven chunks == per-tap GEMMs offline == all direct offline, to rounding; and
    the rule does run both paths (the tiny decoder's last blocks see >= 1000 samples per 12-frame chunk)."""
    m = tiny_model()
    codes = rand_codes(24)
    ref = m.set_conv(conv_choice(env="taps"))(codes)
    direct = m.set_conv(conv_choice(env="direct"))(codes)
    m.set_conv(conv_choice(env="auto"))
    calls = {"direct": 0}
    orig = torch.nn.functional.conv1d

    def counting(*a, **kw):  # dense convs only: the depthwise ConvNeXt conv (groups = channels) calls it too
        calls["direct"] += (a[6] if len(a) > 6 else kw.get("groups", 1)) == 1
        return orig(*a, **kw)
    st = m.start_stream(1)
    try:
        torch.nn.functional.conv1d = counting
        streamed = torch.cat([m.decode_chunk(st, codes[..., a:b]) for a, b in ((0, 1), (1, 13), (13, 24))], dim=-1)
    finally:
        torch.nn.functional.conv1d = orig
    assert calls["direct"] > 0
    assert streamed.shape == ref.shape == (1, 1, 24 * SPF)
    torch.testing.assert_close(direct, ref, rtol=0, atol=REORDER_ATOL)
    torch.testing.assert_close(streamed, ref, rtol=0, atol=REORDER_ATOL)
    assert m.conv_path.mode == "auto" and (ref - m.set_conv("taps")(codes)).abs().max() == 0


def test_set_conv_takes_a_mode_name_and_refuses_others():
    from omnilab.errors import ConfigError, InputError
    m = tiny_model()
    assert m.set_conv("direct").conv_path.min_samples == 0 and m.decoder[1].block[1].direct_min_samples == 0
    with pytest.raises(ConfigError, match="accepted: auto, taps, direct"):
        m.set_conv("onednn")
    with pytest.raises(InputError, match="Code2WavConv, a mode name or None"):
        m.set_conv(1000)


# ---- short inputs: the GEMV kernel (omnilab/models/conv_paths.py) -------------------------------------------
def _with_gemv(mode, fn):
    from omnilab.kernels.gemv import use_gemv
    with use_gemv(mode):
        return fn()


@pytest.mark.parametrize("n, dilation, batch", [(1, 1, 1), (4, 3, 1), (8, 9, 1), (1, 1, 2)])
def test_short_conv_through_the_gemv_kernel_agrees(n, dilation, batch, monkeypatch):
    """Up to 8 outputs per call the taps run through omnilab's GEMV kernel (rows = output positions); the GEMMs
    (OMNILAB_CPU_GEMV=torch) give the same up to summation order (K = Cin = 64: ~1e-6 on O(1) outputs)."""
    from omnilab.kernels.gemv import loaded_library
    from omnilab.models.conv_paths import conv1d_taps
    if _with_gemv("auto", loaded_library) is None:
        pytest.skip("no GEMV kernel on this machine")
    g = torch.Generator().manual_seed(n)
    taps, bias = torch.randn(7, 40, 64, generator=g) * 0.1, torch.randn(40, generator=g)
    x = torch.randn(batch, 64, (n if batch == 1 else 1) + 6 * dilation, generator=g)
    from omnilab.kernels import gemv
    calls, rows = [], gemv.gemv_rows
    monkeypatch.setattr(gemv, "gemv_rows", lambda x, *a, **kw: calls.append(x.shape[0]) or rows(x, *a, **kw))
    kernel = _with_gemv("auto", lambda: conv1d_taps(x, taps, bias, dilation))
    assert calls == [x.shape[0] * x.shape[2] - 6 * dilation] * 7  # one call per tap, a row per output position
    gemm = _with_gemv("torch", lambda: conv1d_taps(x, taps, bias, dilation))
    assert len(calls) == 7
    direct = torch.nn.functional.conv1d(x, taps.permute(1, 2, 0), bias, dilation=dilation)  # batch rows apart
    assert kernel.shape == gemm.shape == direct.shape and kernel.is_contiguous()
    torch.testing.assert_close(kernel, gemm, rtol=0, atol=1e-5)
    torch.testing.assert_close(kernel, direct, rtol=0, atol=1e-5)


def test_small_linears_and_the_first_chunk_agree_with_torch(monkeypatch):
    from omnilab.kernels import gemv
    from omnilab.models.conv_paths import linear_rows
    if _with_gemv("auto", gemv.loaded_library) is None:
        pytest.skip("no GEMV kernel on this machine")
    calls, kernel = [], gemv.gemv_rows
    monkeypatch.setattr(gemv, "gemv_rows", lambda x, *a, **kw: calls.append(x.numel() // x.shape[-1]) or kernel(x, *a,
                                                                                                              **kw))
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 32, generator=g) * 0.2, torch.randn(96, generator=g)
    for rows in (1, 4, 8, 9):
        x = torch.randn(1, rows, 32, generator=g)
        got = _with_gemv("auto", lambda: linear_rows(x, w, b))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=0, atol=1e-5)
    assert calls == [1, 4, 8]  # 9 rows: torch's GEMM
    m = tiny_model()
    codes = rand_codes(3)

    def stream():
        st = m.start_stream(1)
        return torch.cat([m.decode_chunk(st, codes[..., :1]), m.decode_chunk(st, codes[..., 1:])], dim=-1)
    torch.testing.assert_close(_with_gemv("auto", stream), _with_gemv("torch", stream), rtol=0, atol=REORDER_ATOL)
