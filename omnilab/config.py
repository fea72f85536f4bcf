"""Model configuration for the Qwen3-TTS 12 Hz family, as frozen dataclasses.

Contract: this module reads and writes the *released* JSON files (``config.json``,
``generation_config.json``, ``speech_tokenizer/config.json``) and validates their geometry.
It imports no torch. Every geometry field is read explicitly: the upstream class defaults are
Qwen3-Omni leftovers (num_code_groups 32, decoder hidden 1024, codec ids 4196+), so a missing key
is an error here, never a silent default (docs/model.md#explicit-config-defaults).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omnilab.errors import ConfigError

# Text-vocabulary ids of the chat template and the TTS text specials (Qwen2/Qwen3 vocabulary).
IM_START_ID = 151644
IM_END_ID = 151645
ASSISTANT_ID = 77091
TTS_PAD_ID = 151671
TTS_BOS_ID = 151672
TTS_EOS_ID = 151673

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
NUM_CODE_GROUPS = 16
CODEBOOK_SIZE = 2048

VARIANTS = ("custom_voice", "voice_design", "base")
SIZES = ("0b6", "1b7")

LANGUAGE_IDS = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
    "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
    "beijing_dialect": 2074, "sichuan_dialect": 2062,
}
SPEAKER_IDS = {
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECTS = {name: False for name in SPEAKER_IDS} | {
    "eric": "sichuan_dialect", "dylan": "beijing_dialect"}


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: required key {key!r} is missing")
    return d[key]


def _pick(cls, d: Mapping[str, Any], where: str, **overrides):
    """Build dataclass ``cls`` from ``d``: required fields must be present, optional ones default."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif f.name in d:
            v = d[f.name]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: required key {f.name!r} is missing")
    return cls(**kwargs)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class DecoderLMConfig:
    """Shape of a Qwen3-style decoder stack (talker, code predictor)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    num_code_groups: int = NUM_CODE_GROUPS
    hidden_act: str = "silu"
    attention_bias: bool = False

    def validate(self, where: str) -> None:
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
               f"num_key_value_heads {self.num_key_value_heads}")
        _check(self.num_code_groups == NUM_CODE_GROUPS,
               f"{where}: num_code_groups is {self.num_code_groups}; the 12 Hz models use {NUM_CODE_GROUPS}")
        _check(self.hidden_act == "silu", f"{where}: hidden_act {self.hidden_act!r}; only 'silu' is supported")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "vocab_size"):
            _check(getattr(self, name) > 0, f"{where}: {name} must be > 0")


@dataclass(frozen=True)
class TalkerConfig(DecoderLMConfig):
    """``talker_config``: the codec LM. Codec ids index ``codec_embedding``/``codec_head``."""
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_language_id: Mapping[str, int] = field(default_factory=dict)
    spk_id: Mapping[str, int] = field(default_factory=dict)
    spk_is_dialect: Mapping[str, Any] = field(default_factory=dict)
    rope_scaling: Mapping[str, Any] | None = None

    def validate(self, where: str = "talker_config") -> None:
        super().validate(where)
        _check(self.vocab_size > self.codec_eos_token_id,
               f"{where}: vocab_size {self.vocab_size} does not hold codec ids up to {self.codec_eos_token_id}")
        _check(self.text_vocab_size > TTS_EOS_ID,
               f"{where}: text_vocab_size {self.text_vocab_size} must exceed {TTS_EOS_ID}")
        for name, idx in list(self.codec_language_id.items()) + list(self.spk_id.items()):
            _check(0 <= int(idx) < self.vocab_size, f"{where}: id {idx} for {name!r} is outside the codec vocabulary")


@dataclass(frozen=True)
class CodePredictorConfig(DecoderLMConfig):
    """``talker_config.code_predictor_config``: 5-layer MTP decoder producing codebooks 1..15."""
    max_position_embeddings: int = 65536


@dataclass(frozen=True)
class Code2WavConfig:
    """``speech_tokenizer/config.json`` ``decoder_config`` (code2wav)."""
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    latent_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8000
    layer_scale_initial_scale: float = 0.01
    num_semantic_quantizers: int = 1
    semantic_codebook_size: int = 4096
    vector_quantization_hidden_dimension: int = 512
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in tuple(self.upsample_rates) + tuple(self.upsampling_ratios):
            n *= r
        return n

    def validate(self, where: str = "decoder_config") -> None:
        _check(self.num_quantizers == NUM_CODE_GROUPS,
               f"{where}: num_quantizers is {self.num_quantizers}; expected {NUM_CODE_GROUPS}")
        _check(self.codebook_dim % 2 == 0, f"{where}: codebook_dim must be even")
        _check(self.samples_per_frame == SAMPLES_PER_FRAME,
               f"{where}: upsample_rates x upsampling_ratios give {self.samples_per_frame} samples per frame; "
               f"expected {SAMPLES_PER_FRAME}")
        _check(self.sliding_window > 0, f"{where}: sliding_window must be > 0")


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """ECAPA-TDNN speaker encoder (Base only). Defaults are the released class defaults."""
    enc_dim: int
    sample_rate: int = SAMPLE_RATE
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    """``speech_tokenizer/config.json``. The Mimi ``encoder_config`` is kept as a plain dict."""
    decoder: Code2WavConfig
    encoder: Mapping[str, Any]
    encoder_valid_num_quantizers: int = NUM_CODE_GROUPS
    input_sample_rate: int = SAMPLE_RATE
    output_sample_rate: int = SAMPLE_RATE
    decode_upsample_rate: int = SAMPLES_PER_FRAME
    encode_downsample_rate: int = SAMPLES_PER_FRAME

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpeechTokenizerConfig":
        dec = _pick(Code2WavConfig, _req(d, "decoder_config", "speech_tokenizer/config.json"),
                    "speech_tokenizer decoder_config")
        dec.validate()
        out = _pick(cls, d, "speech_tokenizer/config.json", decoder=dec,
                    encoder=dict(d.get("encoder_config") or {}))
        _check(out.output_sample_rate == SAMPLE_RATE and out.decode_upsample_rate == SAMPLES_PER_FRAME,
               f"speech_tokenizer/config.json: output {out.output_sample_rate} Hz x {out.decode_upsample_rate} "
               f"samples per frame; only the 12 Hz codec (24000 Hz, 1920) is supported")
        return out

    @classmethod
    def load(cls, path: str | Path) -> "SpeechTokenizerConfig":
        return cls.from_dict(_read_json(Path(path)))


@dataclass(frozen=True)
class Qwen3TTSConfig:
    """Top-level ``config.json`` (model_type ``qwen3_tts``)."""
    tts_model_type: str
    tts_model_size: str
    talker: TalkerConfig
    code_predictor: CodePredictorConfig
    speaker_encoder: SpeakerEncoderConfig | None = None
    im_start_token_id: int = IM_START_ID
    im_end_token_id: int = IM_END_ID
    assistant_token_id: int = ASSISTANT_ID
    tts_pad_token_id: int = TTS_PAD_ID
    tts_bos_token_id: int = TTS_BOS_ID
    tts_eos_token_id: int = TTS_EOS_ID
    transformers_version: str | None = None  # decides the official text pre-tokenizer (omnilab.tokenizer)
    model_type: str = "qwen3_tts"
    # a pack-quantized checkpoint's entry, as read (checked by omnilab.checkpoint.quantized.parse_scheme)
    quantization_config: Any = field(default=None, compare=False, repr=False)

    @property
    def has_mtp_projection(self) -> bool:
        """1.7B: the predictor projects talker-width inputs down with ``small_to_mtp_projection``."""
        return self.talker.hidden_size != self.code_predictor.hidden_size

    @property
    def accepts_instruct(self) -> bool:
        """The official package drops ``instruct`` for the 0.6B CustomVoice and for Base."""
        if self.tts_model_type == "voice_design":
            return True
        return self.tts_model_type == "custom_voice" and self.tts_model_size != "0b6"

    @property
    def languages(self) -> tuple[str, ...]:
        """Accepted ``language`` values: ``auto`` plus every non-dialect language key."""
        return ("auto",) + tuple(k for k in self.talker.codec_language_id if "dialect" not in k)

    @property
    def speakers(self) -> tuple[str, ...]:
        return tuple(self.talker.spk_id)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Qwen3TTSConfig":
        where = "config.json"
        tc = dict(_req(d, "talker_config", where))
        cpc = dict(_req(tc, "code_predictor_config", "talker_config"))
        talker = _pick(TalkerConfig, tc, "talker_config")
        talker.validate()
        cp = _pick(CodePredictorConfig, cpc, "code_predictor_config")
        cp.validate("code_predictor_config")
        _check(cp.vocab_size == CODEBOOK_SIZE,
               f"code_predictor_config: vocab_size {cp.vocab_size}; expected {CODEBOOK_SIZE}")
        mtype = _req(d, "tts_model_type", where)
        _check(mtype in VARIANTS, f"{where}: tts_model_type {mtype!r}; accepted: {', '.join(VARIANTS)}")
        size = _req(d, "tts_model_size", where)
        spk = None
        if mtype == "base":
            sd = dict(_req(d, "speaker_encoder_config", where))
            spk = _pick(SpeakerEncoderConfig, sd, "speaker_encoder_config")
            _check(spk.enc_dim == talker.hidden_size,
                   f"speaker_encoder_config: enc_dim {spk.enc_dim} must equal talker hidden_size {talker.hidden_size}")
        return _pick(cls, d, where, talker=talker, code_predictor=cp, speaker_encoder=spk,
                     tts_model_type=mtype, tts_model_size=size)

    @classmethod
    def load(cls, path: str | Path) -> "Qwen3TTSConfig":
        return cls.from_dict(_read_json(Path(path)))


@dataclass(frozen=True)
class GenerationDefaults:
    """``generation_config.json`` (read as a plain dict, as the official package does)."""
    do_sample: bool = True
    repetition_penalty: float = 1.05
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 50
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_p: float = 1.0
    subtalker_top_k: int = 50
    max_new_tokens: int = 2048  # the official fallback; the released file says 8192

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GenerationDefaults":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> "GenerationDefaults":
        return cls.from_dict(_read_json(Path(path)))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"missing file: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


# ---- weight-only quantization of the talker's decode matrices
# (docs/kernels.md#quantized-decode-matrices-in-the-deploy-profile)
# The names and group sizes every layer shares: the planner's profile field, the loader, the kernels, the CLI.
QUANT_METHODS = ("int8", "int4")       # weight formats: bits of one matrix's codes
# Recipes: the format of each of the four parts a decode step streams (quant_part). The predictor stays >= int8
# unless a recipe says otherwise: the vendor advises against quantizing the code predictor, and the GGUF ports
# ship a q5_k talker with a q8_0 predictor (docs/quantization.md#recipes).
QUANT_PARTS = ("talker_layers", "codec_head", "predictor_layers", "predictor_heads")
QUANT_RECIPES = {"int8": ("int8", "int8", "int8", "int8"),
                 "int4": ("int4", "int4", "int8", "int8"),
                 "int4-all": ("int4", "int4", "int4", "int4")}
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 128
QUANT_SPELLINGS = ("'none', 'int8', 'int4', 'int4-all', each int4 one with a group suffix "
                   "('int4-g32', 'int4-g64', 'int4-g128', 'int4-all-g32', ...)")


def has_int4(recipe: str) -> bool:
    """Whether the recipe stores some part in int4 (so it has a group size)."""
    return recipe in QUANT_RECIPES and "int4" in QUANT_RECIPES[recipe]


def quant_part(name: str) -> str:
    """The part (:data:`QUANT_PARTS`) of a talker decode matrix named without ``talker.``."""
    if name.startswith("code_predictor."):
        return "predictor_layers" if ".layers." in name else "predictor_heads"  # heads + 1.7B input projection
    return "codec_head" if name.startswith("codec_head") else "talker_layers"


def part_format(recipe: str, name: str) -> str:
    """``"int8"`` / ``"int4"``: how ``recipe`` stores the decode matrix ``name`` (without ``talker.``)."""
    return QUANT_RECIPES[recipe][QUANT_PARTS.index(quant_part(name))]


def parse_quantization(value: Any, where: str) -> tuple[str, int | None]:
    """``(recipe, group_size)`` of a quantization spelling: None / ``"none"`` -> ("none", None); ``"int8"``;
    ``"int4"`` / ``"int4-all"`` (group not given: None) or with a group, ``"int4-g64"``, ``"int4-all-g32"`` (also
    ``"int4/64"``). ``ConfigError`` otherwise, naming the accepted values."""
    key = "none" if value is None else str(value).strip().lower()
    method, _, group = key.replace("/", "-g", 1).partition("-g")
    if isinstance(value, bool) or method not in ("none",) + tuple(QUANT_RECIPES) or (group and not has_int4(method)):
        raise ConfigError(f"{where}={value!r} is not a quantization; accepted: {QUANT_SPELLINGS}")
    if not group:
        return method, None
    if not group.isdigit() or int(group) not in INT4_GROUP_SIZES:
        raise ConfigError(f"{where}={value!r}: int4 group size {group!r}; accepted: "
                          f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    return method, int(group)


def quantization_spelling(method: str, group_size: int | None = None) -> str:
    """The canonical spelling (``"none"``, ``"int8"``, ``"int4-g128"``, ``"int4-all-g32"``; ``"int4"`` while the
    group is open)."""
    return f"{method}-g{group_size}" if has_int4(method) and group_size else method


def int4_groups_fitting(ks: Any) -> tuple[int, ...]:
    """The int4 group sizes that divide every decode matrix's input width K (a group never spans two rows)."""
    ks = sorted({int(k) for k in ks})
    return tuple(s for s in INT4_GROUP_SIZES if all(k % s == 0 for k in ks))


def stored_quantization(quantization_config: Any) -> str:
    """The spelling of what a ``config.json`` ``quantization_config`` stores (``none`` without one): ``int8`` for
    8-bit weights, ``int4-g<group>`` for 4-bit and 8-bit groups (the mixed recipe), ``int4-all-g<group>`` for 4 bits
    alone. Only reads the scheme; ``checkpoint.quantized.parse_scheme``
    checks it (an unsupported entry is refused at load, whatever is read here)."""
    if not isinstance(quantization_config, Mapping):
        return "none"
    groups = [g.get("weights") or {} for g in (quantization_config.get("config_groups") or {}).values()
              if isinstance(g, Mapping)]
    bits = {w.get("num_bits") for w in groups}
    int4 = [w for w in groups if w.get("num_bits") == 4 and w.get("group_size") in INT4_GROUP_SIZES]
    if bits == {8}:
        return "int8"
    if int4:  # with an 8-bit group too: the int4 recipe (int8 predictor); 4 bits alone: int4-all
        return f"{'int4' if 8 in bits else 'int4-all'}-g{int4[0]['group_size']}"
    return "none"
