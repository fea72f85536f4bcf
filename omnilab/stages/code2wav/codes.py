"""Validation of the codes a caller hands to code2wav (``decode``, ``push``), shared by the in-process stage and the
worker's client side, so both answer a bad argument with the same ``InputError`` before any decode starts.

``codes_array(codes, name, codebook_size)``: an integer array-like ``[frames, 16]`` (numpy, a CPU torch tensor,
nested lists) -> ``int64`` numpy array. Refused, naming the value and what is accepted: None, strings, objects,
floating or bool arrays, other shapes, codes ``>= codebook_size``. Negative codes are padding and are decoded as 0,
as the reference tokenizer does (``omnilab.models.code2wav``). Plain numpy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from omnilab.config import CODEBOOK_SIZE, NUM_CODE_GROUPS
from omnilab.errors import InputError

_WANT = f"an integer array [frames, {NUM_CODE_GROUPS}] (numpy, torch or nested lists)"


def codes_array(codes: Any, name: str = "codes", codebook_size: int = CODEBOOK_SIZE) -> np.ndarray:
    """``codes`` as ``int64 [frames, 16]``, or ``InputError`` naming ``name``, the value and the accepted form."""
    if codes is None or isinstance(codes, (str, bytes)):
        raise InputError(f"{name} must be {_WANT}; got {codes!r}")
    try:
        a = np.asarray(codes)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"{name} must be {_WANT}; got {type(codes).__name__} ({e})") from None
    if a.dtype.kind not in "iu" or a.ndim != 2 or a.shape[1] != NUM_CODE_GROUPS:
        raise InputError(f"{name} must be {_WANT}; got shape {tuple(a.shape)} dtype {a.dtype}")
    if a.size and int(a.max()) >= codebook_size:
        raise InputError(f"{name} must be < codebook_size {codebook_size} (negative codes are padding, decoded as "
                         f"0); got max {int(a.max())}")
    return a.astype(np.int64, copy=False)
