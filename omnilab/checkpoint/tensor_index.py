"""``TensorIndex``: tensor name -> (file, dtype, shape, offsets) over safetensors files, one tensor at a time.

Used by :mod:`omnilab.checkpoint.load` and by stage workers that load one part of a checkpoint themselves.
Reads headers only at construction; never unpickles.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omnilab.errors import CheckpointError

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

ALIGN_BYTES = 64  # torch's CPU allocator alignment; mapped tensors off this boundary are copied


class TensorIndex:
    """Tensor name -> (file, dtype, shape, offsets) over safetensors files, read one tensor at a time.

    A tensor already in the wanted dtype is returned memory-mapped (zero copy, shared page cache) when
    its data starts on a 64-byte boundary, and copied into a fresh (aligned) allocation otherwise: MKL and
    oneDNN choose other kernels, hence other summation orders, for unaligned operands, so a result would
    depend on where the tensor sits in the file and differ between loaders (measured: code2wav audio
    differed by up to 2e-6 between an mmap-loaded and a copied decoder on one CPU and thread count). One
    that needs a cast is read with plain file reads and cast, so no mapping of the whole file stays
    resident next to the converted copy.
    """

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, dict, int]] = {}
        self._mapped: dict[Path, Any] = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
            header.pop("__metadata__", None)
            for k, info in header.items():
                if info.get("dtype") not in _ST_DTYPES:
                    raise CheckpointError(f"{f}: tensor {k} has unsupported dtype {info.get('dtype')!r}")
                self.where[k] = (f, info, 8 + n)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype in the file."""
        return _ST_DTYPES[self.where[name][1]["dtype"]]

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        path, info, base = self.where[name]
        src = _ST_DTYPES[info["dtype"]]
        if dtype is None or src == dtype or not src.is_floating_point:
            handle = self._mapped.get(path)
            if handle is None:
                from safetensors import safe_open
                handle = self._mapped[path] = safe_open(str(path), framework="pt", device="cpu")
            t = handle.get_tensor(name)
            return t if t.data_ptr() % ALIGN_BYTES == 0 else t.clone()
        return self.read(name).to(dtype)

    def read(self, name: str) -> torch.Tensor:
        """The tensor in its file dtype, read with plain file reads into a fresh tensor (no mapping)."""
        path, info, base = self.where[name]
        start, end = info["data_offsets"]
        raw = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
        if end > start:
            with open(path, "rb") as fh:
                fh.seek(base + start)
                if fh.readinto(raw.reshape(-1).view(torch.uint8).numpy()) != end - start:
                    raise CheckpointError(f"{path}: truncated data for tensor {name}")
        return raw
