"""The deploy profile's ``quantization`` field: whether and how the talker's decode matrices are quantized.

Plain Python (no torch). Spellings: ``none``, ``int8`` (per output channel), ``int4-g32`` / ``-g64`` / ``-g128`` (int4
talker, int8 code predictor), ``int4-all-g32`` / ... (int4 everywhere); a request without a group gets its group here; the shared names and sizes live in :mod:`omnilab.config`. The loader
(:func:`omnilab.kernels.quant.quantization_choice`) quantizes with exactly the field's method and group.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from omnilab.config import DEFAULT_INT4_GROUP_SIZE, int4_groups_fitting, parse_quantization, quantization_spelling
from omnilab.errors import ConfigError
from omnilab.profiles.cost import ModelGeometry
from omnilab.profiles.overrides import Overrides
from omnilab.profiles.resolved import Resolved


def _set(src: str, extra: str = "") -> str:
    return f"set by {src}" + (f"; {extra}" if extra else "")


def resolve_quantization(geo: ModelGeometry, value: Any, env: Mapping[str, str] | None = None) -> Resolved[str]:
    """The field for ``value`` (a spelling given as an argument; None = not given) on ``geo``, ``OMNILAB_QUANTIZATION``
    winning as in ``plan``: how an explicit ``quantization=`` re-resolves the field of a given ``DeployProfile``."""
    args = {"quantization": value} if value is not None else {}
    return quantization_field(geo, Overrides(os.environ if env is None else env, args))


def quantization_field(geo: ModelGeometry, ov: Overrides) -> Resolved[str]:
    """Weight-only quantization of the talker's decode matrices: opt-in (it changes the numerics), so auto is
    ``none``; a requested ``int4`` without a group gets the default group when it divides every decode matrix's
    K, else the largest accepted one that does (docs/kernels.md#quantized-decode-matrices-in-the-deploy-profile)."""
    o = ov.get("quantization")
    if not o and geo.stored_quantization != "none":  # a pack-quantized checkpoint loads as stored
        return Resolved(geo.stored_quantization, "the checkpoint stores its decode matrices quantized (config.json "
                        "quantization_config, compressed-tensors pack-quantized): loaded as stored", "checkpoint")
    if not o or o[0] == "none":
        why = _set(o[1]) if o else "auto"
        return Resolved("none", f"{why}: decode matrices as stored (int8 / int4 are opt-in: they change the "
                        "numerics; measure with omnilab.quality.compare)", o[1] if o else "auto")
    method, group = parse_quantization(o[0], o[1])
    if method == "int8":
        return Resolved("int8", _set(o[1], "int8 weights, one scale per output channel"), o[1])
    ks = geo.decode_input_widths()
    fits = int4_groups_fitting(ks)
    if group is not None and group not in fits:
        raise ConfigError(f"quantization={o[0]!r} ({o[1]}): group {group} does not divide the input width of every "
                          f"decode matrix (K = {sorted(set(ks))}); accepted here: "
                          f"{', '.join(f'{method}-g{g}' for g in fits) or 'none (use int8)'}")
    if not fits:
        raise ConfigError(f"quantization={o[0]!r} ({o[1]}): no int4 group size divides every decode matrix's K = "
                          f"{sorted(set(ks))}; use int8")
    g = group if group is not None else DEFAULT_INT4_GROUP_SIZE if DEFAULT_INT4_GROUP_SIZE in fits else max(fits)
    gwhy = ("group given" if group is not None else f"default group {g}: the fewest scale bytes per decode step "
            "(6 % of the bytes at 128, 20 % at 32)" if g == DEFAULT_INT4_GROUP_SIZE else
            f"group {g}: the largest accepted size dividing every K = {sorted(set(ks))}")
    what = ("int4 talker weights with an int8 code predictor (the vendor advises against quantizing the predictor; "
            "GGUF ports ship q5_k talker + q8_0 predictor; docs/quantization.md#recipes)" if method == "int4" else
            "int4 weights in every part, code predictor included")
    return Resolved(quantization_spelling(method, g), _set(o[1], f"{what}, {gwhy}"), o[1])
