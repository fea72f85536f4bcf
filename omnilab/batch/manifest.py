"""Read and check a batch manifest: one utterance per row, in CSV, JSONL or Parquet.

Columns: ``id`` and ``text`` (required); the request fields ``speaker``, ``language``, ``instruct``,
``ref_audio`` (a path, relative to the manifest's folder), ``ref_text``, ``x_vector_only_mode``,
``non_streaming_mode``; and the generation settings of ``Pipeline.generate`` (``seed``, ``temperature``,
``top_k``, ``top_p``, ``do_sample``, ``max_new_tokens``, ``repetition_penalty``, ``subtalker_*``). An empty
cell means "the model's default". An unknown column refuses the manifest (a typo would otherwise be ignored).

A bad row does not stop the others: it becomes a ``RowError`` naming its line (CSV, JSONL: the line in the
file, the header being line 1 of a CSV; Parquet: the 1-based row), its id and what is wrong, and
``synthesize`` reports it and runs the rest (``strict=True`` refuses the whole manifest instead).
Plain Python (pandas only for Parquet): no torch.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from omnilab.config import Qwen3TTSConfig
from omnilab.errors import InputError

REQUEST_FIELDS = ("speaker", "language", "instruct", "ref_audio", "ref_text", "x_vector_only_mode",
                  "non_streaming_mode")
# the sampling keywords of Pipeline.generate (omnilab.pipeline._SAMPLING_KEYS; a test keeps the two equal)
SAMPLING_TYPES: dict[str, type] = {
    "max_new_tokens": int, "do_sample": bool, "temperature": float, "top_k": int, "top_p": float,
    "repetition_penalty": float, "subtalker_do_sample": bool, "subtalker_temperature": float,
    "subtalker_top_k": int, "subtalker_top_p": float, "seed": int}
FIELD_TYPES: dict[str, type] = {"speaker": str, "language": str, "instruct": str, "ref_audio": Path,
                                "ref_text": str, "x_vector_only_mode": bool, "non_streaming_mode": bool,
                                **SAMPLING_TYPES}
COLUMNS = ("id", "text") + tuple(FIELD_TYPES)
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_TRUE, _FALSE = ("true", "yes", "1", "y", "t"), ("false", "no", "0", "n", "f")


@dataclass(frozen=True)
class Utterance:
    """One row that passed the checks: ``settings`` holds only the fields the row sets (keywords of ``generate``)."""
    id: str
    text: str
    line: int
    settings: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "line": self.line, "settings": dict(self.settings)}


@dataclass(frozen=True)
class RowError:
    """A row that cannot run: where it is (``line`` in the file, or Parquet ``row``), its id if any, and why."""
    line: int
    id: str | None
    message: str
    where: str = "line"

    def __str__(self) -> str:
        who = f" (id {self.id!r})" if self.id else ""
        return f"{self.where} {self.line}{who}: {self.message}"


@dataclass(frozen=True)
class Manifest:
    path: Path | None
    format: str
    utterances: tuple[Utterance, ...]
    errors: tuple[RowError, ...] = ()

    def __len__(self) -> int:
        return len(self.utterances)

    def with_errors(self, more: list[RowError]) -> "Manifest":
        """This manifest without the rows ``more`` names (by line), their errors added."""
        bad = {e.line for e in more}
        keep = tuple(u for u in self.utterances if u.line not in bad)
        errs = tuple(sorted(self.errors + tuple(more), key=lambda e: e.line))
        return Manifest(self.path, self.format, keep, errs)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v))


def _as(kind: type, name: str, v: Any, base: Path | None) -> Any:
    """``v`` as ``kind`` (a CSV cell is a string, JSONL/Parquet values are typed); InputError names the field."""
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()  # numpy scalars from Parquet
    if kind is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float)) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
            return v.strip().lower() in _TRUE
        raise InputError(f"{name} {v!r} is not a boolean; accepted: true/false, yes/no, 1/0")
    if kind is int:
        if isinstance(v, bool):
            raise InputError(f"{name} {v!r} is not an integer")
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, int):
            return v
        if isinstance(v, str) and re.fullmatch(r"\s*[-+]?\d+(\.0*)?\s*", v):
            return int(v.strip().split(".")[0])  # "8.0": how pandas writes an int column with gaps
        raise InputError(f"{name} {v!r} is not an integer")
    if kind is float:
        try:
            f = float(v) if not isinstance(v, bool) else None
        except (TypeError, ValueError):
            f = None
        if f is None or not math.isfinite(f):
            raise InputError(f"{name} {v!r} is not a finite number")
        return f
    if not isinstance(v, str):
        raise InputError(f"{name} must be a string; got {type(v).__name__} {v!r}")
    if kind is Path:
        p = Path(v.strip()).expanduser()
        p = p if p.is_absolute() or base is None else base / p
        if not p.is_file():
            raise InputError(f"ref_audio {v!r}: no such file ({p})")
        return str(p)
    return v


def check_row(raw: Mapping[str, Any], line: int, base: Path | None, seen: dict[str, int],
              where: str = "line") -> Utterance | RowError:
    """One raw row (column -> value) -> an ``Utterance``, or the ``RowError`` that stops it."""
    rid = raw.get("id")
    rid = None if _missing(rid) else str(rid.item() if hasattr(rid, "item") else rid).strip()
    try:
        unknown = sorted(str(k) for k in raw if k not in COLUMNS)
        if unknown:
            raise InputError(f"unknown field(s) {unknown}; accepted: {', '.join(COLUMNS)}")
        if rid is None:
            raise InputError("id is empty; every row needs a unique id (it names the wav file)")
        if not ID_RE.match(rid):
            raise InputError(f"id {rid!r} cannot name a file; accepted: letters, digits, '.', '_', '-' "
                             "(starting with a letter or digit, at most 200)")
        if rid in seen:
            raise InputError(f"duplicate id {rid!r} (first on {where} {seen[rid]})")
        text = raw.get("text")
        if _missing(text) or not isinstance(text, str):
            raise InputError("text is empty; give the sentence to speak")
        settings = {k: _as(kind, k, raw[k], base) for k, kind in FIELD_TYPES.items()
                    if k in raw and not _missing(raw[k])}
    except InputError as e:
        return RowError(line, rid, str(e), where)
    seen[rid] = line
    return Utterance(rid, text.strip(), line, settings)


def _csv_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise InputError(f"{path}: the manifest is empty; the first line must be a header with id,text,...")
        header = [h.strip() for h in header]
        _check_header(path, header)
        start = reader.line_num + 1
        for cells in reader:
            line, start = start, reader.line_num + 1
            if not any(c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                yield line, {"__cells__": f"{len(cells)} cells but the header has {len(header)}"}
                continue
            yield line, dict(zip(header, cells))


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield line, {"__cells__": f"not valid JSON ({e.msg} at column {e.colno})"}
                continue
            yield line, row if isinstance(row, dict) else {"__cells__": f"a JSON {type(row).__name__}, not an object"}


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    import pandas as pd

    df = pd.read_parquet(path)
    _check_header(path, list(df.columns))
    for i, row in enumerate(df.to_dict("records"), 1):
        yield i, row


def _check_header(path: Path, header: list[str]) -> None:
    missing = [c for c in ("id", "text") if c not in header]
    unknown = [c for c in header if c not in COLUMNS]
    dup = sorted({c for c in header if header.count(c) > 1})
    if missing or unknown or dup:
        what = "; ".join(filter(None, [missing and f"missing column(s) {missing}",
                                       unknown and f"unknown column(s) {unknown}", dup and f"repeated {dup}"]))
        raise InputError(f"{path}: {what}; accepted columns: {', '.join(COLUMNS)} (id and text required)")


def read_manifest(path: str | Path) -> Manifest:
    """Read a manifest file; the format follows the suffix (``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``).

    Raises ``InputError`` for what refuses the whole file (unknown suffix or columns, no header); every bad row
    is kept in ``Manifest.errors`` with its line instead."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"manifest {path}: unknown format {path.suffix!r}; accepted: {', '.join(FORMATS)}")
    if not path.is_file():
        raise InputError(f"manifest {path} does not exist")
    where = "row" if fmt == "parquet" else "line"
    rows = {"csv": _csv_rows, "jsonl": _jsonl_rows, "parquet": _parquet_rows}[fmt](path)
    good, bad, seen = [], [], {}
    for line, raw in rows:
        if "__cells__" in raw:
            bad.append(RowError(line, None, raw["__cells__"], where))
            continue
        out = check_row(raw, line, path.parent.resolve(), seen, where)
        (bad if isinstance(out, RowError) else good).append(out)
    return Manifest(path, fmt, tuple(good), tuple(bad))


def from_records(rows: list[Mapping[str, Any]], base: str | Path | None = None) -> Manifest:
    """A manifest from in-memory rows (list of dicts, e.g. ``DataFrame.to_dict("records")``); ``line`` = 1-based row."""
    good, bad, seen = [], [], {}
    for i, raw in enumerate(rows, 1):
        out = check_row(raw, i, Path(base) if base else None, seen, "row")
        (bad if isinstance(out, RowError) else good).append(out)
    return Manifest(None, "records", tuple(good), tuple(bad))


def check_for_model(manifest: Manifest, model_dir: str | Path) -> Manifest:
    """Rows the model would refuse (variant, speaker, language, reference audio), found before anything starts.

    Reads ``config.json`` only (no torch); a hub id or a directory without it is left to the actors, whose
    refusals are reported the same way."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        return manifest

    cfg = Qwen3TTSConfig.load(cfg_path)
    kind = cfg.tts_model_type
    errs = []
    for u in manifest.utterances:
        s, msg = u.settings, None
        lang = s.get("language")
        if lang is not None and lang.lower() not in cfg.languages:
            msg = f"language {lang!r} is not supported; accepted: {', '.join(cfg.languages)}"
        elif kind == "custom_voice" and (s.get("speaker") or "").lower() not in cfg.speakers:
            msg = (f"speaker {s.get('speaker')!r} is not a speaker of this custom_voice model; accepted: "
                   f"{', '.join(cfg.speakers)}")
        elif kind != "custom_voice" and s.get("speaker"):
            msg = f"speaker: the {kind} model has no built-in speakers; leave the column empty"
        elif kind == "base" and "ref_audio" not in s:
            msg = "ref_audio is required for the base (voice clone) model"
        elif kind == "base" and "ref_text" not in s and s.get("x_vector_only_mode") is False:
            msg = "ref_text (the transcript of ref_audio) is required for ICL cloning (x_vector_only_mode false)"
        elif kind != "base" and any(k in s for k in ("ref_audio", "ref_text", "x_vector_only_mode")):
            msg = f"ref_audio/ref_text/x_vector_only_mode are only accepted by the base model; this one is {kind}"
        if msg:
            errs.append(RowError(u.line, u.id, msg, "row" if manifest.format in ("parquet", "records") else "line"))
    return manifest.with_errors(errs) if errs else manifest
