"""Plain, escaped HTML tables for the ``_repr_html_`` of omnilab objects (no styling framework)."""
from __future__ import annotations

import html
from typing import Iterable, Mapping


def html_table(header: list[str], rows: Iterable[Iterable[object]]) -> str:
    """A table with a header row and one row per item of ``rows``."""
    th = "".join(f"<th style='text-align:left'>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>" for c in r)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def key_value_table(items: Mapping[object, object]) -> str:
    """A two-column table: each key as a row header, its value beside it."""
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in items.items())
    return f"<table>{rows}</table>"
