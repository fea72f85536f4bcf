"""The test suite's own contract (docs/testing.md): the fast tier keeps a test of every path, a missing dependency
fails a CI run instead of skipping, and markers are declared."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each path a user takes, and the fast-tier test(s) that run it (./scripts/test.sh must collect every one).
FAST_TIER_PATHS = {
    "eager": "tests/stages/test_eager.py::test_greedy_generation_is_deterministic_and_uses_the_kv_cache",
    "vLLM in-process": "tests/stages/test_vllm_talker.py::test_vllm_codes_equal_eager_for_every_variant[custom_voice]",
    "vLLM workers": "tests/stages/test_vllm_workers.py::test_workers_pipeline_equals_in_process",
    "code2wav worker": "tests/stages/test_code2wav_worker.py::test_worker_audio_equals_in_process",
    "TP=2 on tiny": "tests/stages/test_vllm_tensor_parallel.py::test_two_ranks_give_the_codes_of_one",
    "int8": "tests/checkpoint/test_quantized_checkpoint.py::test_file_and_at_load_give_the_same_codes[int8]",
    "int4": "tests/checkpoint/test_quantized_checkpoint.py::test_file_and_at_load_give_the_same_codes[int4]",
    "CustomVoice": "tests/stages/test_vllm_talker.py::test_vllm_codes_equal_eager_for_every_variant[custom_voice]",
    "VoiceDesign": "tests/stages/test_vllm_talker.py::test_vllm_codes_equal_eager_for_every_variant[voice_design]",
    "Base (x-vector and ICL)": "tests/stages/test_vllm_talker.py::test_vllm_codes_equal_eager_for_every_variant[base]",
    "streaming == offline": "tests/test_pipeline.py::test_stream_equals_generate",
    "parity goldens": "tests/test_parity.py::test_codes_match_the_official_package",
    "Ray batch (local mode)": "tests/batch/test_batch_ray.py::test_local_mode_batch",
    "notebook 00 in-process": "tests/test_notebooks.py::test_notebook_executes[inprocess-00_quickstart]",
    "notebook 00 in Chromium": "tests/test_browser_notebooks.py::test_notebook_in_the_browser[00_quickstart]",
}


def _pytest(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 600):
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_the_fast_tier_runs_every_path():
    """``./scripts/test.sh`` (``-m "not slow"``) collects a test of each path in ``FAST_TIER_PATHS``."""
    out = _pytest(["--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider"], ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.strip() for line in out.stdout.splitlines()}
    missing = {path: test for path, test in FAST_TIER_PATHS.items()
               if not any(c == test or c.startswith(test + "[") for c in collected)}
    assert missing == {}, f"paths with no fast-tier test: {missing}"


def test_no_test_skips_silently_on_a_missing_package():
    """Dependencies are imported through ``tests/_deps.py`` (``need``), whose skip turns into a failure under
    ``CI=true``; ``pytest.importorskip`` would skip even there."""
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py"))
                 if p.name != "test_suite.py" and "importorskip(" in p.read_text()]
    assert offenders == []


@pytest.mark.parametrize("ci, rc, word", [("", 0, "1 skipped"), ("true", 1, "1 failed")])
def test_a_missing_dependency_fails_only_under_ci(tmp_path, ci, rc, word):
    """The same test skips on a developer's machine and fails in CI, naming the module in both."""
    (tmp_path / "test_needs.py").write_text(textwrap.dedent("""
        from _deps import need

        def test_needs_a_package():
            need("omnilab_no_such_module")
    """))
    out = _pytest(["-q", "-rs", "-p", "no:cacheprovider", "test_needs.py"], tmp_path,
                  env={"CI": ci, "PYTHONPATH": str(ROOT / "tests")}, timeout_s=120)
    text = out.stdout + out.stderr
    assert out.returncode == rc, text
    assert word in text and "missing dependency: cannot import 'omnilab_no_such_module'" in text, text
