"""Quiet by default (omnilab/logs.py): vLLM/torch/Triton chatter stays out of the CLI's output and notebook cells
unless asked (``set_verbosity``, ``OMNILAB_LOG_LEVEL``, ``--verbose``); omnilab's own warnings and every error stay
visible. The end-to-end check runs ``omnilab synth`` on the vLLM backend in a subprocess, as a user does."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from omnilab import logs
from omnilab.errors import InputError

REDUCE_OP = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
NUMA = b"[W1201 11:33:35.672 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation on the " \
       b"NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes. (function init_cpu_memory_env)\n"


@pytest.fixture
def level(monkeypatch):
    """Each test starts at the default level with no vLLM level of the user's; the default state is put back."""
    for k in (logs.ENV, "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS"):
        monkeypatch.delenv(k, raising=False)
    logs._ours.clear()
    yield logs
    for k in (logs.ENV, "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS"):
        os.environ.pop(k, None)
    logs._ours.clear()
    logs.quiet_libraries()


def test_levels_validate_and_reach_the_environment(level, monkeypatch):
    assert level.verbosity() == "warning" and level.quiet()
    assert level.set_verbosity("INFO") == "info" and os.environ[logs.ENV] == "info" and not level.quiet()
    with pytest.raises(InputError, match=r"verbosity 'loud'; accepted: error, warning, info, debug"):
        level.set_verbosity("loud")
    monkeypatch.setenv(logs.ENV, "chatty")
    with pytest.raises(InputError, match=r"OMNILAB_LOG_LEVEL='chatty'; accepted: error, warning, info, debug"):
        level.verbosity()


def test_vllm_level_follows_the_verbosity_unless_the_user_set_it(level, monkeypatch):
    assert level.quiet_libraries() == "ERROR" and os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert logging.getLogger("vllm").level == logging.ERROR  # vLLM's import-time warnings, before it configures
    level.set_verbosity("info")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and logging.getLogger("vllm").level == logging.WARNING
    level.set_verbosity("debug")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert level.quiet_libraries("INFO") == "INFO"  # VllmStageConfig.log_level, when given
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # the user's own value: never replaced
    level.set_verbosity("warning")
    assert level.quiet_libraries() == "WARNING" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"


def test_third_party_noise_is_filtered_exactly_and_omnilab_warnings_stay(level, tiny_pipe):
    level.set_verbosity("warning")
    with warnings.catch_warnings(record=True) as got:  # the filters as they are (not "always")
        warnings.warn(REDUCE_OP, FutureWarning)  # what vLLM's Triton dispatcher triggers: dropped
        warnings.warn(REDUCE_OP, UserWarning)  # same text, other category: not ours to hide
        warnings.warn("`torch.distributed.something_else` is deprecated", FutureWarning)
        # a warning omnilab itself emits, on the path users take: instruct on the 0.6B CustomVoice is dropped
        tiny_pipe.generate("Hi.", speaker="vivian", instruct="Whisper.", max_new_tokens=3, do_sample=False,
                           subtalker_do_sample=False)
    msgs = [(w.category, str(w.message)) for w in got]
    assert (FutureWarning, REDUCE_OP) not in msgs
    assert (UserWarning, REDUCE_OP) in msgs and any("something_else" in m for _, m in msgs)
    assert any("instruct is ignored" in m for _, m in msgs), msgs
    level.set_verbosity("info")  # asked for: the library warning is back
    with warnings.catch_warnings(record=True) as got:
        warnings.warn(REDUCE_OP, FutureWarning)
    assert [str(w.message) for w in got] == [REDUCE_OP]


def test_worker_processes_inherit_the_filters(level):
    """A spawned process (vLLM's engine core, the workers) reads PYTHONWARNINGS: the same warning is dropped there,
    and shown again at info."""
    code = f"import warnings; warnings.warn({REDUCE_OP!r}, FutureWarning); warnings.warn('kept', UserWarning)"
    level.set_verbosity("warning")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy()).stderr
    assert "reduce_op" not in err and "kept" in err
    level.set_verbosity("info")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy()).stderr
    assert "reduce_op" in err and "kept" in err


def test_native_notice_dropped_other_stderr_passed_on(level, capfd):
    level.set_verbosity("warning")
    with logs.native_notices():
        os.write(2, NUMA + b"a real problem\n")
    assert capfd.readouterr().err == "a real problem\n"
    with pytest.raises(RuntimeError, match="boom"):  # errors propagate, and what was printed still comes out
        with logs.native_notices():
            os.write(2, b"before the error\n")
            raise RuntimeError("boom")
    assert capfd.readouterr().err == "before the error\n"
    level.set_verbosity("info")
    with logs.native_notices():
        os.write(2, NUMA)
    assert "NUMA binding" in capfd.readouterr().err


NOISE = re.compile(r"WARNING|Warning|Triton|FutureWarning|NUMA|deprecated|\x1b\[")


def _synth(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (logs.ENV, "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS")}
    exe = Path(sys.executable).with_name("omnilab")  # the console script users run
    cmd = [*([str(exe)] if exe.is_file() else [sys.executable, "-m", "omnilab.cli.main"]), "synth", "Hi there.", "--out", str(tmp_path), "--backend", "vllm",
           "--deploy", "inprocess", "--max-new-tokens", "3", "--greedy", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.vllm
def test_synth_prints_no_third_party_warning(tmp_path):
    r = _synth(tmp_path / "quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    noisy = [ln for ln in (r.stdout + r.stderr).splitlines() if NOISE.search(ln)]
    assert noisy == [] and r.stderr == ""
    assert "latency csv" in r.stdout and (tmp_path / "quiet" / "omnilab_demo.wav").is_file()


@pytest.mark.slow
@pytest.mark.vllm
def test_synth_verbose_brings_vllm_warnings_back(tmp_path):
    r = _synth(tmp_path / "verbose", "--verbose")
    assert r.returncode == 0, r.stderr[-3000:]
    vllm_lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "WARNING" in ln and ".py:" in ln]
    assert vllm_lines, (r.stdout + r.stderr)[-3000:]
