"""Trace tables on disk with the run's metadata: CSV and Parquet writers and the reader that gives it back.

Contract (``Trace.to_csv`` / ``Trace.to_parquet`` write through here, ``Trace.read_tables`` reads back):

- The metadata is ``Trace.meta`` (backend, dtype, quantization, threads, checkpoint, placement, processes),
  each value JSON-encoded.
- CSV: the file starts with one comment line per key, ``# key: <json value>``, then the ordinary header and
  rows. :func:`read_table` skips those lines and returns them as ``df.attrs["omnilab"]``; with plain pandas
  use ``pd.read_csv(path, skiprows=n)`` where n is the number of leading ``#`` lines (not ``comment="#"``:
  a field may hold a ``#``).
- Parquet: the schema metadata key ``omnilab`` holds the JSON object of all keys (``pyarrow``: ``pq.read_schema
  (path).metadata[b"omnilab"]``); :func:`read_table` returns it as ``df.attrs["omnilab"]`` too.

Plain Python + pandas (pyarrow for Parquet).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

META_KEY = "omnilab"
KINDS = ("spans", "threads", "cores", "processes")


def _json(v: Any) -> str:
    return json.dumps(v, default=str, sort_keys=True)


def write_table(df, path: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``df`` (no index) to ``path`` (``.csv`` or ``.parquet``) with ``meta`` as described above."""
    p = Path(path)
    if p.suffix == ".csv":
        with open(p, "w", newline="", encoding="utf-8") as f:
            for k, v in meta.items():
                f.write(f"# {str(k).replace(':', '_').replace(chr(10), ' ')}: {_json(v)}\n")
            df.to_csv(f, index=False)
        return p
    if p.suffix != ".parquet":
        raise ValueError(f"{p.name}: write_table writes .csv or .parquet")
    _need_pyarrow()
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY.encode(): _json(meta).encode()})
    pq.write_table(table, p)
    return p


def _need_pyarrow() -> None:
    if not importlib.util.find_spec("pyarrow"):
        raise ImportError("Parquet tables need pyarrow: pip install pyarrow (in the notebook extra), or use to_csv")


def read_meta(path: str | Path) -> dict[str, Any]:
    """The metadata :func:`write_table` put in ``path`` ({} when there is none)."""
    p = Path(path)
    if p.suffix == ".parquet":
        _need_pyarrow()
        import pyarrow.parquet as pq

        raw = (pq.read_schema(p).metadata or {}).get(META_KEY.encode())
        return json.loads(raw) if raw else {}
    meta: dict[str, Any] = {}
    with open(p, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("# "):
                break
            key, _, value = line[2:].rstrip("\n").partition(": ")
            meta[key] = json.loads(value)
    return meta


def read_table(path: str | Path):
    """A table :func:`write_table` wrote (or any plain CSV/Parquet) -> DataFrame, metadata in ``.attrs["omnilab"]``."""
    import pandas as pd

    p = Path(path)
    meta = read_meta(p)
    if p.suffix == ".parquet":
        df = pd.read_parquet(p)
    else:
        with open(p, encoding="utf-8") as f:
            skip = 0
            for line in f:
                if not line.startswith("# "):
                    break
                skip += 1
        df = pd.read_csv(p, skiprows=skip)
    df.attrs[META_KEY] = meta
    return df


def write_trace(trace, directory: str | Path, prefix: str, fmt: str) -> list[Path]:
    """``<prefix>_spans.<fmt>`` and, when sampled, ``_threads/_cores/_processes`` (``Trace.to_csv``)."""
    if fmt == "parquet":
        _need_pyarrow()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for kind in KINDS:
        df = trace.to_pandas(kind)
        if kind != "spans" and not len(df):
            continue
        out.append(write_table(df, d / f"{prefix}_{kind}.{fmt}", {**trace.meta, "table": kind}))
    return out


def read_trace(directory: str | Path, prefix: str = "trace", fmt: str | None = None) -> dict[str, Any]:
    """What :func:`write_trace` wrote, as ``Trace.to_dict()`` gives it (``Trace.read_tables`` builds the
    ``Trace``): span dicts, sample rows and meta; ``fmt`` guessed from the files."""
    import pandas as pd

    d = Path(directory)
    if fmt is None:
        fmt = "csv" if (d / f"{prefix}_spans.csv").exists() else "parquet"
    spans_df = read_table(d / f"{prefix}_spans.{fmt}")
    meta = {k: v for k, v in spans_df.attrs.get(META_KEY, {}).items() if k != "table"}
    spans = []
    for row in spans_df.to_dict("records"):
        row["attrs"] = json.loads(row["attrs"]) if isinstance(row.get("attrs"), str) else {}
        row["request_id"] = "" if pd.isna(row["request_id"]) else str(row["request_id"])
        spans.append(row)
    out: dict[str, Any] = {"spans": spans, "meta": meta}
    for kind, key in zip(KINDS[1:], ("thread_samples", "core_samples", "process_samples")):
        p = d / f"{prefix}_{kind}.{fmt}"
        out[key] = read_table(p).drop(columns=["t_ms"], errors="ignore").to_dict("records") if p.exists() else []
    return out
