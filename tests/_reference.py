"""Where the official qwen-tts reference environment is, for tests that compare against it."""
from __future__ import annotations

import os
from pathlib import Path


def reference_python() -> str | None:
    """The reference venv's python (``$OMNILAB_REF_PYTHON``, else the repository's ``.venv-ref``), or None."""
    repo = Path(__file__).resolve().parents[1]
    for cand in (os.environ.get("OMNILAB_REF_PYTHON"), repo / ".venv-ref/bin/python"):
        if cand and Path(cand).is_file():
            return str(cand)
    return None
