"""Golden outputs of the official speaker encoder, mel front end and Mimi encoder (tiny random weights).

Runs INSIDE the reference env (qwen-tts 0.1.1 + transformers 4.57.3 + librosa), with the repo root on
sys.path only to *generate* weights through omnilab's ``init_random_`` (the reference classes then load them):

    PYTHONPATH=. .venv-ref/bin/python scripts/reference/encoders_golden.py [--out tests/golden/encoders] [--check]

Writes ``encoders_golden.safetensors`` (< 300 KB): tiny weights (fp16-representable values stored as fp16),
reference outputs, and the configs as JSON metadata; ``real_geometry_keys.json``: key names and shapes of the
real-geometry reference modules (speaker encoder enc_dim 1024 and 2048; the Mimi encoder as the 12 Hz
tokenizer wraps it). With ``--check`` it also runs omnilab on the same inputs and prints max abs errors;
``--real`` instead compares omnilab and the reference at the real geometry (3 s of audio, no files written).

If the installed torchaudio cannot load (it fails beside torch 2.13.0+cpu), an in-memory stub is put in
``sys.modules`` before importing qwen_tts; the 12 Hz path never calls torchaudio.
"""
from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Tiny geometries (kept in sync with tests/models/test_*_encoder.py through the metadata of the golden file).
SPK_TINY = dict(mel_dim=128, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=8, enc_se_channels=8,
                sample_rate=24000)
MIMI_TINY = dict(sampling_rate=24000, audio_channels=1, num_filters=2, kernel_size=7, last_kernel_size=3,
                 residual_kernel_size=3, num_residual_layers=1, dilation_growth_rate=2, compress=2,
                 upsampling_ratios=[8, 6, 5, 4], use_causal_conv=True, pad_mode="constant", trim_right_ratio=1.0,
                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=64, hidden_act="gelu", norm_eps=1e-5, layer_scale_initial_scale=0.01,
                 rope_theta=10000.0, max_position_embeddings=8000, sliding_window=250, num_quantizers=32,
                 num_semantic_quantizers=1, codebook_size=32, codebook_dim=8,
                 vector_quantization_hidden_dimension=8, upsample_groups=32, use_conv_shortcut=False,
                 _frame_rate=12.5)
MIMI_REAL = dict(MIMI_TINY, num_filters=64, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=64, intermediate_size=2048, codebook_size=2048, codebook_dim=256,
                 vector_quantization_hidden_dimension=256, upsample_groups=512)
DEC_TINY = dict(codebook_size=32, codebook_dim=16, hidden_size=16, latent_dim=16, num_attention_heads=2,
                num_key_value_heads=2, head_dim=8, intermediate_size=32, num_hidden_layers=1, num_quantizers=16,
                decoder_dim=16)
MEL_SAMPLES = 7200          # 0.3 s
SPK_SAMPLES = 24000         # 1.0 s
MIMI_LENGTHS = (50000, 31000)  # batched like the reference: zero right-pad, per-row ceil(len / 1920) frames


def test_signal(n: int, sr: int = 24000, variant: int = 0) -> np.ndarray:
    """Deterministic test audio (chirp + AM tone + integer-hash noise), float32 in [-0.7, 0.7]."""
    t = np.arange(n, dtype=np.float64) / sr
    f0 = 110.0 * (1 + variant)
    x = 0.4 * np.sin(2 * np.pi * (f0 * t + 400.0 * t * t))
    x += 0.2 * np.sin(2 * np.pi * 1234.5 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t))
    h = (np.arange(n, dtype=np.uint64) + np.uint64(7919 * (variant + 1))) * np.uint64(2654435761)
    h = (h ^ (h >> np.uint64(13))) * np.uint64(0x5BD1E995) % np.uint64(2 ** 32)
    x += 0.05 * (h.astype(np.float64) / 2 ** 31 - 1.0)
    return x.astype(np.float32)


def _import_reference():
    try:
        import torchaudio  # noqa: F401
    except Exception:  # the real wheel fails to load beside torch 2.13.0+cpu: stub it in memory
        for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
        sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
    from qwen_tts.core.models import modeling_qwen3_tts as mq
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as mt
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    return mq, Qwen3TTSSpeakerEncoderConfig, mt, Qwen3TTSTokenizerV2Config


def _fp16_exact(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.half().float() if v.is_floating_point() else v for k, v in sd.items()}


def _tiny_weights(gen: torch.Generator):
    """omnilab init, then perturbations that exercise every parameter (biases, norms, usage != 1)."""
    from omnilab.config import SpeakerEncoderConfig
    from omnilab.models import mimi_encoder as me, speaker_encoder as se

    spk = se.init_random_(se.SpeakerEncoder(SpeakerEncoderConfig(**{k: tuple(v) if isinstance(v, list) else v
                                                                     for k, v in SPK_TINY.items()})), gen)
    mimi = me.init_random_(me.MimiEncoder(MIMI_TINY), gen)
    sd_m = mimi.state_dict()
    for k, v in sd_m.items():
        if k.endswith(("layernorm.weight",)):
            v.copy_(1.0 + 0.2 * torch.randn(v.shape, generator=gen))
        elif k.endswith(("layernorm.bias", ".conv.bias")):
            v.copy_(0.1 * torch.randn(v.shape, generator=gen))
        elif k.endswith("layer_scale.scale"):
            v.copy_(0.2 + 0.2 * torch.rand(v.shape, generator=gen))
        elif k.endswith("cluster_usage"):
            v.copy_(0.5 + 1.5 * torch.rand(v.shape, generator=gen))
            v[3] = 0.0  # clamp(min=1e-5) path: that entry becomes huge and is never chosen
    return _fp16_exact(spk.state_dict()), _fp16_exact(sd_m), spk, mimi


def build(out_dir: Path, check: bool) -> None:
    from safetensors.torch import save_file
    from librosa.filters import mel as librosa_mel
    from transformers import EncodecFeatureExtractor, MimiConfig

    mq, SpkCfg, mt, TokCfg = _import_reference()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    spk_sd, mimi_sd, spk_om, mimi_om = _tiny_weights(gen)

    # -- mel front end and filterbank (reference = librosa + qwen-tts mel_spectrogram)
    fb = librosa_mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)  # [128, 513]
    rows, cols = np.nonzero(fb)
    wav_mel = test_signal(MEL_SAMPLES)
    mel_ref = mq.mel_spectrogram(torch.from_numpy(wav_mel).unsqueeze(0), n_fft=1024, num_mels=128,
                                 sampling_rate=24000, hop_size=256, win_size=1024, fmin=0,
                                 fmax=12000).transpose(1, 2)  # [1, T, 128]

    # -- speaker encoder (reference class, our weights)
    spk_ref = mq.Qwen3TTSSpeakerEncoder(SpkCfg(**SPK_TINY)).eval()
    spk_ref.load_state_dict(spk_sd, strict=True)
    wav_spk = test_signal(SPK_SAMPLES, variant=1)
    mels_spk = mq.mel_spectrogram(torch.from_numpy(wav_spk).unsqueeze(0), n_fft=1024, num_mels=128,
                                  sampling_rate=24000, hop_size=256, win_size=1024, fmin=0,
                                  fmax=12000).transpose(1, 2)
    with torch.inference_mode():
        xvec_ref = spk_ref(mels_spk)[0]  # what extract_speaker_embedding returns (fp32 model)

    # -- Mimi encoder through Qwen3TTSTokenizerV2Model.encode, fed like Qwen3TTSTokenizer.encode
    tok_cfg = TokCfg(encoder_config=MIMI_TINY, decoder_config=DEC_TINY, encoder_valid_num_quantizers=16)
    tok = mt.Qwen3TTSTokenizerV2Model(tok_cfg).eval()
    enc_keys = {k[len("encoder."):] for k in tok.state_dict() if k.startswith("encoder.")}
    assert enc_keys == set(mimi_sd), sorted(enc_keys ^ set(mimi_sd))
    tok.encoder.load_state_dict(mimi_sd, strict=True)
    fe = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0, return_attention_mask=True)
    wavs = [test_signal(n, variant=2 + i) for i, n in enumerate(MIMI_LENGTHS)]
    inputs = fe(raw_audio=wavs, sampling_rate=24000, return_tensors="pt")
    with torch.inference_mode():
        codes_ref = tok.encode(inputs["input_values"].squeeze(1), inputs["padding_mask"].squeeze(1),
                               return_dict=True).audio_codes  # list of [T_i, 16]
        single = tok.encode(torch.from_numpy(wavs[0])[None], torch.ones(1, MIMI_LENGTHS[0], dtype=torch.long),
                            return_dict=True).audio_codes[0]
        # pre-quantizer latents of row 0 (for numeric diagnosis)
        e = tok.encoder
        h = e.encoder(inputs["input_values"][:1])
        h = e.encoder_transformer(h.transpose(1, 2), return_dict=True)[0].transpose(1, 2)
        latents_ref = e.downsample(h)[0]  # [hidden, T]

    tensors = {f"spk.{k}": v.half() for k, v in spk_sd.items()}
    tensors.update({f"mimi.{k}": v.half() for k, v in mimi_sd.items()})
    tensors.update({
        "mel.fb_rows": torch.from_numpy(rows.astype(np.int64)), "mel.fb_cols": torch.from_numpy(cols.astype(np.int64)),
        "mel.fb_values": torch.from_numpy(fb[rows, cols].astype(np.float32)),
        "mel.out": mel_ref[0].contiguous(), "spk.mels": mels_spk[0, :8].contiguous(), "spk.xvector": xvec_ref,
        "mimi.codes_batch0": codes_ref[0].contiguous(), "mimi.codes_batch1": codes_ref[1].contiguous(),
        "mimi.codes_single": single.contiguous(), "mimi.latents0": latents_ref.contiguous(),
    })
    meta = {"spk_config": json.dumps(SPK_TINY), "mimi_config": json.dumps(MIMI_TINY),
            "mel_samples": str(MEL_SAMPLES), "spk_samples": str(SPK_SAMPLES),
            "mimi_lengths": json.dumps(MIMI_LENGTHS),
            "signal_sums": json.dumps({str(n): float(np.float64(test_signal(n, variant=v)).sum()) for n, v in
                                       [(MEL_SAMPLES, 0), (SPK_SAMPLES, 1), (MIMI_LENGTHS[0], 2),
                                        (MIMI_LENGTHS[1], 3)]}),
            "generator": "scripts/reference/encoders_golden.py", "fb_shape": json.dumps(list(fb.shape))}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "encoders_golden.safetensors"), metadata=meta)

    # -- real-geometry key names and shapes
    with torch.device("meta"):
        keys = {f"speaker_encoder_enc_dim_{d}": {k: list(v.shape) for k, v in
                                                 mq.Qwen3TTSSpeakerEncoder(SpkCfg(enc_dim=d)).state_dict().items()}
                for d in (1024, 2048)}
        keys["mimi_encoder"] = {k: list(v.shape) for k, v in
                                mt.Qwen3TTSTokenizerV2Encoder(MimiConfig(**MIMI_REAL)).state_dict().items()}
    keys["mimi_encoder_config"] = MIMI_REAL
    (out_dir / "real_geometry_keys.json").write_text(json.dumps(keys, indent=1) + "\n")
    print(f"wrote {out_dir}: " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(out_dir.iterdir())))

    if check:
        from omnilab.audio import log_mel_spectrogram, mel_filterbank_slaney
        spk_om.load_state_dict(spk_sd)
        mimi_om.load_state_dict(mimi_sd)
        print("filterbank max abs err", float(np.abs(mel_filterbank_slaney() - fb).max()))
        print("mel max abs err", float((log_mel_spectrogram(wav_mel) - mel_ref).abs().max()))
        print("x-vector max abs err", float((spk_om.embed_audio(wav_spk) - xvec_ref).abs().max()),
              "| x-vector rms", float(xvec_ref.pow(2).mean().sqrt()))
        got = mimi_om.encode_list([torch.from_numpy(w) for w in wavs])
        for i, (g, r) in enumerate(zip(got, codes_ref)):
            print(f"mimi batch row {i}: shape {tuple(g.shape)} vs {tuple(r.shape)}, equal {torch.equal(g, r)}")
        print("mimi single equal", torch.equal(mimi_om.encode(torch.from_numpy(wavs[0]))[0], single))
        print("mimi latents max abs err",
              float((mimi_om.latents(inputs["input_values"][:1, 0])[0] - latents_ref).abs().max()))


def real_check(seconds: float = 3.0) -> None:
    """Real geometry (enc_dim 1024 ECAPA, 12 Hz Mimi) with omnilab's init_random_ weights, plus the claim that
    the reference ignores ``sliding_window`` in the encoder transformer (tiny model, window 4)."""
    from transformers import MimiConfig
    from omnilab.config import SpeakerEncoderConfig
    from omnilab.models import mimi_encoder as me, speaker_encoder as se

    mq, SpkCfg, mt, _ = _import_reference()
    gen = torch.Generator().manual_seed(7)
    n = int(seconds * 24000)
    wav = test_signal(n, variant=5)
    spk = se.init_random_(se.SpeakerEncoder(SpeakerEncoderConfig(enc_dim=1024)), gen).eval()
    ref = mq.Qwen3TTSSpeakerEncoder(SpkCfg(enc_dim=1024)).eval()
    ref.load_state_dict(spk.state_dict(), strict=True)
    mels = mq.mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000,
                              hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
    x_ref = ref(mels)[0]
    x_om = spk.embed_audio(wav)
    print(f"[real] x-vector max abs err {float((x_om - x_ref).abs().max()):.3g} (rms {float(x_ref.pow(2).mean().sqrt()):.3g})")

    mimi = me.init_random_(me.MimiEncoder(MIMI_REAL), gen).eval()
    enc = mt.Qwen3TTSTokenizerV2Encoder(MimiConfig(**MIMI_REAL)).eval()
    enc.load_state_dict(mimi.state_dict(), strict=True)
    c_ref = enc.encode(torch.from_numpy(wav)[None, None], return_dict=True).audio_codes[:, :16]  # [1, 16, T]
    c_om = mimi.encode(torch.from_numpy(wav))  # [1, T, 16]
    uniq = [len(set(c_om[0, :, q].tolist())) for q in range(16)]
    print(f"[real] mimi codes {tuple(c_om.shape)} equal {torch.equal(c_om[0], c_ref[0].T)}; distinct per q {uniq}")

    cfg = dict(MIMI_TINY, sliding_window=4)
    tiny = me.init_random_(me.MimiEncoder(cfg), gen)
    for k, v in tiny.state_dict().items():
        if k.endswith("layer_scale.scale"):
            v.fill_(0.5)
    enc = mt.Qwen3TTSTokenizerV2Encoder(MimiConfig(**cfg)).eval()
    enc.load_state_dict(tiny.state_dict(), strict=True)
    w = torch.from_numpy(test_signal(48000, variant=6))[None]
    lat_ref = enc.downsample(enc.encoder_transformer(enc.encoder(w[:, None]).transpose(1, 2))[0].transpose(1, 2))
    full = (tiny.latents(w) - lat_ref).abs().max()
    tiny.window = 4
    windowed = (tiny.latents(w) - lat_ref).abs().max()
    print(f"[window] reference vs causal {float(full):.3g}, vs window-4 {float(windowed):.3g} "
          "(the reference ignores sliding_window)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "golden" / "encoders")
    ap.add_argument("--check", action="store_true", help="also compare omnilab against the reference")
    ap.add_argument("--real", action="store_true", help="only run the real-geometry parity check (no files)")
    args = ap.parse_args()
    with torch.no_grad():
        if args.real:
            real_check()
        else:
            build(args.out, args.check)


if __name__ == "__main__":
    main()
