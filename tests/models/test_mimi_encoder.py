"""Mimi encoder (12 Hz speech tokenizer encode path): released names, reference parity, lengths, init."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from omnilab.errors import ConfigError, InputError, UnsupportedError
from omnilab.models.mimi_encoder import MimiEncoder, MimiEncoderConfig, init_random_

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "tests" / "golden" / "encoders"


def _golden_script():
    spec = importlib.util.spec_from_file_location("encoders_golden", ROOT / "scripts/reference/encoders_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GS = _golden_script()


@pytest.fixture(scope="module")
def golden():
    from safetensors import safe_open
    from safetensors.torch import load_file
    path = GOLDEN_DIR / "encoders_golden.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


@pytest.fixture(scope="module")
def tiny(golden):
    g, meta = golden
    model = MimiEncoder(json.loads(meta["mimi_config"])).eval()
    sd = {k[len("mimi."):]: v.float() for k, v in g.items() if k.startswith("mimi.") and v.dtype == torch.float16}
    model.load_state_dict(sd, strict=True)
    return model


def test_real_geometry_tensor_names_and_shapes():
    ref = json.loads((GOLDEN_DIR / "real_geometry_keys.json").read_text())
    with torch.device("meta"):
        model = MimiEncoder(ref["mimi_encoder_config"])
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert got == ref["mimi_encoder"]
    # no decoder parts (the reference deletes them), all 32 codebooks kept with their EMA buffers
    assert not any(k.startswith(("upsample", "decoder")) for k in got)
    assert got["quantizer.acoustic_residual_vector_quantizer.layers.30.codebook.embed_sum"] == [2048, 256]
    assert "encoder_transformer.rotary.inv_freq" not in got  # non-persistent, as in the checkpoint
    assert model.samples_per_frame == 1920


def test_codes_match_reference_batched_and_single(golden, tiny):
    g, meta = golden
    lengths = json.loads(meta["mimi_lengths"])
    sums = json.loads(meta["signal_sums"])
    wavs = [torch.from_numpy(GS.test_signal(n, variant=2 + i)) for i, n in enumerate(lengths)]
    for n, w in zip(lengths, wavs):
        assert float(w.double().sum()) == pytest.approx(sums[str(n)], abs=1e-6)
    got = tiny.encode_list(wavs)
    for i, (n, c) in enumerate(zip(lengths, got)):
        assert c.shape == (-(-n // 1920), 16) and c.dtype == torch.int64
        assert torch.equal(c, g[f"mimi.codes_batch{i}"]), f"row {i}"
    single = tiny.encode(wavs[0])
    assert torch.equal(single[0], g["mimi.codes_single"])
    torch.testing.assert_close(tiny.latents(wavs[0][None])[0], g["mimi.latents0"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("n", [1, 1919, 1920, 1921, 5000])
def test_encode_length_is_ceil_samples_over_1920(tiny, n):
    codes = tiny.encode(torch.from_numpy(GS.test_signal(n)))
    assert codes.shape == (1, -(-n // 1920), 16)
    assert bool((codes >= 0).all()) and bool((codes < 32).all())


def test_padded_batch_marks_invalid_frames(tiny):
    w = torch.from_numpy(GS.test_signal(9000))
    batch = torch.stack([w, torch.cat([w[:4000], torch.zeros(5000)])])
    codes = tiny.encode(batch, lengths_samples=[9000, 4000])
    assert codes.shape == (2, 5, 16)
    assert bool((codes[1, 3:] == -1).all()) and bool((codes[1, :3] >= 0).all()) and bool((codes[0] >= 0).all())
    with pytest.raises(InputError, match="lengths_samples"):
        tiny.encode(batch, lengths_samples=[9000])
    with pytest.raises(InputError, match="lengths_samples"):
        tiny.encode(batch, lengths_samples=[9001, 10])
    with pytest.raises(InputError, match="samples > 0"):
        tiny.encode(torch.zeros(1, 0))


def test_encoder_is_causal(tiny):
    """Frames of a prefix (whole frames) do not depend on later audio (reference clips can be cut)."""
    w = torch.from_numpy(GS.test_signal(6 * 1920, variant=4))[None]
    full = tiny.latents(w)
    prefix = tiny.latents(w[:, : 3 * 1920])
    torch.testing.assert_close(prefix, full[..., :3], rtol=1e-5, atol=1e-5)


def test_sliding_window_option(golden):
    _, meta = golden
    cfg = dict(json.loads(meta["mimi_config"]), sliding_window=4)
    gen = torch.Generator().manual_seed(0)
    a = init_random_(MimiEncoder(cfg), gen)
    b = MimiEncoder(cfg, use_sliding_window=True)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        for layer in m.encoder_transformer.layers:
            layer.self_attn_layer_scale.scale.data.fill_(0.5)
    w = torch.from_numpy(GS.test_signal(4 * 1920))[None]  # 8 transformer frames
    short = torch.from_numpy(GS.test_signal(2 * 1920))[None]  # 4 frames: the window changes nothing
    assert not torch.allclose(a.latents(w), b.latents(w))
    torch.testing.assert_close(a.latents(short), b.latents(short))


def test_config_parsing_and_errors():
    cfg = MimiEncoderConfig.from_dict({"_frame_rate": 12.5, "upsampling_ratios": [8, 6, 5, 4], "head_dim": None})
    assert cfg.effective_frame_rate == 12.5 and cfg.attn_head_dim == 64 and cfg.has_downsample
    assert cfg.samples_per_frame == 1920 and cfg.num_quantizers == 32
    assert MimiEncoderConfig.from_dict({}).samples_per_frame == 1920  # frame rate derived from the strides
    assert MimiEncoderConfig.from_dict({"hidden_size": 64, "codebook_dim": None}).codebook_dim == 64
    with pytest.raises(UnsupportedError, match="pad_mode"):
        MimiEncoderConfig.from_dict({"pad_mode": "circular"})
    with pytest.raises(UnsupportedError, match="audio_channels"):
        MimiEncoderConfig.from_dict({"audio_channels": 2})
    with pytest.raises(ConfigError, match="num_semantic_quantizers"):
        MimiEncoderConfig.from_dict({"num_quantizers": 1})
    with pytest.raises(ConfigError, match="encoder_valid_num_quantizers"):
        with torch.device("meta"):
            MimiEncoder({}, valid_num_quantizers=33)


def test_init_random_is_deterministic_and_gives_varied_codes(golden):
    _, meta = golden
    cfg = json.loads(meta["mimi_config"])
    a = init_random_(MimiEncoder(cfg), torch.Generator().manual_seed(5))
    b = init_random_(MimiEncoder(cfg), torch.Generator().manual_seed(5))
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for k, v in sa.items():
        assert not ((v != 0) & (v.abs() < 1e-20)).any(), k  # no denormal-prone weights
        if k.endswith("cluster_usage") or k.endswith("initialized"):
            assert bool((v == 1).all()), k
    codes = a.encode(torch.from_numpy(GS.test_signal(48000, variant=1)))[0]  # [25, 16]
    distinct = [len(set(codes[:, q].tolist())) for q in range(16)]
    assert min(distinct) >= 4, distinct
