"""Plain, escaped HTML tables for the ``_repr_html_`` of omnilab objects (no styling framework).

Floats are shown with at most four significant digits below 10,000 and as integers above (``fmt``), so a
metric table never shows ``12.345678``. ``Summary`` is a dict that renders as a two-column table in a notebook.
"""
from __future__ import annotations

import html
import math
from typing import Iterable, Mapping


def fmt(v: object) -> str:
    """A cell's text: floats rounded for reading (``12.35``, ``0.001234``, ``12346``), everything else ``str``."""
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
    return str(v)


def html_table(header: list[str], rows: Iterable[Iterable[object]]) -> str:
    """A table with a header row and one row per item of ``rows``."""
    th = "".join(f"<th style='text-align:left'>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(fmt(c))}</td>" for c in r)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def key_value_table(items: Mapping[object, object]) -> str:
    """A two-column table: each key as a row header, its value beside it."""
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(fmt(v))}</td></tr>"
                   for k, v in items.items())
    return f"<table>{rows}</table>"


class Summary(dict):
    """A plain dict of figures that a notebook shows as a key/value table (``_repr_html_``)."""

    def _repr_html_(self) -> str:
        return key_value_table(self)
