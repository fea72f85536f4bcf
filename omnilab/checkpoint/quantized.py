"""Quantized checkpoints on disk: compressed-tensors' ``pack-quantized`` format (docs/quantization.md).

Contract:
- ``pack_int32(codes, bits)`` / ``unpack_int32(packed, bits, k)``: signed codes int8 [N, K] <-> int32
  [N, ceil(K / (32 / bits))], each code stored as ``code + 2^(bits-1)`` (int4 0..15, int8 0..255), element
  ``j`` of a word in bits ``[j * bits, (j + 1) * bits)`` (little end first), K padded with stored zeros
  (docs/quantization.md#packing).
- ``quantization_config(method, group_size, ignore)`` is the ``config.json`` entry :mod:`~omnilab.checkpoint.
  write_quantized` writes; ``parse_scheme(cfg)`` reads one back into a :class:`PackedScheme` or raises a
  ``ConfigError`` naming the value and the accepted ones (what omnilab's kernels take: W8A16 per channel, W4A16
  in groups of 32/64/128, symmetric, static, weights only).
- ``talker_view(index, quantization)``: what :func:`omnilab.checkpoint.load.load_talker_from` loads through the one
  strict loader: a plain checkpoint's index as is, with ``quantization.only(talker_streamed_name)``; a packed
  one's as a :class:`PackedIndex` (each module's ``weight_packed``/``weight_scale``/``weight_shape`` seen as one
  ``<module>.weight`` [N, K] whose ``read`` is the ``QuantizedWeight``: codes unpacked, then ``from_codes``), with
  the checkpoint's ``Quantization`` (source ``"checkpoint"``). A requested one that differs is a ``ConfigError``.
- ``quantization_for(checkpoint_dir, method, group_size)``: ``from_pretrained(quantization=, quant_group_size=)``
  resolved against the checkpoint (the row ``pipe.deployment`` shows), with the index it used.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from omnilab import settings
from omnilab.checkpoint.tensor_index import TensorIndex, weight_files
from omnilab.config import QUANT_PARTS, QUANT_RECIPES, quant_part
from omnilab.errors import CheckpointError, ConfigError
from omnilab.kernels.quant import INT4_GROUP_SIZES, QUANT_ENV, Quantization, from_codes, quantization_choice
from omnilab.tuning.storage import talker_streamed_name

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
BITS = {"int8": 8, "int4": 4}
PARTS = ("weight_packed", "weight_scale", "weight_shape")   # what replaces ``<module>.weight`` on disk
_OPTIONAL = ("weight_zero_point", "weight_g_idx")           # written by other schemes; refused unless harmless
PREFIX = "talker."
# the dtype a packed matrix is reported in before quantization (pipe.deployment's "before" bytes): the release's
LOGICAL_DTYPE = torch.bfloat16


# ---- packing (docs/quantization.md#packing) ---------------------------------------------------------
def _little_endian() -> None:
    if sys.byteorder != "little":  # safetensors is little-endian; the byte views below assume the host is too
        raise CheckpointError(f"packed int32 codes need a little-endian host, this one is {sys.byteorder}")


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes int8 [N, K] (int4: [-8, 7], int8: [-128, 127]) -> int32 [N, ceil(K * bits / 32)]."""
    _little_endian()
    n, k = codes.shape
    per = 32 // bits
    u = torch.zeros(n, -(-k // per) * per, dtype=torch.uint8)   # padding: stored 0
    u[:, :k] = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)   # byte j holds codes 2j (low nibble) and 2j+1 (high nibble)
    return u.contiguous().view(torch.int32)  # 4 bytes per word, first byte lowest: little end first


def unpack_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_int32`: int32 [N, W] -> signed codes int8 [N, k]."""
    _little_endian()
    b = packed.contiguous().view(torch.uint8)
    if bits == 8:
        return (b[:, :k] ^ 0x80).view(torch.int8)  # u - 128 in two's complement
    b = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(b.shape[0], -1)[:, :k]
    return b.view(torch.int8) - 8  # nibbles 0..15 -> codes -8..7


# ---- config.json quantization_config ------------------------------------------------------------------
@dataclass(frozen=True)
class PackedGroup:
    """One ``config_groups`` entry: a weights scheme and the modules it targets."""
    method: str                   # "int8" (W8A16, one scale per output channel) | "int4" (W4A16, groups along K)
    group_size: int | None        # int4: 32 | 64 | 128
    targets: tuple[str, ...] = ("Linear",)  # "Linear" (every Linear), checkpoint names, "re:" patterns

    @property
    def bits(self) -> int:
        return BITS[self.method]

    @property
    def label(self) -> str:
        g = f"group {self.group_size}" if self.method == "int4" else "per channel"
        return f"W{self.bits}A16 ({g}, symmetric)"


@dataclass(frozen=True)
class PackedScheme:
    """The weights schemes of a pack-quantized checkpoint, as omnilab's kernels take them: one per config group
    (a mixed recipe has two, with targets per part: docs/quantization.md#recipes)."""
    groups: tuple[PackedGroup, ...]
    ignore: tuple[str, ...] = ()  # Linear modules left unquantized (names or "re:" patterns, checkpoint names)

    @property
    def method(self) -> str:
        """The lowest format of any group (``int4`` if one is 4-bit)."""
        return "int4" if any(g.method == "int4" for g in self.groups) else "int8"

    @property
    def group_size(self) -> int | None:
        return next((g.group_size for g in self.groups if g.method == "int4"), None)

    @property
    def label(self) -> str:
        return f"compressed-tensors {FORMAT} " + " + ".join(g.label for g in self.groups)

    def group_for(self, module: str) -> PackedGroup | None:
        """The group quantizing the Linear ``module`` (checkpoint name, e.g. ``talker.codec_head``): a group naming
        it (by name or "re:") wins over one targeting the class "Linear"; None when none does or it is ignored."""
        if _matches(self.ignore, module):
            return None
        named = [g for g in self.groups if _matches(g.targets, module)]
        return named[0] if named else next((g for g in self.groups if "Linear" in g.targets), None)

    def targets_module(self, module: str) -> bool:
        """Whether the Linear ``module`` is quantized by some group (and not ignored)."""
        return self.group_for(module) is not None


def _matches(patterns: tuple[str, ...], module: str, cls: str | None = None) -> bool:
    return any(p == cls or p == module or (p.startswith("re:") and re.match(p[3:], module) is not None)
               for p in patterns)


# checkpoint module names of each recipe part (config.QUANT_PARTS), as compressed-tensors targets
PART_TARGETS = {"talker_layers": "re:^talker\\.model\\.layers\\.", "codec_head": "talker.codec_head",
                "predictor_layers": "re:^talker\\.code_predictor\\.model\\.layers\\.",
                "predictor_heads": "re:^talker\\.code_predictor\\.(lm_head|small_to_mtp_projection)"}


def _weights(method: str, group_size: int | None) -> dict:
    return {"num_bits": BITS[method], "type": "int", "symmetric": True, "strategy":
            "group" if method == "int4" else "channel", "group_size": group_size if method == "int4" else None,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def quantization_config(method: str, group_size: int | None, ignore: list[str] | tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for the recipe ``method`` (and its int4 parts'
    ``group_size``): one group targeting every ``Linear`` when all parts share a format, else one group per
    format whose targets name its parts (:data:`PART_TARGETS`)."""
    formats = QUANT_RECIPES.get(method, (method,) * 4)
    if len(set(formats)) == 1:
        groups = {"group_0": (["Linear"], formats[0])}
    else:
        groups = {f"group_{i}": ([PART_TARGETS[p] for p, f in zip(QUANT_PARTS, formats) if f == fmt], fmt)
                  for i, fmt in enumerate(sorted(set(formats)))}  # int4 first: "int4" < "int8"
    return {"quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {name: {"targets": targets, "weights": _weights(fmt, group_size),
                                     "input_activations": None, "output_activations": None}
                              for name, (targets, fmt) in groups.items()},
            "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None}


def _accept(value: Any, accepted: tuple, what: str) -> None:
    if not any(value == a and type(value) is type(a) for a in accepted):  # 1 is not True, 8.0 is not 8
        raise ConfigError(f"config.json quantization_config: {what}={value!r} is not supported; accepted: "
                          f"{', '.join(map(repr, accepted))}")


def parse_scheme(cfg: Mapping[str, Any]) -> PackedScheme:
    """``config.json``'s ``quantization_config`` -> :class:`PackedScheme` (see the module docstring)."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config.json quantization_config must be an object, got {type(cfg).__name__}")
    _accept(cfg.get("quant_method"), (QUANT_METHOD,), "quant_method")
    _accept(cfg.get("format"), (FORMAT,), "format")
    _accept(cfg.get("kv_cache_scheme"), (None,), "kv_cache_scheme")
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ConfigError("config.json quantization_config: config_groups must name at least one scheme, got "
                          f"{groups!r}")
    schemes, out = set(), []
    for name, g in groups.items():
        if not isinstance(g, Mapping) or not isinstance(g.get("weights"), Mapping):
            raise ConfigError(f"config.json quantization_config: config_groups.{name} needs a 'weights' object "
                              f"(presets by name are not read), got {g!r}")
        where = f"config_groups.{name}"
        _accept(g.get("input_activations"), (None,), f"{where}.input_activations (activation quantization)")
        _accept(g.get("output_activations"), (None,), f"{where}.output_activations")
        targets = g.get("targets")
        if not targets or not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"config.json quantization_config: config_groups need targets (e.g. ['Linear']), got "
                              f"{targets!r}")
        w = g["weights"]
        _accept(w.get("type", "int"), ("int",), f"{where}.weights.type")
        _accept(w.get("num_bits"), (4, 8), f"{where}.weights.num_bits")
        _accept(w.get("symmetric", True), (True,), f"{where}.weights.symmetric")
        _accept(w.get("dynamic", False), (False,), f"{where}.weights.dynamic")
        _accept(w.get("actorder"), (None, False, "weight", "static"), f"{where}.weights.actorder")
        if w["num_bits"] == 8:
            _accept(w.get("strategy"), ("channel",), f"{where}.weights.strategy (8 bits)")
            scheme = ("int8", None)
        else:
            _accept(w.get("strategy"), ("group",), f"{where}.weights.strategy (4 bits)")
            _accept(w.get("group_size"), INT4_GROUP_SIZES, f"{where}.weights.group_size")
            scheme = ("int4", w["group_size"])
        schemes.add(scheme)
        out.append(PackedGroup(*scheme, tuple(targets)))
    if len({g for m, g in schemes if m == "int4"}) > 1:
        raise ConfigError(f"config.json quantization_config: config_groups mix int4 group sizes "
                          f"{sorted(schemes, key=str)}; accepted: one group size for every int4 matrix")
    if sum("Linear" in g.targets for g in out) > 1 or len(schemes) < len(out):
        raise ConfigError("config.json quantization_config: several config_groups target every Linear or repeat "
                          "a scheme; accepted: one group per scheme, at most one targeting 'Linear'")
    ignore = cfg.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ConfigError(f"config.json quantization_config: ignore must be a list of names, got {ignore!r}")
    return PackedScheme(tuple(out), tuple(ignore))


def read_scheme(checkpoint_dir: str | Path, config: Any = None) -> PackedScheme | None:
    """The :class:`PackedScheme` of ``checkpoint_dir/config.json``, None when it has no quantization_config;
    ``config``: that file already parsed (a ``Qwen3TTSConfig``: its ``quantization_config``, no second read)."""
    if config is not None:
        return None if config.quantization_config is None else parse_scheme(config.quantization_config)
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text()).get("quantization_config")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{path} is not a JSON object: {e}") from None
    return None if cfg is None else parse_scheme(cfg)


# ---- reading: the packed tensors seen as the matrices they replace ---------------------------------------
class PackedIndex:
    """A :class:`~omnilab.checkpoint.tensor_index.TensorIndex` of a pack-quantized file in which each quantized
    module's ``weight_packed`` / ``weight_scale`` / ``weight_shape`` appear as one ``<module>.weight`` of shape
    ``weight_shape``; :meth:`read` of it is the ``QuantizedWeight`` (codes unpacked, ``from_codes`` into the
    kernel layout, its scales). Every other tensor is the file's. ``packed``: those names without ``talker.``.
    Checks at construction: every packed module has all of :data:`PARTS`, is a decode matrix
    (:func:`~omnilab.tuning.storage.talker_streamed_name`), and its shapes agree with ``weight_shape`` and the
    scheme; every decode matrix not in ``ignore`` is packed; no zero points (symmetric) or ``g_idx``."""

    def __init__(self, index: TensorIndex, scheme: PackedScheme, where: str = "model.safetensors"):
        self.base, self.scheme, self.file = index, scheme, where
        self.where: dict[str, Any] = {}
        self._shape: dict[str, tuple[int, int]] = {}
        self._parts: dict[str, dict[str, str]] = {}
        self._group: dict[str, PackedGroup] = {}
        for k, info in index.where.items():
            mod, _, leaf = k.rpartition(".")
            if leaf in PARTS + _OPTIONAL:
                self._parts.setdefault(mod, {})[leaf] = k
            else:
                self.where[k] = info
        for mod, parts in sorted(self._parts.items()):
            self._check(mod, parts)
        self.packed = frozenset(k[len(PREFIX):] for k in self._shape)
        dense = [k[:-len(".weight")] for k in self.where if k.startswith(PREFIX) and k not in self._shape
                 and talker_streamed_name(k[len(PREFIX):]) and scheme.targets_module(k[:-len(".weight")])]
        if dense:
            raise CheckpointError(f"{where}: {len(dense)} decode matri{'x' if len(dense) == 1 else 'ces'} targeted by "
                                  f"quantization_config (not in its ignore list) without {'/'.join(PARTS)}: "
                                  f"{', '.join(dense[:5])}{' ...' if len(dense) > 5 else ''}")

    def _check(self, mod: str, parts: dict[str, str]) -> None:
        name, s = f"{mod}.weight", self.scheme.group_for(mod)
        missing = [p for p in PARTS if p not in parts]
        if missing:
            raise CheckpointError(f"{self.file}: quantized module {mod} has {', '.join(sorted(parts))} but no "
                                  f"{', '.join(missing)}; a packed module needs all of {', '.join(PARTS)}")
        if name in self.where:
            raise CheckpointError(f"{self.file}: {mod} is stored both dense ({name}) and packed")
        if not (mod.startswith(PREFIX) and talker_streamed_name(name[len(PREFIX):])):
            raise CheckpointError(f"{self.file}: quantized tensor {parts['weight_packed']} is not a talker decode "
                                  f"matrix; accepted: the matrices a decode step streams (docs/quantization.md#what-is-"
                                  f"quantized)")
        if "weight_g_idx" in parts:
            raise ConfigError(f"{self.file}: {parts['weight_g_idx']}: activation-order group indices (g_idx) are not "
                              f"supported; accepted: groups in K order (actorder null, 'weight' or 'static')")
        if "weight_zero_point" in parts and bool(self.base.read(parts["weight_zero_point"]).ne(0).any()):
            raise ConfigError(f"{self.file}: {parts['weight_zero_point']} is not all zero (asymmetric); accepted: "
                              f"symmetric codes (no zero point)")
        if s is None:
            raise CheckpointError(f"{self.file}: {mod} is packed but no config group targets it (or it is ignored); "
                                  f"accepted: packed modules that quantization_config's config_groups target")
        self._group[name] = s
        shape = self.base.read(parts["weight_shape"])
        if shape.dtype not in (torch.int64, torch.int32) or tuple(shape.shape) != (2,):
            raise CheckpointError(f"{self.file}: {parts['weight_shape']} must be int64 or int32 [2] (N, K), got "
                                  f"{shape.dtype} {tuple(shape.shape)}")
        n, k = (int(v) for v in shape)
        per, groups = 32 // s.bits, (1 if s.method == "int8" else k // s.group_size)
        if s.method == "int4" and k % s.group_size:
            raise ConfigError(f"{self.file}: {mod}: group_size {s.group_size} does not divide K={k} "
                              f"(weight_shape {[n, k]}); accepted group sizes: those of {INT4_GROUP_SIZES} dividing K")
        want = {"weight_packed": ((n, -(-k // per)), (torch.int32,)),
                "weight_scale": ((n, groups), (torch.float32, torch.bfloat16, torch.float16))}
        for part, (dims, dtypes) in want.items():
            got_dims, got_dtype = self.base.shape(parts[part]), self.base.dtype(parts[part])
            if got_dims != dims or got_dtype not in dtypes:
                raise CheckpointError(f"{self.file}: {parts[part]} is {str(got_dtype)[6:]} {list(got_dims)}; "
                                      f"weight_shape {[n, k]} with {s.label} needs "
                                      f"{' or '.join(str(d)[6:] for d in dtypes)} {list(dims)}")
        self._shape[name], self.where[name] = (n, k), self.base.where[parts["weight_packed"]]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape.get(name) or self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return LOGICAL_DTYPE if name in self._shape else self.base.dtype(name)

    def get(self, name: str, dtype: torch.dtype | None = None, *, mmap: bool = True) -> torch.Tensor:
        if name in self._shape:
            raise CheckpointError(f"{self.file}: {name} is packed; it loads as a QuantizedWeight (read), not a tensor")
        return self.base.get(name, dtype, mmap=mmap)

    def read(self, name: str):
        """The file's tensor; for a packed ``<module>.weight`` the ``QuantizedWeight`` (its ``activations`` unset)."""
        if name not in self._shape:
            return self.base.read(name)
        parts, (n, k), s = self._parts[name[:-len(".weight")]], self._shape[name], self._group[name]
        codes = unpack_int32(self.base.read(parts["weight_packed"]), s.bits, k)
        scales = self.base.read(parts["weight_scale"]).to(torch.float32)  # bf16/fp16 -> fp32 is exact
        return from_codes(s.method, codes, scales, s.group_size)

    def recipe(self) -> tuple[str, int | None]:
        """``(recipe, int4 group)`` the packed matrices follow (config.QUANT_RECIPES), parts left dense matching any
        format; a ``ConfigError`` when no recipe fits (e.g. an int4 predictor under an int8 talker)."""
        seen: dict[str, set[str]] = {}
        for n in self.packed:
            seen.setdefault(quant_part(n), set()).add(self._group[PREFIX + n].method)
        for recipe, formats in QUANT_RECIPES.items():
            if all(seen.get(p, {f}) == {f} for p, f in zip(QUANT_PARTS, formats)):
                return recipe, self.scheme.group_size
        raise ConfigError(f"{self.file}: the packed parts {dict(sorted((p, sorted(v)) for p, v in seen.items()))} "
                          f"follow no recipe; accepted: {', '.join(f'{r} {v}' for r, v in QUANT_RECIPES.items())}")


# ---- which Quantization -------------------------------------------------------------------------------
def _ks(index: Any) -> list[int]:
    return [index.shape(k)[1] for k in index.where if k.startswith(PREFIX) and talker_streamed_name(k[len(PREFIX):])]


def checkpoint_quantization(view: PackedIndex) -> Quantization:
    """The ``Quantization`` of a packed checkpoint (source ``"checkpoint"``), its activations as for quantizing at
    load (``OMNILAB_QUANT_ACTIVATIONS`` or the method's default), restricted to the packed matrices."""
    s = view.scheme
    recipe, group = view.recipe()
    ks = [view.shape(PREFIX + n)[1] for n in view.packed]
    base = quantization_choice(recipe, group, env="", ks=ks)
    why = base.reason.rpartition("; ")[2]
    reason = (f"checkpoint: {s.label} (config.json quantization_config), codes as stored, repacked into the kernel "
              f"layout at load; {why}")
    return dataclasses.replace(base, reason=reason, source="checkpoint").only(view.packed.__contains__)


def _check_request(ckpt: Quantization, method: str, group: int | None, source: str, asked: str) -> None:
    """A request on a packed checkpoint: nothing, ``"none"`` as an argument (what a deploy profile resolves when
    nothing is asked: the codes load as stored) or the checkpoint's own method (and group, when one is named)."""
    have = f"{ckpt.method}" + (f" group {ckpt.group_size}" if ckpt.group_size else " per channel")
    if method == "none" and source != "env":
        return
    if method != ckpt.method or (group is not None and ckpt.group_size and group != ckpt.group_size):
        asks = "unquantized matrices" if method == "none" else f"{method}{f' group {group}' if group else ''}"
        raise ConfigError(f"{asked} asks for {asks} but the checkpoint is already quantized ({have}, {FORMAT}); "
                          f"accepted: None or the checkpoint's own quantization="
                          f"{ckpt.method if not ckpt.group_size else f'{ckpt.method}-g{ckpt.group_size}'!r} (quantized codes "
                          f"are never re-quantized or expanded)")


def talker_view(index: TensorIndex, quantization: Quantization | None = None,
                config: Any = None) -> tuple[Any, Quantization | None]:
    """``(index, quantization)`` for :func:`~omnilab.checkpoint.load.load_talker_from` (see the module docstring);
    ``index``'s ``config.json`` (next to its files; ``config``: it parsed) says whether the checkpoint is packed."""
    files = sorted({v[0] for v in index.where.values()})
    scheme = read_scheme(Path(files[0]).parent, config) if files else None
    if scheme is None:
        if any(k.endswith(".weight_packed") for k in index.where):
            raise CheckpointError(f"{files[0]} holds packed tensors (*.weight_packed) but config.json has no "
                                  f"quantization_config; accepted: a {QUANT_METHOD} {FORMAT} config")
        return index, quantization and quantization.only(talker_streamed_name)
    view = PackedIndex(index, scheme, Path(files[0]).name)
    ckpt = checkpoint_quantization(view)
    if quantization is None or not quantization.enabled and quantization.source == "default":
        return view, ckpt
    _check_request(ckpt, quantization.method, quantization.group_size, quantization.source,
                   f"quantization ({quantization.source})")
    return view, (quantization.only(view.packed.__contains__) if quantization.enabled else ckpt)


def quantization_for(checkpoint_dir: str | Path, method: Any = None, group_size: Any = None,
                     config: Any = None) -> tuple[Quantization, Any]:
    """``(Quantization, index)`` for ``from_pretrained(quantization=method, quant_group_size=group_size)``:
    :func:`~omnilab.kernels.quant.quantization_choice` on a plain checkpoint; a packed one's own quantization,
    after checking that what was asked (``OMNILAB_QUANTIZATION`` included) is nothing or the same."""
    index = TensorIndex(weight_files(Path(checkpoint_dir), "model"))
    requested = quantization_choice(method, group_size, ks=_ks(index))  # bad values fail first, either way
    view, choice = talker_view(index, config=config)
    if view is index:
        return requested, index
    if requested.source != "default":
        spelling = (settings.raw(QUANT_ENV) or "").strip() if requested.source == "env" else str(method)
        explicit = group_size is not None or re.search(r"(-g|/)\d+$", spelling) is not None  # "int4-g64"
        asked = f"{QUANT_ENV}={spelling}" if requested.source == "env" else f"quantization={method!r}"
        _check_request(choice, requested.method, requested.group_size if explicit else None, requested.source, asked)
    return choice, view
