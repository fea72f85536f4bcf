"""``omnilab settings``: every ``OMNILAB_*`` variable with its value here and the value's source (omnilab/settings.py)."""
from __future__ import annotations

import argparse
import json
from typing import Sequence

from omnilab.cli.main import Formatter
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity
from omnilab.settings import current


def settings_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab settings", formatter_class=Formatter,
                                 description="Print every OMNILAB_* environment variable: its value here, where the "
                                             "value comes from (env or default), what it accepts and means. "
                                             "docs/settings.md lists the same.")
    ap.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)
    rows = current()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    w = max(len(r["name"]) for r in rows)
    v = min(max(len(r["value"]) for r in rows), 32)
    for r in rows:
        print(f"{r['name']:<{w}}  {r['value'][:v]:<{v}}  {r['source']:<7}  {r['means']}")
    return 0
