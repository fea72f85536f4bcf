"""The official reference row of ``omnilab bench``: qwen-tts 0.1.1 on the same checkpoint and threads.

Runs ``scripts/reference/bench_reference.py`` in the reference environment (``.venv-ref``, made by
``scripts/reference/setup_ref_env.sh``; a source checkout only) as a subprocess. Its figures:

- ``step_ms``: talker + code predictor ms per frame through the official ``generate`` (greedy, one
  utterance of ``frames`` frames, prefill included: the official API is not step-wise);
- ``code2wav_ms_per_frame``: the official decoder on 25-frame offline chunks; ``code2wav_1f/25f/100f``
  ms per frame and the 1-frame chunk in ms (no streaming context: the official decoder has no state).

Only CustomVoice and VoiceDesign checkpoints (the script's limit). Not streamed, so no TTFA.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # a source checkout (the reference env lives there); absent otherwise
REFERENCE_PYTHON = REPO / ".venv-ref" / "bin" / "python"
REFERENCE_SCRIPT = REPO / "scripts" / "reference" / "bench_reference.py"
NAME = "reference (qwen-tts)"


def reference_available() -> bool:
    return REFERENCE_PYTHON.is_file() and REFERENCE_SCRIPT.is_file()


def reference_row(checkpoint: str | os.PathLike, threads: int, frames: int, timeout_s: float = 3600.0) -> dict[str, Any]:
    """One table row from the official package (see the module docstring); raises ``RuntimeError`` when
    the reference run fails (its stderr tail in the message)."""
    if not reference_available():
        raise RuntimeError(f"the reference environment is missing ({REFERENCE_PYTHON}); "
                           "make it with scripts/reference/setup_ref_env.sh")
    cmd = [str(REFERENCE_PYTHON), str(REFERENCE_SCRIPT), str(checkpoint), "--threads", str(threads),
           "--frames", str(frames)]
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(threads)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"reference run failed ({p.returncode}): {p.stderr[-2000:]}")
    ref = json.loads(p.stdout.strip().splitlines()[-1])
    return {"config": NAME, "runs": 1, "step_ms": ref["talker_predictor_ms_per_frame"],
            "code2wav_ms_per_frame": ref["code2wav_25f_ms_per_frame"],
            **{k: v for k, v in ref.items() if k.startswith("code2wav_")},
            "code2wav_1f_chunk_ms": ref["code2wav_1f_ms_per_chunk"],
            "frames": ref.get("frames"), "pid": None,
            "note": "official generate(): ms per frame with the prefill included, not streamed; code2wav on "
                    "25-frame offline chunks", "command": " ".join(cmd)}
