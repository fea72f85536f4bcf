"""Write a quantized copy of a checkpoint: ``omnilab quantize SRC DST --method int8|int4|int4-all [--group-size N]``.

Contract: ``quantize_checkpoint(src, dst, method, group_size=None, overwrite=False, progress=None) -> Path`` writes
a complete checkpoint directory at ``dst``: every file of ``src`` copied (``speech_tokenizer/`` unchanged), except
that ``model.safetensors`` (one file, also for a sharded source) stores each talker decode matrix
(:func:`omnilab.tuning.storage.talker_streamed_name`) in its recipe part's format (``int4``: int4 talker, int8
predictor; docs/quantization.md#recipes) in compressed-tensors' ``pack-quantized`` format and
``config.json`` gains its ``quantization_config`` (docs/quantization.md). The codes and scales are those of
:func:`omnilab.kernels.quant.quantize` on the file's values, so loading ``dst`` gives exactly the
``QuantizedWeight`` of ``from_pretrained(src, quantization=method, quant_group_size=group_size)``; scales are
stored in the dtype they have in memory for that reason (docs/quantization.md#scales). ``group_size``: int4 only,
None = the at-load default (128, or the largest of 64/32 dividing every K). Refuses an existing non-empty ``dst`` unless
``overwrite``, a source that is already quantized, and ``dst`` inside ``src`` or the reverse. ``dst`` appears
complete or not at all (written next to it, then renamed). ``progress``: a bar per tensor (None: the rule of
:func:`omnilab.instrument.progress.progress_enabled`, ``OMNILAB_PROGRESS``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from omnilab.checkpoint.load import meta_init, read_configs, resolve_checkpoint, validate_checkpoint_dir
from omnilab.checkpoint.quantized import BITS, pack_int32, quantization_config, read_scheme
from omnilab.checkpoint.random import _publish, write_safetensors
from omnilab.checkpoint.tensor_index import TensorIndex, weight_files
from omnilab.config import QUANT_RECIPES, parse_quantization
from omnilab.errors import CheckpointError, ConfigError, InputError
from omnilab.instrument.progress import bar
from omnilab.kernels.quant import quantization_choice
from omnilab.models.talker import Talker
from omnilab.tuning.storage import talker_streamed_name


def _unquantized_linears(config) -> list[str]:
    """Checkpoint names of the talker's Linear modules that stay dense (compressed-tensors' ``ignore``): the
    prompt-only text projection; every other talker Linear is a decode matrix."""
    with meta_init():
        talker = Talker(config)
    return [f"talker.{n}" for n, m in talker.named_modules()
            if isinstance(m, nn.Linear) and not talker_streamed_name(f"{n}.weight")]


def _disk_scales(qw) -> torch.Tensor:
    """A matrix's scales as stored: in the dtype it holds them in memory (fp16 for int4, chosen fp16-exact; fp32 for
    int8), so the file loads into the same weights (docs/quantization.md#scales)."""
    s = qw.row_scales().contiguous()  # fp32 [N, groups], exact widening of fp16
    return s.to(qw.scales.dtype)


def _copy_files(src: Path, dst: Path, skip: set[Path]) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file() and p not in skip:
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, q)  # follows links (a hub snapshot's files are links into its blob store)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, method: str, group_size: int | None = None,
                        *, overwrite: bool = False, progress: bool | None = None) -> Path:
    """Write the quantized copy of ``src`` at ``dst`` and return ``dst`` (see the module docstring)."""
    try:
        recipe, spelled = parse_quantization(method, "method")  # "int4-all-g32" names its group
    except ConfigError:
        recipe = spelled = None
    if recipe not in QUANT_RECIPES:
        raise ConfigError(f"method {method!r} is not a checkpoint quantization; accepted: {', '.join(QUANT_RECIPES)} "
                          f"(int4 ones also with a group suffix, e.g. int4-g32, int4-all-g64)")
    method = recipe
    if spelled is not None:
        if group_size is not None and group_size != spelled:
            raise ConfigError(f"method {method}-g{spelled} and group_size={group_size} disagree; give one")
        group_size = spelled
    src = validate_checkpoint_dir(resolve_checkpoint(src))
    dst = Path(dst).expanduser().resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise InputError(f"destination {dst} and source {src} overlap; write the quantized copy elsewhere")
    if read_scheme(src) is not None:
        raise ConfigError(f"{src} is already quantized (config.json has a quantization_config); accepted: an "
                          f"unquantized checkpoint (quantized codes are never re-quantized)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise CheckpointError(f"{dst} already exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    config, _ = read_configs(src)
    files = weight_files(src, "model")
    index = TensorIndex(files)
    names = [k for k in index.where if k.startswith("talker.") and talker_streamed_name(k[len("talker."):])]
    choice = quantization_choice(method, group_size, env="", act_env="", ks=[index.shape(k)[1] for k in names])
    group = choice.group_size
    skip = set(files) | {src / "model.safetensors.index.json", src / "config.json"}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        _copy_files(src, tmp, skip)
        tensors, quantized = [], set(names)
        for k in bar(sorted(index.where), desc=f"quantize {method}", unit="tensor", progress=progress):
            if k not in quantized:
                tensors.append((k, index.get(k)))  # as stored (mapped)
                continue
            qw = choice.apply(index.read(k), k[len("talker."):])  # what quantizing at load installs (load_strict)
            bits, module = BITS[qw.method], k[:-len(".weight")]
            tensors += [(f"{module}.weight_packed", pack_int32(qw.codes(), bits)),    # int32 [N, K*bits/32]
                        (f"{module}.weight_scale", _disk_scales(qw)),         # [N, groups]
                        (f"{module}.weight_shape", torch.tensor(qw.shape, dtype=torch.int64))]  # [2]: N, K
        write_safetensors(tmp / "model.safetensors", tensors)
        del tensors
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = quantization_config(method, group, _unquantized_linears(config))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
