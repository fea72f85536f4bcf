"""Random-checkpoint factory: released file set, configs, tensor names/dtypes, determinism, audio."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from omnilab.checkpoint import random as ck
from omnilab.checkpoint.configs import CHECKPOINT_SIZES, config_json, geometry
from omnilab.config import VARIANTS, GenerationDefaults, Qwen3TTSConfig, SpeechTokenizerConfig
from omnilab.errors import CheckpointError, ConfigError
from omnilab.models import tiny

RELEASED_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
    "tokenizer_config.json", "preprocessor_config.json", "speech_tokenizer/config.json",
    "speech_tokenizer/preprocessor_config.json", "speech_tokenizer/configuration.json",
    "speech_tokenizer/model.safetensors",
}
TOP_KEYS = ["architectures", "assistant_token_id", "im_end_token_id", "im_start_token_id", "tts_bos_token_id",
            "tts_eos_token_id", "tts_pad_token_id", "model_type", "tokenizer_type", "tts_model_size",
            "tts_model_type", "talker_config", "transformers_version"]
TALKER_KEYS = ["attention_bias", "attention_dropout", "code_predictor_config", "codec_bos_id", "codec_eos_token_id",
               "codec_think_id", "codec_language_id", "codec_nothink_id", "codec_pad_id", "codec_think_bos_id",
               "codec_think_eos_id", "spk_id", "spk_is_dialect", "head_dim", "hidden_act", "hidden_size",
               "initializer_range", "intermediate_size", "max_position_embeddings", "model_type",
               "num_attention_heads", "num_code_groups", "num_hidden_layers", "num_key_value_heads",
               "position_id_per_seconds", "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window",
               "text_hidden_size", "text_vocab_size", "use_cache", "use_sliding_window", "vocab_size"]


@pytest.fixture(autouse=True)
def _cache(request, monkeypatch):
    # the tokenizer conversion is cached across test runs; default_checkpoint tests override this
    monkeypatch.setenv("OMNILAB_CACHE", str(request.config.cache.mkdir("omnilab-cache")))


@pytest.fixture(scope="module")
def ckpts(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    with pytest.MonkeyPatch.context() as mp:
        cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
        mp.setenv("OMNILAB_CACHE", str(cache.mkdir("omnilab-cache") if cache else tmp_path_factory.mktemp("cache")))
        return {v: ck.make_random_checkpoint(root / v, "tiny", v, seed=0)
                for v in ("custom_voice", "voice_design", "base")}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design", "base"])
def test_exactly_the_released_files(ckpts, variant):
    assert _files(ckpts[variant]) == RELEASED_FILES
    assert not [p for p in ckpts[variant].parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design", "base"])
def test_configs_round_trip_and_keep_the_released_order(ckpts, variant):
    d = ckpts[variant]
    raw = json.loads((d / "config.json").read_text())
    want_top = TOP_KEYS[:-1] + (["speaker_encoder_config"] if variant == "base" else []) + TOP_KEYS[-1:]
    assert list(raw) == want_top
    assert list(raw["talker_config"]) == TALKER_KEYS
    cfg = Qwen3TTSConfig.load(d / "config.json")
    g = geometry("tiny")
    assert (cfg.tts_model_type, cfg.tts_model_size) == (variant, "0b6")
    assert (cfg.talker.hidden_size, cfg.talker.text_hidden_size, cfg.talker.text_vocab_size) == (g.hidden, g.text_hidden, 151936)
    assert (cfg.talker.vocab_size, cfg.talker.num_code_groups, cfg.code_predictor.vocab_size) == (3072, 16, 2048)
    assert (cfg.im_start_token_id, cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id) == \
        (151644, 151671, 151672, 151673)
    if variant == "custom_voice":
        assert cfg.talker.spk_id["vivian"] == 3065 and cfg.talker.spk_is_dialect["eric"] == "sichuan_dialect"
    else:
        assert raw["talker_config"]["spk_id"] == {} and raw["talker_config"]["spk_is_dialect"] == {}
    assert (cfg.speaker_encoder is not None) == (variant == "base")
    if variant == "base":
        assert cfg.speaker_encoder.enc_dim == g.hidden
    st = SpeechTokenizerConfig.load(d / "speech_tokenizer" / "config.json")
    assert st.decoder.samples_per_frame == 1920 and st.decoder.codebook_size == 2048
    assert tuple(st.decoder.upsample_rates) == (8, 5, 4, 3) and tuple(st.decoder.upsampling_ratios) == (2, 2)
    assert GenerationDefaults.load(d / "generation_config.json").max_new_tokens == 8192


def test_fixed_size_files(ckpts):
    d = ckpts["custom_voice"]
    assert (d / "generation_config.json").stat().st_size == 245
    assert (d / "speech_tokenizer" / "preprocessor_config.json").stat().st_size == 234


def test_real_geometry_config_matches_the_released_copy():
    text = config_json("1.7b", "custom_voice")
    assert len(text.encode()) == 4883  # the public 1.7B-CustomVoice copy without the mirror's auto_map block
    cfg = Qwen3TTSConfig.from_dict(json.loads(text))
    assert (cfg.talker.hidden_size, cfg.talker.intermediate_size, cfg.talker.num_hidden_layers) == (2048, 6144, 28)
    assert cfg.has_mtp_projection and cfg.accepts_instruct
    small = Qwen3TTSConfig.from_dict(json.loads(config_json("0.6b", "base")))
    assert small.talker.hidden_size == 1024 and not small.has_mtp_projection
    assert json.loads(config_json("0.6b", "base"))["speaker_encoder_config"] == {"enc_dim": 1024, "sample_rate": 24000}


@pytest.mark.parametrize("size", CHECKPOINT_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_config_is_the_geometry_the_model_tests_use(size, variant):
    """One copy of the talker widths (``models.tiny.TALKER_GEOMETRIES``): a random checkpoint's ``config.json``
    parses to the same talker and code-predictor config that ``tiny.config`` builds for the model tests. (The
    two were written apart and disagreed: predictor ``intermediate_size`` 96 in the model tests, 128 in the
    tiny checkpoint.)"""
    ckpt = Qwen3TTSConfig.from_dict(json.loads(config_json(size, variant)))
    model = tiny.config(variant, geometry(size).model_size, geometry=tiny.TALKER_GEOMETRIES[size])
    assert (ckpt.talker, ckpt.code_predictor) == (model.talker, model.code_predictor)
    if size == "tiny":  # what the model tests build by default
        default = tiny.config(variant, geometry(size).model_size)
        assert (ckpt.talker, ckpt.code_predictor) == (default.talker, default.code_predictor)


@pytest.mark.parametrize("variant", ["custom_voice", "base"])
def test_tensor_names_dtypes_and_shapes(ckpts, variant):
    g = geometry("tiny")
    main = _tensors(ckpts[variant] / "model.safetensors")
    assert {t.dtype for t in main.values()} == {torch.bfloat16}
    prefixes = {k.split(".")[0] for k in main}
    assert prefixes == ({"talker", "speaker_encoder"} if variant == "base" else {"talker"})
    assert main["talker.model.text_embedding.weight"].shape == (151936, g.text_hidden)
    assert main["talker.model.codec_embedding.weight"].shape == (3072, g.hidden)
    assert main["talker.codec_head.weight"].shape == (3072, g.hidden)
    assert main["talker.code_predictor.model.codec_embedding.14.weight"].shape == (2048, g.hidden)
    assert main["talker.code_predictor.lm_head.14.weight"].shape == (2048, g.cp_hidden)
    assert main["talker.model.layers.0.self_attn.q_norm.weight"].shape == (g.head_dim,)
    assert not any("small_to_mtp_projection" in k for k in main)  # tiny mirrors 0.6B: equal widths
    assert all(bool(torch.isfinite(t.float()).all()) for t in main.values())
    codec = _tensors(ckpts[variant] / "speech_tokenizer" / "model.safetensors")
    assert {k.split(".")[0] for k in codec} == {"encoder", "decoder"}
    assert {t.dtype for t in codec.values()} == {torch.float32}
    assert codec["decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum"].shape == (2048, g.dec_codebook_dim // 2)
    assert len([k for k in codec if k.startswith("decoder.quantizer.rvq_rest.vq.layers.") and k.endswith("embedding_sum")]) == 15
    assert bool((codec["decoder.quantizer.rvq_first.vq.layers.0._codebook.cluster_usage"] > 0).all())


def test_same_seed_is_byte_identical_and_other_seeds_differ(ckpts, tmp_path):
    again = ck.make_random_checkpoint(tmp_path / "again", "tiny", "custom_voice", seed=0)
    other = ck.make_random_checkpoint(tmp_path / "other", "tiny", "custom_voice", seed=1)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    for name in ("model.safetensors", "speech_tokenizer/model.safetensors", "config.json"):
        assert digest(again / name) == digest(ckpts["custom_voice"] / name), name
    assert digest(other / "model.safetensors") != digest(again / "model.safetensors")
    assert digest(other / "speech_tokenizer/model.safetensors") != digest(again / "speech_tokenizer/model.safetensors")


def test_decoder_audio_is_not_degenerate(ckpts):
    from omnilab.checkpoint.load import load_model

    m = load_model(ckpts["custom_voice"], dtype="fp32")
    stats = ck._audio_check(m.code2wav, frames=12)
    assert 0.01 <= stats["rms"] <= 0.5 and stats["clipped_fraction"] < 0.5


@pytest.mark.slow
def test_decoder_audio_is_not_degenerate_at_real_geometry():
    from omnilab.checkpoint.configs import decoder_config_dict
    from omnilab.config import Code2WavConfig
    from omnilab.models.code2wav import Code2Wav, init_random_

    cfg = Code2WavConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in decoder_config_dict("0.6b").items()})
    model = ck._build(lambda: Code2Wav(cfg), init_random_, 0, "code2wav")
    stats = ck._audio_check(model, frames=8)
    assert 0.01 <= stats["rms"] <= 0.5 and stats["clipped_fraction"] < 0.5


@pytest.mark.parametrize("size, talker_params, spk_params", [("0.6b", 905_788_672, 8_854_336),
                                                              ("1.7b", 1_916_676_352, 12_001_088)])
def test_real_geometry_has_the_released_parameter_counts(size, talker_params, spk_params):
    """docs/model.md#parameter-counts counts, from modules built on the meta device (no memory)."""
    from omnilab.checkpoint.configs import config_dict, decoder_config_dict
    from omnilab.config import Code2WavConfig
    from omnilab.checkpoint.load import meta_init
    from omnilab.models.code2wav import Code2Wav
    from omnilab.models.speaker_encoder import SpeakerEncoder
    from omnilab.models.talker import Talker

    cfg = Qwen3TTSConfig.from_dict(config_dict(size, "base"))
    dec = Code2WavConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in decoder_config_dict(size).items()})
    count = lambda m: sum(t.numel() for t in m.state_dict().values())  # noqa: E731
    with meta_init():
        assert count(Talker(cfg)) == talker_params
        assert count(SpeakerEncoder(cfg.speaker_encoder)) == spk_params
        assert count(Code2Wav(dec)) == 114_323_137
    assert (cfg.has_mtp_projection, cfg.tts_model_size) == (size == "1.7b", {"0.6b": "0b6", "1.7b": "1b7"}[size])


def test_mid_has_the_projection_and_1b7_size(tmp_path):
    from omnilab.checkpoint.configs import config_dict

    cfg = Qwen3TTSConfig.from_dict(config_dict("mid", "custom_voice"))
    assert cfg.has_mtp_projection and cfg.tts_model_size == "1b7" and cfg.accepts_instruct


def test_refuses_to_overwrite_and_rejects_bad_arguments(ckpts, tmp_path):
    with pytest.raises(CheckpointError, match="overwrite=True"):
        ck.make_random_checkpoint(ckpts["custom_voice"], "tiny", "custom_voice")
    with pytest.raises(ConfigError, match="tiny, mid, 0.6b, 1.7b"):
        ck.make_random_checkpoint(tmp_path / "x", "huge")
    with pytest.raises(ConfigError, match="custom_voice, voice_design, base"):
        ck.make_random_checkpoint(tmp_path / "x", "tiny", "clone")
    assert not (tmp_path / "x").exists()


def test_overwrite_replaces_atomically(tmp_path):
    p = ck.make_random_checkpoint(tmp_path / "c", "tiny", "voice_design", seed=3)
    ck.make_random_checkpoint(p, "tiny", "custom_voice", seed=3, overwrite=True)
    assert json.loads((p / "config.json").read_text())["tts_model_type"] == "custom_voice"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c"]


def test_default_checkpoint_is_made_once_even_when_raced(tmp_path, monkeypatch, request):
    monkeypatch.setenv("OMNILAB_CACHE", str(tmp_path / "cache"))
    # reuse the converted tokenizer instead of converting again
    src = Path(request.config.cache.mkdir("omnilab-cache")) / "tokenizer"
    if src.is_dir():
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "tokenizer").symlink_to(src, target_is_directory=True)
    results, errors = [], []

    def run():
        try:
            results.append(ck.default_checkpoint())
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path.parent == tmp_path / "cache" / "checkpoints" and _files(path) == RELEASED_FILES
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ck.default_checkpoint() == path and (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir() if not p.name.startswith(".lock")] == [path.name]


# ---- the official reference loads what we write ------------------------------------------------------
from _reference import reference_python as _reference_python  # noqa: E402


REF_SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    try:
        import torchaudio  # noqa: F401
    except Exception:  # the 12 Hz path never uses it; give qwen_tts an importable stub
        stub = tempfile.mkdtemp()
        os.makedirs(os.path.join(stub, "torchaudio", "compliance"))
        open(os.path.join(stub, "torchaudio", "__init__.py"), "w").write("from . import compliance\\n")
        open(os.path.join(stub, "torchaudio", "compliance", "__init__.py"), "w").write("from . import kaldi\\n")
        open(os.path.join(stub, "torchaudio", "compliance", "kaldi.py"), "w").write("")
        for m in [m for m in sys.modules if m.startswith("torchaudio")]:
            del sys.modules[m]
        sys.path.insert(0, stub)
    import torch
    from safetensors import safe_open
    from qwen_tts import Qwen3TTSModel
    ck = sys.argv[1]
    tts = Qwen3TTSModel.from_pretrained(ck, device_map="cpu", dtype=torch.float32)
    def load(f):
        with safe_open(f, "pt") as h:
            return {k: h.get_tensor(k) for k in h.keys()}
    out = {}
    ref_main = {k: v for k, v in tts.model.state_dict().items() if not k.startswith("speech_tokenizer.")}
    ref_codec = tts.model.speech_tokenizer.model.state_dict()
    for name, ref, fil in (("model", ref_main, load(ck + "/model.safetensors")),
                           ("speech_tokenizer", ref_codec, load(ck + "/speech_tokenizer/model.safetensors"))):
        out[name] = {"missing": sorted(set(ref) - set(fil)), "unexpected": sorted(set(fil) - set(ref)),
                     "differ": sorted(k for k in set(ref) & set(fil)
                                      if ref[k].shape != fil[k].shape or not torch.equal(ref[k], fil[k].to(ref[k].dtype)))}
    print(json.dumps(out))
""")


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["custom_voice", "base"])
def test_official_reference_loads_with_no_missing_or_unexpected_keys(ckpts, variant):
    py = _reference_python()
    if py is None:
        pytest.skip("no reference environment (set OMNILAB_REF_PYTHON)")
    out = subprocess.run([py, "-c", REF_SCRIPT, str(ckpts[variant])], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for part in ("model", "speech_tokenizer"):
        assert report[part] == {"missing": [], "unexpected": [], "differ": []}, part
