"""ECAPA-TDNN speaker encoder: released tensor names, parity with the qwen-tts reference, shapes, init."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from omnilab.config import SpeakerEncoderConfig
from omnilab.errors import ConfigError, InputError
from omnilab.models.speaker_encoder import SpeakerEncoder, init_random_

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "tests" / "golden" / "encoders"


def _golden_script():
    spec = importlib.util.spec_from_file_location("encoders_golden", ROOT / "scripts/reference/encoders_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(d: dict) -> SpeakerEncoderConfig:
    return SpeakerEncoderConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


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
    model = SpeakerEncoder(_cfg(json.loads(meta["spk_config"]))).eval()
    sd = {k[len("spk."):]: v.float() for k, v in g.items() if k.startswith("spk.") and v.dtype == torch.float16}
    model.load_state_dict(sd, strict=True)
    return model


@pytest.mark.parametrize("enc_dim", [1024, 2048])
def test_real_geometry_tensor_names_and_shapes(enc_dim):
    expected = json.loads((GOLDEN_DIR / "real_geometry_keys.json").read_text())[f"speaker_encoder_enc_dim_{enc_dim}"]
    with torch.device("meta"):
        model = SpeakerEncoder(SpeakerEncoderConfig(enc_dim=enc_dim))
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert got == expected
    assert got["fc.weight"] == [enc_dim, 3072, 1] and got["asp.tdnn.conv.weight"] == [128, 4608, 1]


def test_xvector_matches_reference(golden, tiny):
    g, meta = golden
    gs = _golden_script()
    n = int(meta["spk_samples"])
    wav = gs.test_signal(n, variant=1)
    x = tiny.embed_audio(wav)
    assert x.shape == (32,) and x.dtype == torch.float32
    torch.testing.assert_close(x, g["spk.xvector"], rtol=0, atol=1e-5)
    # the same through forward() on a tensor input
    from omnilab.audio import log_mel_spectrogram
    mels = log_mel_spectrogram(torch.from_numpy(wav))
    torch.testing.assert_close(mels[0, :8], g["spk.mels"], rtol=0, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(tiny(mels)[0], x, rtol=0, atol=1e-6)


def test_batch_rows_are_independent(tiny):
    mels = torch.randn(3, 40, 128, generator=torch.Generator().manual_seed(0)) - 5.0
    with torch.inference_mode():
        out = tiny(mels)
        one = tiny(mels[1:2])
    assert out.shape == (3, 32)
    torch.testing.assert_close(out[1:2], one, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[0], out[1])


def test_input_errors(tiny):
    with pytest.raises(InputError, match=r"mels \[B, T, 128\]"):
        tiny(torch.zeros(1, 40, 80))
    with pytest.raises(InputError, match="frames"):
        tiny(torch.zeros(1, 3, 128))  # dilation-4 reflect padding needs > 4 frames
    with pytest.raises(InputError, match="mono"):
        tiny.embed_audio(np.zeros((2, 24000), np.float32))


def test_config_errors():
    with pytest.raises(ConfigError, match="same length"):
        SpeakerEncoder(SpeakerEncoderConfig(enc_dim=8, enc_channels=(16, 16, 48), enc_kernel_sizes=(5, 3),
                                            enc_dilations=(1, 1, 1)))
    with pytest.raises(ConfigError, match="sum of the SE-Res2Net"):
        SpeakerEncoder(SpeakerEncoderConfig(enc_dim=8, enc_channels=(16, 16, 16, 16, 40)))
    with pytest.raises(ConfigError, match="sample_rate"):
        SpeakerEncoder(SpeakerEncoderConfig(enc_dim=8, sample_rate=16000))


def test_init_random_is_deterministic_and_well_scaled(golden):
    _, meta = golden
    cfg = _cfg(json.loads(meta["spk_config"]))
    a = init_random_(SpeakerEncoder(cfg), torch.Generator().manual_seed(3))
    b = init_random_(SpeakerEncoder(cfg), torch.Generator().manual_seed(3))
    c = init_random_(SpeakerEncoder(cfg), torch.Generator().manual_seed(4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])
    for k, v in sa.items():
        assert not ((v != 0) & (v.abs() < 1e-20)).any(), k  # no denormal-prone weights
    wav = _golden_script().test_signal(24000, variant=1)
    x = a.embed_audio(wav)
    rms = float(x.pow(2).mean().sqrt())
    assert 0.1 < rms < 10.0, rms
