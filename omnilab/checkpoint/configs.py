"""The JSON files of a Qwen3-TTS 12 Hz model directory, written in the released layout and key order.

Contract: ``config_json(size, variant)``, ``speech_tokenizer_config_json(size)`` and friends return the exact
text that :func:`omnilab.checkpoint.random.make_random_checkpoint` writes. Every geometry key is written
explicitly (docs/model.md#explicit-config-defaults: the upstream class defaults are Omni leftovers). ``"0.6b"``/``"1.7b"`` use the
released geometry (docs/model.md#explicit-config-defaults; the 1.7B CustomVoice ``config.json`` matches the public copy byte for
byte, minus the mirror's ``auto_map``); ``"tiny"`` and ``"mid"`` shrink widths and layer counts but keep
every vocabulary size, id, code-group count and upsampling rate. The talker and code-predictor widths of every
size come from their one copy, ``omnilab.models.tiny.TALKER_GEOMETRIES`` (the model tests build their networks
from the same dicts; ``models`` may not import ``checkpoint``, so the copy lives there); the codec decoder,
Mimi and speaker-encoder widths live here. No torch import.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from omnilab.config import (
    ASSISTANT_ID, CODEBOOK_SIZE, IM_END_ID, IM_START_ID, LANGUAGE_IDS, NUM_CODE_GROUPS, SAMPLE_RATE,
    SAMPLES_PER_FRAME, SPEAKER_DIALECTS, SPEAKER_IDS, TTS_BOS_ID, TTS_EOS_ID, TTS_PAD_ID, VARIANTS,
)
from omnilab.errors import ConfigError
from omnilab.models.tiny import TALKER_GEOMETRIES

CHECKPOINT_SIZES = ("tiny", "mid", "0.6b", "1.7b")
TRANSFORMERS_VERSION = "4.57.3"


@dataclass(frozen=True)
class Geometry:
    """Widths and layer counts of one checkpoint size (everything else is fixed by the model family)."""
    model_size: str  # tts_model_size written to config.json ("0b6" or "1b7")
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    text_hidden: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    cp_hidden: int
    cp_inter: int
    cp_layers: int
    cp_heads: int
    cp_kv_heads: int
    cp_head_dim: int
    ecapa_channels: tuple[int, ...]  # last = sum of the 3 SE-Res2Net widths
    ecapa_attention: int
    ecapa_se: int
    dec_latent: int
    dec_hidden: int
    dec_inter: int
    dec_layers: int
    dec_heads: int
    dec_head_dim: int
    dec_dim: int
    dec_codebook_dim: int
    mimi_filters: int
    mimi_hidden: int
    mimi_layers: int
    mimi_heads: int
    mimi_head_dim: int
    mimi_inter: int
    mimi_codebook_dim: int
    released: bool = False  # real geometry: speaker_encoder_config carries only enc_dim and sample_rate


_REAL_CODEC = dict(
    ecapa_channels=(512, 512, 512, 512, 1536), ecapa_attention=128, ecapa_se=128,
    dec_latent=1024, dec_hidden=512, dec_inter=1024, dec_layers=8, dec_heads=16, dec_head_dim=64, dec_dim=1536,
    dec_codebook_dim=512, mimi_filters=64, mimi_hidden=512, mimi_layers=8, mimi_heads=8, mimi_head_dim=64,
    mimi_inter=2048, mimi_codebook_dim=256, released=True)


def _talker(size: str) -> dict:
    """The talker and code-predictor fields of ``size``, from their one copy in ``omnilab.models.tiny``."""
    g = TALKER_GEOMETRIES[size]
    return dict(hidden=g["hidden"], inter=g["inter"], layers=g["layers"], heads=g["heads"], kv_heads=g["kv"],
                head_dim=g["head_dim"], text_hidden=g["text_hidden"], mrope_section=tuple(g["mrope_section"]),
                cp_hidden=g["cp_hidden"], cp_inter=g["cp_inter"], cp_layers=g["cp_layers"], cp_heads=g["cp_heads"],
                cp_kv_heads=g["cp_kv"], cp_head_dim=g["cp_head_dim"])


GEOMETRIES: dict[str, Geometry] = {
    "tiny": Geometry(
        model_size="0b6", **_talker("tiny"),
        ecapa_channels=(32, 32, 32, 32, 96), ecapa_attention=16, ecapa_se=16,
        dec_latent=64, dec_hidden=32, dec_inter=64, dec_layers=2, dec_heads=2, dec_head_dim=16, dec_dim=48,
        dec_codebook_dim=32, mimi_filters=8, mimi_hidden=32, mimi_layers=1, mimi_heads=2, mimi_head_dim=16,
        mimi_inter=64, mimi_codebook_dim=16),
    "mid": Geometry(
        model_size="1b7", **_talker("mid"),
        ecapa_channels=(64, 64, 64, 64, 192), ecapa_attention=32, ecapa_se=32,
        dec_latent=256, dec_hidden=128, dec_inter=256, dec_layers=2, dec_heads=4, dec_head_dim=32, dec_dim=192,
        dec_codebook_dim=128, mimi_filters=16, mimi_hidden=64, mimi_layers=2, mimi_heads=4, mimi_head_dim=16,
        mimi_inter=128, mimi_codebook_dim=32),
    "0.6b": Geometry(model_size="0b6", **_talker("0.6b"), **_REAL_CODEC),
    "1.7b": Geometry(model_size="1b7", **_talker("1.7b"), **_REAL_CODEC),
}

def geometry(size: str) -> Geometry:
    if size not in GEOMETRIES:
        raise ConfigError(f"checkpoint size {size!r}; accepted: {', '.join(CHECKPOINT_SIZES)}")
    return GEOMETRIES[size]


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ConfigError(f"variant {variant!r}; accepted: {', '.join(VARIANTS)}")


def _code_predictor_config(g: Geometry) -> dict:
    """The full PretrainedConfig dump the released file carries, in its key order."""
    return {
        "_name_or_path": "", "add_cross_attention": False, "architectures": None, "attention_bias": False,
        "attention_dropout": 0, "bad_words_ids": None, "begin_suppress_tokens": None, "bos_token_id": None,
        "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None, "decoder_start_token_id": None,
        "diversity_penalty": 0.0, "do_sample": False, "early_stopping": False, "encoder_no_repeat_ngram_size": 0,
        "eos_token_id": None, "exponential_decay_length_penalty": None, "finetuning_task": None,
        "forced_bos_token_id": None, "forced_eos_token_id": None, "head_dim": g.cp_head_dim, "hidden_act": "silu",
        "hidden_size": g.cp_hidden, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_range": 0.02,
        "intermediate_size": g.cp_inter, "is_decoder": False, "is_encoder_decoder": False,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "layer_types": ["full_attention"] * g.cp_layers,
        "length_penalty": 1.0, "max_length": 20, "max_position_embeddings": 65536, "max_window_layers": 28,
        "min_length": 0, "model_type": "qwen3_tts_talker_code_predictor", "no_repeat_ngram_size": 0,
        "num_attention_heads": g.cp_heads, "num_beam_groups": 1, "num_beams": 1, "num_code_groups": NUM_CODE_GROUPS,
        "num_hidden_layers": g.cp_layers, "num_key_value_heads": g.cp_kv_heads, "num_return_sequences": 1,
        "output_attentions": False, "output_hidden_states": False, "output_scores": False, "pad_token_id": None,
        "prefix": None, "problem_type": None, "pruned_heads": {}, "remove_invalid_values": False,
        "repetition_penalty": 1.0, "return_dict": True, "return_dict_in_generate": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sep_token_id": None, "sliding_window": None,
        "suppress_tokens": None, "task_specific_params": None, "temperature": 1.0, "tf_legacy_loss": False,
        "tie_encoder_decoder": False, "tie_word_embeddings": False, "tokenizer_class": None, "top_k": 50,
        "top_p": 1.0, "dtype": None, "torchscript": False, "typical_p": 1.0, "use_bfloat16": False,
        "use_cache": True, "use_sliding_window": False, "vocab_size": CODEBOOK_SIZE,
    }


def config_dict(size: str, variant: str, model_size: str | None = None) -> dict:
    """``config.json`` as a dict in the released key order. ``model_size`` overrides ``tts_model_size``."""
    g = geometry(size)
    _check_variant(variant)
    custom = variant == "custom_voice"
    talker = {
        "attention_bias": False, "attention_dropout": 0, "code_predictor_config": _code_predictor_config(g),
        "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
        "codec_language_id": dict(LANGUAGE_IDS), "codec_nothink_id": 2155, "codec_pad_id": 2148,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "spk_id": dict(SPEAKER_IDS) if custom else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if custom else {},
        "head_dim": g.head_dim, "hidden_act": "silu", "hidden_size": g.hidden, "initializer_range": 0.02,
        "intermediate_size": g.inter, "max_position_embeddings": 32768, "model_type": "qwen3_tts_talker",
        "num_attention_heads": g.heads, "num_code_groups": NUM_CODE_GROUPS, "num_hidden_layers": g.layers,
        "num_key_value_heads": g.kv_heads, "position_id_per_seconds": 13, "rms_norm_eps": 1e-06,
        "rope_scaling": {"interleaved": True, "mrope_section": list(g.mrope_section), "rope_type": "default",
                         "type": "default"},
        "rope_theta": 1000000, "sliding_window": None, "text_hidden_size": g.text_hidden,
        "text_vocab_size": 151936, "use_cache": True, "use_sliding_window": False, "vocab_size": 3072,
    }
    out = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "assistant_token_id": ASSISTANT_ID, "im_end_token_id": IM_END_ID, "im_start_token_id": IM_START_ID,
        "tts_bos_token_id": TTS_BOS_ID, "tts_eos_token_id": TTS_EOS_ID, "tts_pad_token_id": TTS_PAD_ID,
        "model_type": "qwen3_tts", "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": model_size or g.model_size, "tts_model_type": variant, "talker_config": talker,
    }
    if variant == "base":
        spk = {"enc_dim": g.hidden, "sample_rate": SAMPLE_RATE}
        if not g.released:  # shrunk ECAPA: the class defaults would not fit, so write every field
            spk.update({"mel_dim": 128, "enc_channels": list(g.ecapa_channels), "enc_kernel_sizes": [5, 3, 3, 3, 1],
                        "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": g.ecapa_attention,
                        "enc_res2net_scale": 8, "enc_se_channels": g.ecapa_se})
        out["speaker_encoder_config"] = spk
    out["transformers_version"] = TRANSFORMERS_VERSION
    return out


def config_json(size: str, variant: str, model_size: str | None = None) -> str:
    return json.dumps(config_dict(size, variant, model_size), indent=2, ensure_ascii=False)


def encoder_config_dict(size: str) -> dict:
    """``encoder_config`` (a transformers MimiConfig; only Base ICL uses it)."""
    g = geometry(size)
    return {
        "_frame_rate": 12.5, "audio_channels": 1, "codebook_dim": g.mimi_codebook_dim, "codebook_size": CODEBOOK_SIZE,
        "compress": 2, "dilation_growth_rate": 2, "head_dim": g.mimi_head_dim, "hidden_act": "gelu",
        "hidden_size": g.mimi_hidden, "intermediate_size": g.mimi_inter, "kernel_size": 7, "last_kernel_size": 3,
        "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000, "model_type": "mimi",
        "norm_eps": 1e-05, "num_attention_heads": g.mimi_heads, "num_filters": g.mimi_filters,
        "num_hidden_layers": g.mimi_layers, "num_key_value_heads": g.mimi_heads, "num_quantizers": 32,
        "num_residual_layers": 1, "num_semantic_quantizers": 1, "pad_mode": "constant", "residual_kernel_size": 3,
        "rope_theta": 10000.0, "sampling_rate": SAMPLE_RATE, "sliding_window": 250, "trim_right_ratio": 1.0,
        "upsample_groups": g.mimi_hidden, "upsampling_ratios": [8, 6, 5, 4], "use_causal_conv": True,
        "use_conv_shortcut": False, "vector_quantization_hidden_dimension": g.mimi_codebook_dim,
    }


def decoder_config_dict(size: str) -> dict:
    """``decoder_config`` (code2wav), every key explicit (the class defaults are the Omni decoder's)."""
    g = geometry(size)
    return {
        "attention_bias": False, "attention_dropout": 0.0, "codebook_dim": g.dec_codebook_dim,
        "codebook_size": CODEBOOK_SIZE, "decoder_dim": g.dec_dim, "head_dim": g.dec_head_dim, "hidden_act": "silu",
        "hidden_size": g.dec_hidden, "intermediate_size": g.dec_inter, "latent_dim": g.dec_latent,
        "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000, "num_attention_heads": g.dec_heads,
        "num_hidden_layers": g.dec_layers, "num_key_value_heads": g.dec_heads, "num_quantizers": NUM_CODE_GROUPS,
        "num_semantic_quantizers": 1, "rms_norm_eps": 1e-05, "rope_theta": 10000, "semantic_codebook_size": 4096,
        "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
        "vector_quantization_hidden_dimension": g.dec_codebook_dim,
    }


def speech_tokenizer_config_dict(size: str) -> dict:
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": NUM_CODE_GROUPS, "input_sample_rate": SAMPLE_RATE,
        "output_sample_rate": SAMPLE_RATE, "decode_upsample_rate": SAMPLES_PER_FRAME,
        "encode_downsample_rate": SAMPLES_PER_FRAME, "encoder_config": encoder_config_dict(size),
        "decoder_config": decoder_config_dict(size), "transformers_version": TRANSFORMERS_VERSION,
    }


def speech_tokenizer_config_json(size: str) -> str:
    return json.dumps(speech_tokenizer_config_dict(size), indent=2) + "\n"


def generation_config_json() -> str:
    """Exactly the released 245-byte file (2-space indent, no trailing newline)."""
    return json.dumps({
        "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
        "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
        "max_new_tokens": 8192}, indent=2)


def speech_preprocessor_config_json() -> str:
    """``speech_tokenizer/preprocessor_config.json``: the 234-byte EncodecFeatureExtractor file."""
    return json.dumps({
        "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
        "overlap": None, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
        "sampling_rate": SAMPLE_RATE}, indent=2, sort_keys=True) + "\n"


def preprocessor_config_json() -> str:
    """Root ``preprocessor_config.json`` (text-only ``Qwen3TTSProcessor``; official bytes unknown)."""
    return json.dumps({"processor_class": "Qwen3TTSProcessor"}, indent=2) + "\n"


def modelscope_configuration_json() -> str:
    """``speech_tokenizer/configuration.json``: ModelScope metadata, read by no code path."""
    return json.dumps({"framework": "pytorch", "task": "text-to-speech", "allow_remote": True})
