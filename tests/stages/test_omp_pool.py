"""A pipeline's caller and its owner thread never both keep an idle GNU OpenMP pool (omnilab.stages.omp_pool): with
more OpenMP workers than CPUs libgomp throttles every pool's spinning, which made the 0.6B int4 step 2-2.5x slower
on two cores (docs/reliability.md#threads-and-iterators). Each case runs in a fresh interpreter, so the count of
threads it reads starts from a known state; libgomp's pool workers are OS threads of the process
(/proc/self/task)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnilab.errors import ConfigError

_COMMON = """
import json, os, sys, threading, torch
torch.set_num_threads(2)
def n(): return len(os.listdir("/proc/self/task"))
def region(): torch.ones(1 << 22).sum()  # a parallel region on 2 threads: this thread's pool gets 1 worker
"""


def _run(code: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _COMMON + code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a 2-thread parallel region")
def test_release_frees_the_calling_threads_pool_and_only_that():
    r = _run("""
from omnilab.stages import omp_pool
res = {}
def other():
    region(); res["with_pool"] = n(); res["released"] = omp_pool.release_caller_pool(); res["after"] = n()
base = n(); region(); main_pool = n()
t = threading.Thread(target=other); t.start(); t.join()
print(json.dumps({"base": base, "main_pool": main_pool, **res, "end": n(), "why": omp_pool.describe()}))
""")
    assert r["main_pool"] == r["base"] + 1  # the main thread's pool: one worker
    assert r["with_pool"] == r["main_pool"] + 2 and r["released"]  # + the other thread and its worker
    assert r["after"] == r["main_pool"] + 1  # its worker left; the main thread's pool is untouched
    assert "libgomp" in r["why"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a 2-thread parallel region")
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_a_pipeline_call_leaves_no_idle_pool_behind(tiny_ckpt, setting):
    """The user's path: the caller loaded the model (and did torch work of its own), then generates. With the
    release (default) the caller's pool is gone after the call and only the owner thread's (the one that computes)
    remains; with OMNILAB_OMP_RELEASE=off both pools stay (the state that throttled)."""
    r = _run(f"""
import omnilab
pipe = omnilab.Pipeline.from_pretrained({str(tiny_ckpt('custom_voice'))!r}, backend="eager")
gen = lambda: pipe.generate("Hi there.", speaker="vivian", language="english", max_new_tokens=4)
gen(); gen()
base = n(); region(); grown = n()
codes = gen().codes
print(json.dumps({{"base": base, "grown": grown, "after": n(), "frames": int(codes.shape[0])}}))
pipe.close()
""", {"OMNILAB_OMP_RELEASE": setting})
    assert r["frames"] > 0
    if setting == "auto":  # the earlier calls left only the owner's pool; the caller's new one goes with the next
        assert r["grown"] == r["base"] + 1 and r["after"] == r["base"]
    else:  # the caller's pool from loading, and the owner's, stay throughout
        assert r["grown"] == r["base"] and r["after"] == r["base"]


def test_a_bad_setting_names_the_accepted_values(monkeypatch):
    from omnilab.stages import omp_pool
    monkeypatch.setenv(omp_pool.ENV, "sometimes")
    with pytest.raises(ConfigError, match="OMNILAB_OMP_RELEASE='sometimes'; accepted: auto, off"):
        omp_pool.release_caller_pool()

