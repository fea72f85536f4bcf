"""A damaged safetensors file is a ``CheckpointError`` naming the file (omnilab/checkpoint/tensor_index.py), on the
path a user takes (``Pipeline.from_pretrained``), not a ``SafetensorError``, ``MemoryError`` or ``OverflowError``."""
from __future__ import annotations

import json
import shutil

import pytest

from omnilab.checkpoint.tensor_index import TensorIndex
from omnilab.errors import CheckpointError
from omnilab.pipeline import Pipeline


def _header(raw: bytes) -> tuple[dict, int]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), n


def _with_header(raw: bytes, header: dict) -> bytes:
    n = _header(raw)[1]
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def _offsets_past_end(raw: bytes) -> bytes:
    header, _ = _header(raw)
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + 10**9, end + 10**9]
    return _with_header(raw, header)


def _wrong_span(raw: bytes) -> bytes:
    header, _ = _header(raw)
    name = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > 8)
    header[name]["data_offsets"][1] -= 4
    return _with_header(raw, header)


DAMAGE = {
    "truncated": (lambda raw: raw[: len(raw) // 2],
                  r"tensor .* ends at byte \d+ of the data but the file holds \d+ data bytes"),
    "offsets past the end": (_offsets_past_end, r"tensor .* ends at byte \d+ of the data"),
    "huge header length": (lambda raw: (1 << 62).to_bytes(8, "little") + raw[8:],
                           r"header length 4611686018427387904 bytes exceeds the file"),
    "header cut": (lambda raw: raw[:20], r"header length \d+ bytes exceeds the file \(20 bytes\)"),
    "empty": (lambda raw: b"", r"0 bytes, shorter than the 8-byte header length"),
    "not json": (lambda raw: (4).to_bytes(8, "little") + b"{{{{" + raw[12:], r"its header is not JSON"),
    "span disagrees with shape": (_wrong_span, r"tensor .* spans \d+ bytes; shape .* needs \d+"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_speech_tokenizer_names_the_file(tiny_ckpt, tmp_path, kind):
    damage, match = DAMAGE[kind]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("custom_voice"), ckpt)
    f = ckpt / "speech_tokenizer" / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"{f} is not a valid safetensors file: {match}"):
        Pipeline.from_pretrained(ckpt, backend="eager", dtype="float32")


def test_intact_file_still_indexes(tiny_ckpt):
    f = tiny_ckpt("custom_voice") / "speech_tokenizer" / "model.safetensors"
    index = TensorIndex([f])
    name = next(iter(index.where))
    assert tuple(index.get(name).shape) == index.shape(name)
