"""The talker and code-predictor geometries (the one copy of those widths), and ``config.json`` dicts built from them.

Contract: ``TALKER_GEOMETRIES`` maps each checkpoint size (``"tiny"``, ``"mid"``, ``"0.6b"``, ``"1.7b"``) to the
talker + code-predictor widths and depths; :mod:`omnilab.checkpoint.configs` builds its ``Geometry`` (and so
every random checkpoint) from these dicts, since ``models`` may not import ``checkpoint``. The rest of a
checkpoint's geometry (codec decoder, Mimi and speaker encoders) lives in ``checkpoint/configs.py``.
:func:`config_dict` returns a plain dict that :meth:`omnilab.config.Qwen3TTSConfig.from_dict` accepts;
every codec/text id is the released one, only the widths and depths shrink. ``config(variant, size)``
parses to the same talker and code-predictor config as the random checkpoint of that geometry
(tests/checkpoint/test_random.py checks it). Used by the model tests and the talker benchmark; no tensors
are created here.
"""
from __future__ import annotations

from typing import Any

from omnilab.config import LANGUAGE_IDS, SPEAKER_DIALECTS, SPEAKER_IDS, Qwen3TTSConfig

# kv / cp_kv: key-value heads; mrope_section sums to head_dim / 2
REAL_0B6 = dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128, text_hidden=2048,
                mrope_section=(24, 20, 20), cp_hidden=1024, cp_inter=3072, cp_layers=5, cp_heads=16, cp_kv=8,
                cp_head_dim=128)
REAL_1B7 = dict(REAL_0B6, hidden=2048, inter=6144)
TINY = dict(hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16, text_hidden=32, mrope_section=(4, 2, 2),
            cp_hidden=64, cp_inter=128, cp_layers=2, cp_heads=4, cp_kv=2, cp_head_dim=16)
# "mid" mirrors the 1.7B structure: predictor narrower than the talker -> small_to_mtp_projection.
MID = dict(hidden=256, inter=768, layers=4, heads=8, kv=4, head_dim=32, text_hidden=128, mrope_section=(6, 5, 5),
           cp_hidden=128, cp_inter=384, cp_layers=2, cp_heads=4, cp_kv=2, cp_head_dim=32)
TALKER_GEOMETRIES = {"tiny": TINY, "mid": MID, "0.6b": REAL_0B6, "1.7b": REAL_1B7}


def config_dict(variant: str = "custom_voice", size: str = "0b6", *, geometry: dict | None = None,
                **overrides: Any) -> dict:
    """``config.json`` dict. ``geometry``: widths (default :data:`TINY`); ``overrides`` update its keys
    (e.g. ``hidden=96`` to get a 1.7B-like model with ``small_to_mtp_projection``)."""
    g = dict(TINY if geometry is None else geometry, **overrides)
    talker = {
        "hidden_size": g["hidden"], "intermediate_size": g["inter"], "num_hidden_layers": g["layers"],
        "num_attention_heads": g["heads"], "num_key_value_heads": g["kv"], "head_dim": g["head_dim"],
        "vocab_size": 3072, "text_vocab_size": 151936, "text_hidden_size": g["text_hidden"],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "num_code_groups": 16, "hidden_act": "silu", "attention_bias": False,
        "rope_scaling": {"interleaved": True, "mrope_section": list(g["mrope_section"]), "rope_type": "default",
                         "type": "default"},
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "codec_language_id": dict(LANGUAGE_IDS),
        "spk_id": dict(SPEAKER_IDS) if variant == "custom_voice" else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if variant == "custom_voice" else {},
        "code_predictor_config": {
            "hidden_size": g["cp_hidden"], "intermediate_size": g["cp_inter"],
            "num_hidden_layers": g["cp_layers"], "num_attention_heads": g["cp_heads"],
            "num_key_value_heads": g["cp_kv"], "head_dim": g["cp_head_dim"], "vocab_size": 2048,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 65536,
            "num_code_groups": 16, "hidden_act": "silu", "attention_bias": False,
        },
    }
    d = {"tts_model_type": variant, "tts_model_size": size, "talker_config": talker,
         "tokenizer_type": "qwen3_tts_tokenizer_12hz"}
    if variant == "base":
        d["speaker_encoder_config"] = {"enc_dim": g["hidden"], "sample_rate": 24000}
    return d


def config(variant: str = "custom_voice", size: str = "0b6", **kw: Any) -> Qwen3TTSConfig:
    return Qwen3TTSConfig.from_dict(config_dict(variant, size, **kw))
