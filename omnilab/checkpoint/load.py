"""Resolve, validate and load a Qwen3-TTS 12 Hz checkpoint directory (safetensors only).

Contract:
- ``resolve_checkpoint(path_or_hub_id)`` returns a local directory: an existing path as is, or an
  ``Org/Name`` hub id through ``huggingface_hub.snapshot_download``. Offline (``HF_HUB_OFFLINE``) or an
  unreachable hub fails within a few seconds (reachability is probed with a short timeout first; a
  snapshot already in the local HF cache is still used) with a ``CheckpointError`` that says how to pass
  a local path instead.
- ``validate_checkpoint_dir(path)`` names every missing required file.
- ``load_model(path_or_id, dtype=None, load_encoders="auto") -> LoadedModel``: configs, tokenizer and the
  modules, with strict tensor checking (missing/unexpected tensors -> ``CheckpointError``, shape
  mismatches -> ``ConfigError``, each naming the first offending tensors). Modules are built with their
  parameters on the meta device and the file's tensors are assigned one at a time (cast to the compute
  dtype as they are read), so the weights are never held twice. Never unpickles.
- One strict loader for the client and the stage workers (:mod:`omnilab.checkpoint.worker_weights`):
  ``load_strict(factory, index, prefix, dtype, what, streamed=, keep_bf16=, quantize=, mmap=)`` (meta-init a
  module, fill it strictly: names, shapes, dtype policy, quantize at load, huge pages, 64-byte aligned tensors);
  on it, ``load_talker_from`` (the talker's dtype policy, see :data:`UPCAST_TABLES`) and ``load_code2wav_from``;
  ``weight_files(dir, stem)`` (single file or shards), ``TensorIndex`` and ``meta_init()`` (build modules
  without allocating or initialising parameters). ``read_configs(dir)`` parses the two config files once.
- Compute dtype (``resolve_dtype``): the argument, else ``$OMNILAB_DTYPE``, else the measured rule of the talker
  (``tuning.timing.auto_dtype``, docs/kernels.md#measured-dtype-and-linear-paths); always with a reason.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

import torch
from torch import nn

from omnilab import settings
from omnilab.checkpoint.quantized import talker_view
from omnilab.checkpoint.tensor_index import TensorIndex, weight_files
from omnilab.config import GenerationDefaults, Qwen3TTSConfig, SpeechTokenizerConfig
from omnilab.errors import CheckpointError, ConfigError
from omnilab.instrument.progress import bar
from omnilab.models.code2wav import Code2Wav
from omnilab.models.mimi_encoder import MimiEncoder
from omnilab.models.speaker_encoder import SpeakerEncoder
from omnilab.models.talker import Talker
from omnilab.tokenizer import TextTokenizer
from omnilab.tuning.hugepages import hugepages_choice, plan_arena, talker_streamed_name
from omnilab.tuning.storage import weight_storage_choice
from omnilab.tuning.timing import auto_dtype, linear_paths

__all__ = ["LoadedModel", "load_model", "resolve_checkpoint", "validate_checkpoint_dir", "resolve_dtype",
           "REQUIRED_FILES", "weight_files", "TensorIndex", "load_strict", "load_talker_from", "load_code2wav_from",
           "read_configs", "meta_init"]

REQUIRED_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
    "tokenizer_config.json", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_ACCEPTED_DTYPES = "torch.float32, torch.bfloat16, 'float32'/'fp32', 'bfloat16'/'bf16', 'auto' or None"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_SHOW = 5  # offending tensor names shown per category


@dataclass
class LoadedModel:
    """Everything ``load_model`` returns. Modules are in eval mode with ``requires_grad`` off."""
    path: Path
    config: Qwen3TTSConfig
    speech_config: SpeechTokenizerConfig
    generation: GenerationDefaults
    talker: Any  # omnilab.models.talker.Talker (includes the code predictor)
    code2wav: Any  # omnilab.models.code2wav.Code2Wav (fp32)
    speaker_encoder: Any | None  # Base only (fp32)
    mimi_encoder: Any | None  # loaded for Base by default (fp32)
    tokenizer: TextTokenizer
    dtype: torch.dtype
    dtype_reason: str
    quantization: Any = None  # omnilab.kernels.quant.Quantization of the talker (None: not quantized)

    def __repr__(self) -> str:
        return (f"LoadedModel(path={str(self.path)!r}, variant={self.config.tts_model_type!r}, "
                f"size={self.config.tts_model_size!r}, dtype={self.dtype}, speaker_encoder="
                f"{self.speaker_encoder is not None}, mimi_encoder={self.mimi_encoder is not None})")


# ---- dtype ---------------------------------------------------------------------------------------
def _parse_dtype(value: Any, where: str) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        if value in (torch.float32, torch.bfloat16):
            return value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key == "auto":
            return None
        if key in _DTYPES:
            return _DTYPES[key]
    raise ConfigError(f"{where}: unsupported dtype {value!r}; accepted: {_ACCEPTED_DTYPES}")


def resolve_dtype(dtype: Any = None) -> tuple[torch.dtype, str]:
    """``(compute dtype, reason)``: argument > ``$OMNILAB_DTYPE`` > auto-detection."""
    if dtype is not None:
        d = _parse_dtype(dtype, "dtype")
        if d is not None:
            return d, f"requested dtype={dtype}"
    else:
        if (name := settings.env_dtype()) is not None:
            return _DTYPES[name], f"OMNILAB_DTYPE={settings.raw('OMNILAB_DTYPE').strip()}"
    name, why = auto_dtype()  # the planner's rule over this machine's timing (docs/kernels.md)
    return _DTYPES[name], f"auto: {why}"


# ---- resolving ------------------------------------------------------------------------------------
def _probe(url: str, timeout_s: float) -> str | None:
    """``None`` if a TCP connection to ``url``'s host opens within ``timeout_s``, else the reason."""
    import socket

    u = urlparse(url)
    host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
    if not host:
        return f"invalid endpoint {url!r}"
    result: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result.append(None)
        except OSError as e:
            result.append(f"{type(e).__name__}: {e}")

    th = threading.Thread(target=attempt, daemon=True)  # getaddrinfo ignores socket timeouts
    th.start()
    th.join(timeout_s)
    return result[0] if result else f"no answer within {timeout_s:g} s"


def _hub_help(hub_id: str) -> str:
    return (f"Download it where the hub is reachable (e.g. `huggingface-cli download {hub_id} --local-dir DIR`) "
            f"and pass the local directory: load_model('DIR'). For random weights in the same layout use "
            f"omnilab.default_checkpoint() or omnilab.make_random_checkpoint(DIR).")


def _download(hub_id: str, timeout_s: float, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download

    offline = bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    problem = "offline mode (HF_HUB_OFFLINE is set)" if offline else _probe(endpoint, timeout_s)
    if problem is not None:
        try:  # a snapshot cached earlier is fine
            return Path(snapshot_download(hub_id, revision=revision, local_files_only=True))
        except Exception:
            raise CheckpointError(f"cannot load {hub_id!r}: it is not a local directory and the Hugging Face hub "
                                  f"({endpoint}) is unreachable ({problem}); no cached copy either. "
                                  f"{_hub_help(hub_id)}") from None
    try:
        return Path(snapshot_download(hub_id, revision=revision, endpoint=endpoint, etag_timeout=timeout_s))
    except Exception as e:
        raise CheckpointError(f"cannot download {hub_id!r} from {endpoint}: {type(e).__name__}: {e}. "
                              f"{_hub_help(hub_id)}") from None


def resolve_checkpoint(path_or_hub_id: str | os.PathLike, *, timeout_s: float = 3.0,
                       revision: str | None = None) -> Path:
    """A local checkpoint directory for a path or an ``Org/Name`` hub id (see the module docstring)."""
    if not isinstance(path_or_hub_id, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint must be a path or a hub id string, got {type(path_or_hub_id).__name__}")
    p = Path(path_or_hub_id).expanduser()
    if p.is_dir():
        return p.resolve()
    if p.exists():
        raise CheckpointError(f"{p} is a file; pass the checkpoint directory that holds config.json")
    s = os.fspath(path_or_hub_id)
    if isinstance(path_or_hub_id, os.PathLike) or s.startswith((".", "/", "~")) or not _HUB_ID.match(s):
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    return _download(s, timeout_s, revision)


def validate_checkpoint_dir(path: str | os.PathLike) -> Path:
    """Raise ``CheckpointError`` naming every missing required file; return the directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    missing = []
    for name in REQUIRED_FILES:
        if name.endswith(".safetensors"):
            parent, stem = (path / name).parent, Path(name).stem
            files = weight_files(parent, stem)
            if files is None:
                missing.append(name)
            else:
                missing += [str(f.relative_to(path)) for f in files if not f.is_file()]
        elif not (path / name).is_file():
            missing.append(name)
    if missing:
        hint = ""
        if any((path / d / "pytorch_model.bin").is_file() for d in ("", "speech_tokenizer")):
            hint = " (pickled pytorch_model.bin files are never loaded; convert them to safetensors)"
        raise CheckpointError(f"{path} is not a complete Qwen3-TTS checkpoint; missing: {', '.join(missing)}{hint}")
    return path


# ---- strict loading ---------------------------------------------------------------------------------
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextlib.contextmanager
def meta_init():
    """Create every ``nn.Parameter`` on the meta device and skip ``torch.nn.init`` (no memory, no init
    work: random ops on meta tensors would also cost a multi-second lazy import). Buffers stay real."""
    original = nn.Module.register_parameter
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def register(module: nn.Module, name: str, param):
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _names(keys, n: int = _SHOW) -> str:
    keys = list(keys)
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def load_strict(factory: Callable[[], nn.Module], index: TensorIndex, prefix: str, dtype: torch.dtype,
                what: str, *, streamed: Callable[[str], bool] | None = None,
                keep_bf16: Callable[[str, torch.dtype], bool] | None = None, quantize: Any = None, mmap: bool = True
                ) -> nn.Module:
    """Build ``factory()`` with meta parameters and fill it from the ``prefix``-ed tensors of ``index``: the
    one strict loader, for ``load_model`` and for stage workers.

    Names and shapes must match exactly (``CheckpointError`` / ``ConfigError`` naming the first offending
    tensors). Dtypes: floating tensors become ``dtype``, except those ``keep_bf16(name, file dtype)`` selects
    (names without ``prefix``), which stay in the file's bf16; other tensors keep their file dtype.
    ``streamed`` (optional) selects matrices to place in one huge-page :class:`~omnilab.tuning.hugepages.
    WeightArena` (kept as ``module.weight_arena``). ``quantize`` (a :class:`~omnilab.kernels.quant.Quantization`):
    the tensors it ``selects`` become ``QuantizedWeight`` attributes (from the file's values). Every tensor
    starts on a 64-byte boundary (:meth:`TensorIndex.get`). ``mmap=False``: plain file reads for every tensor
    (stage workers: the file's pages never join the resident set); True maps tensors already in their stored dtype."""
    with meta_init():
        module = factory()
    expected = {k: tuple(t.shape) for k, t in module.state_dict().items()}
    present = {k[len(prefix):]: k for k in index.where if k.startswith(prefix)}
    missing = [k for k in expected if k not in present]
    unexpected = sorted(k for k in present if k not in expected)
    mismatched = [f"{prefix}{k} file {index.shape(present[k])} vs config {expected[k]}"
                  for k in expected if k in present and index.shape(present[k]) != expected[k]]
    if missing or unexpected or mismatched:
        parts = []
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {_names(mismatched)}")
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {_names(prefix + k for k in missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {_names(prefix + k for k in unexpected)}")
        msg = f"{what}: the weights do not match the configuration; " + "; ".join(parts)
        if mismatched:
            raise ConfigError(msg + ". Check that config.json / speech_tokenizer/config.json belong to these weights")
        raise CheckpointError(msg)

    for k in [k for k in expected if quantize is not None and quantize.selects(k)]:
        quantize.install(module, k, index.read(present[k]))  # the parameter leaves the state dict
        del expected[k]
    stored = {}
    for k in expected:
        file_dtype = index.dtype(present[k])
        keep = keep_bf16 is not None and file_dtype == torch.bfloat16 and keep_bf16(k, file_dtype)
        stored[k] = file_dtype if keep or not file_dtype.is_floating_point else dtype
    arena, in_arena = plan_arena({k: (shape, stored[k]) for k, shape in expected.items()}, streamed)
    state = {k: (arena.put(index.read(present[k]), stored[k]) if k in in_arena  # arena: file dtype, cast in copy
                 else index.get(present[k], stored[k], mmap=mmap)) for k in bar(expected, desc=what, unit="tensor")}
    module.load_state_dict(state, strict=True, assign=True)
    module.weight_arena, state = arena, None
    leftover = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftover:
        raise CheckpointError(f"{what}: tensors left uninitialised after loading: {_names(leftover)}")
    module.requires_grad_(False)
    return module.eval()


# Talker embedding tables looked up through their nn.Embedding module (a bf16 file table stays bf16 under fp32
# compute, rows upcast exactly). Not the predictor's 15 tables: CodePredictor.generate reads their weights.
UPCAST_TABLES = frozenset({"model.text_embedding.weight", "model.codec_embedding.weight"})


class _UpcastEmbedding(nn.Embedding):
    """An embedding table stored in a narrower dtype whose looked-up rows are cast to ``out_dtype``.
    bf16 -> fp32 is exact, so the rows equal those of an fp32 copy of the table, at half the memory."""
    out_dtype: torch.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.out_dtype)


def load_talker_from(index: TensorIndex, config: Qwen3TTSConfig, dtype: torch.dtype, *, mmap: bool = True,
                     quantization: Any = None) -> nn.Module:
    """The ``Talker`` from ``talker.*`` of ``index`` (client and talker worker alike). Under fp32 compute the streamed
    decode matrices and the text/codec tables (:data:`UPCAST_TABLES`) stay in the file's bf16 (weight_storage_choice);
    huge pages as :func:`streamed_selector` says. ``quantization`` (kept as ``talker.quantization``): decode matrices
    quantized at load, or a packed checkpoint's codes as stored (:func:`~omnilab.checkpoint.quantized.talker_view`)."""
    linear_paths()  # bf16 decode rows / prefill GEMMs as measured here, resolved before any step (docs/kernels.md)
    storage, (index, quantization) = weight_storage_choice(dtype), talker_view(index, quantization, config)
    tables = UPCAST_TABLES if dtype == torch.float32 else frozenset()
    talker = load_strict(lambda: Talker(config), index, "talker.", dtype, "model.safetensors (talker)", mmap=mmap,
                         streamed=streamed_selector(), quantize=quantization,
                         keep_bf16=lambda k, fd: k in tables or storage.keeps_bf16(k, fd))
    talker.weight_storage, talker.quantization = storage, quantization
    for emb in talker.modules():
        if isinstance(emb, nn.Embedding) and emb.weight.dtype != dtype:
            emb.__class__ = _UpcastEmbedding
            emb.out_dtype = dtype
    return talker


def load_code2wav_from(index: TensorIndex, speech: SpeechTokenizerConfig, *, mmap: bool = True) -> nn.Module:
    """The fp32 ``Code2Wav`` decoder from ``decoder.*`` of the speech tokenizer's ``index``."""
    return load_strict(lambda: Code2Wav(speech.decoder), index, "decoder.", torch.float32,
                       "speech_tokenizer/model.safetensors (decoder)", mmap=mmap)


def _unclaimed(index: TensorIndex, prefixes: tuple[str, ...], file: str) -> None:
    stray = sorted(k for k in index.where if not k.startswith(prefixes))
    if stray:
        raise CheckpointError(f"{file}: {len(stray)} unexpected tensor(s) outside {', '.join(prefixes)}: "
                              f"{_names(stray)}")


def streamed_selector() -> Callable[[str], bool] | None:
    """The talker matrices to place in huge pages, or None where :func:`hugepages_choice` says no."""
    return talker_streamed_name if hugepages_choice().enabled else None


def read_configs(path: Path) -> tuple[Qwen3TTSConfig, SpeechTokenizerConfig]:
    """``config.json`` and ``speech_tokenizer/config.json`` of a checkpoint directory, parsed (once per load:
    ``Pipeline.from_pretrained`` plans the deploy profile from them and hands them to :func:`load_model`)."""
    return Qwen3TTSConfig.load(path / "config.json"), SpeechTokenizerConfig.load(path / "speech_tokenizer" / "config.json")


def load_model(path_or_id: str | os.PathLike, dtype: Any = None, load_encoders: bool | str = "auto", *,
               load_talker: bool = True, load_code2wav: bool = True, quantization: Any = None,
               configs: tuple[Qwen3TTSConfig, SpeechTokenizerConfig] | None = None) -> LoadedModel:
    """Load a checkpoint directory or hub id.

    Args:
        path_or_id: local directory or ``Org/Name`` hub id.
        dtype: talker compute dtype (see :func:`resolve_dtype`); code2wav and the encoders stay fp32.
        load_encoders: ``"auto"`` loads the speaker encoder and the Mimi encoder for Base only; ``True``
            also loads the Mimi encoder for the other variants; ``False`` loads neither.
        load_talker, load_code2wav: False leaves that module ``None`` (a stage worker process loads it).
        configs: :func:`read_configs` of this directory when the caller has parsed them already.
        quantization: ``omnilab.kernels.quant.Quantization`` of the talker's decode matrices (None: as stored).
    """
    if load_encoders not in ("auto", True, False):
        raise ConfigError(f"load_encoders {load_encoders!r}; accepted: 'auto', True, False")
    compute, reason = resolve_dtype(dtype)
    path = validate_checkpoint_dir(resolve_checkpoint(path_or_id))
    config, speech = configs if configs is not None else read_configs(path)
    generation = GenerationDefaults.load(path / "generation_config.json")
    tokenizer = TextTokenizer.from_dir(path, config=config)
    _check_tokenizer(tokenizer, config)
    is_base = config.tts_model_type == "base"
    want_mimi = is_base if load_encoders == "auto" else bool(load_encoders)
    want_spk = is_base and load_encoders is not False

    main = TensorIndex(weight_files(path, "model"))
    _unclaimed(main, ("talker.", "speaker_encoder.") if is_base else ("talker.",), "model.safetensors")
    talker = load_talker_from(main, config, compute, quantization=quantization) if load_talker else None
    speaker_encoder = None
    if want_spk:
        speaker_encoder = load_strict(lambda: SpeakerEncoder(config.speaker_encoder), main, "speaker_encoder.",
                                      torch.float32, "model.safetensors (speaker_encoder)")
    del main

    codec = TensorIndex(weight_files(path / "speech_tokenizer", "model"))
    _unclaimed(codec, ("encoder.", "decoder."), "speech_tokenizer/model.safetensors")
    code2wav = load_code2wav_from(codec, speech) if load_code2wav else None
    mimi_encoder = None
    if want_mimi:
        mimi_encoder = load_strict(lambda: MimiEncoder(speech.encoder, speech.encoder_valid_num_quantizers), codec,
                                   "encoder.", torch.float32, "speech_tokenizer/model.safetensors (encoder)")
    return LoadedModel(path=path, config=config, speech_config=speech, generation=generation, talker=talker,
                       code2wav=code2wav, speaker_encoder=speaker_encoder, mimi_encoder=mimi_encoder, tokenizer=tokenizer,
                       dtype=compute, dtype_reason=reason, quantization=getattr(talker, "quantization", quantization))


def _check_tokenizer(tok: TextTokenizer, cfg: Qwen3TTSConfig) -> None:
    pairs: Mapping[str, tuple[int | None, int]] = {
        "<|im_start|>": (tok.im_start_id, cfg.im_start_token_id),
        "<|im_end|>": (tok.im_end_id, cfg.im_end_token_id),
    }
    got_assistant = tok.encode("assistant")
    for name, (got, want) in pairs.items():
        if got != want:
            raise ConfigError(f"tokenizer maps {name} to {got} but config.json says {want}")
    if got_assistant != [cfg.assistant_token_id]:
        raise ConfigError(f"tokenizer encodes 'assistant' as {got_assistant} but config.json assistant_token_id "
                          f"is {cfg.assistant_token_id}")
