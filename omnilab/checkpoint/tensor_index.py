"""``TensorIndex``: tensor name -> (file, dtype, shape, offsets) over safetensors files, one tensor at a time.

Used by :mod:`omnilab.checkpoint.load` (whose ``load_strict`` also serves the stage workers that load one part
of a checkpoint themselves). ``weight_files(dir, stem)`` lists a checkpoint's file or shards. Reads headers
only at construction, each checked against the file's size (a truncated file, offsets past the end, a huge header
length: ``CheckpointError`` naming the file); never unpickles.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from omnilab.errors import CheckpointError

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

ALIGN_BYTES = 64  # torch's CPU allocator alignment; mapped tensors off this boundary are copied


MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header


def _read_header(f: Path) -> tuple[dict[str, dict], int]:
    """``(tensor name -> info, header length)`` of ``f``, every entry checked against the file's size, so a
    truncated file, offsets past the end or a huge header length are a ``CheckpointError`` naming ``f`` here,
    before anything is mapped or allocated."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{f} is not a valid safetensors file: {why} (a truncated download? fetch it again)")

    try:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(fh.read(8), "little")
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise bad(f"header length {n} bytes exceeds the file ({size} bytes) or the format's "
                          f"{MAX_HEADER_BYTES}-byte limit")
            header = json.loads(fh.read(n))
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{f} cannot be read: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for k, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
            got = info.get("dtype") if isinstance(info, dict) else info
            raise CheckpointError(f"{f}: tensor {k} has unsupported dtype {got!r}; accepted: {', '.join(_ST_DTYPES)}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"tensor {k} has shape {shape!r}; expected a list of sizes >= 0")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise bad(f"tensor {k} has data_offsets {offs!r}; expected [start, end] with 0 <= start <= end")
        if offs[1] > data_bytes:
            raise bad(f"tensor {k} ends at byte {offs[1]} of the data but the file holds {data_bytes} data bytes")
        want = math.prod(shape) * _ST_DTYPES[info["dtype"]].itemsize
        if offs[1] - offs[0] != want:
            raise bad(f"tensor {k} spans {offs[1] - offs[0]} bytes; shape {shape} {info['dtype']} needs {want}")
    return header, n


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
            header, n = _read_header(Path(f))
            for k, info in header.items():
                self.where[k] = (f, info, 8 + n)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype in the file."""
        return _ST_DTYPES[self.where[name][1]["dtype"]]

    def get(self, name: str, dtype: torch.dtype | None = None, *, mmap: bool = True) -> torch.Tensor:
        """The tensor in ``dtype`` (floating tensors only; None = the file's), starting on a 64-byte boundary.
        ``mmap=False``: plain file reads even when no cast is needed (nothing of the file stays mapped)."""
        path, info, base = self.where[name]
        src = _ST_DTYPES[info["dtype"]]
        same = dtype is None or src == dtype or not src.is_floating_point
        if same and mmap:
            handle = self._mapped.get(path)
            if handle is None:
                from safetensors import safe_open
                handle = self._mapped[path] = safe_open(str(path), framework="pt", device="cpu")
            t = handle.get_tensor(name)
            return t if t.data_ptr() % ALIGN_BYTES == 0 else t.clone()
        t = self.read(name)  # fresh allocation (64-byte aligned); cast after reading
        return t if same else t.to(dtype)

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


def weight_files(path: Path, stem: str) -> list[Path] | None:
    """``stem.safetensors``, or the shards named by ``stem.safetensors.index.json``; None if neither."""
    single = path / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = path / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        return [path / n for n in names]
    return None
