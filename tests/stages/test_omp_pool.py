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

from _deps import need  # noqa: E402

from omnilab.errors import ConfigError

_COMMON = """
import json, os, sys, threading, torch
torch.set_num_threads(2)
def n():  # the thread count once it is steady: a released worker leaves libgomp's barrier, then exits on its own
    import time
    seen, deadline = [], time.time() + 3
    while time.time() < deadline and (len(seen) < 5 or len(set(seen[-5:])) > 1):
        seen.append(len(os.listdir("/proc/self/task"))); time.sleep(0.02)
    return seen[-1]
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
def test_release_pauses_torchs_libgomp_not_a_vendored_copy():
    """Wheels vendor renamed libgomp copies: sentencepiece (vLLM's tokenizer stack) loads
    sentencepiece.libs/libgomp-<hash>.so.1.0.0 beside torch's. Pausing that copy returns 0 and frees nothing of
    torch's pools; picking the first libgomp in /proc/self/maps did that in a vLLM in-process pipeline
    (docs/reliability.md). The map order follows load addresses, so the case puts the vendored copy first on
    purpose: the release must still free the worker of torch's pool."""
    need("sentencepiece")
    r = _run("""
import sentencepiece  # loads its vendored libgomp copy (if the wheel has one)
from omnilab.stages import omp_pool
mapped = omp_pool._mapped_libgomp()
vendored = [p for p in mapped if os.path.basename(p) != omp_pool.SONAME]
omp_pool._mapped_libgomp = lambda: vendored + [p for p in mapped if p not in vendored]
base = n(); region(); pooled = n(); released = omp_pool.release_caller_pool()
print(json.dumps({"vendored": vendored, "base": base, "pooled": pooled, "released": released, "after": n(),
                  "why": omp_pool.describe(), "torch_gomp": [p for p in mapped if p not in vendored]}))
""")
    if not r["vendored"]:
        pytest.skip("this sentencepiece wheel vendors no libgomp copy")
    assert r["pooled"] == r["base"] + 1 and r["released"]
    assert r["after"] == r["base"], r  # torch's worker left: the vendored copy's pause would have kept it
    assert r["torch_gomp"][0] in r["why"] and "not the vendored copies" in r["why"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a 2-thread parallel region")
@pytest.mark.parametrize("setting", ["auto", pytest.param("off", marks=pytest.mark.slow)])
def test_a_pipeline_call_leaves_no_idle_pool_behind(tiny_ckpt, setting):
    """The user's path: the caller loaded the model (and did torch work of its own), then generates. With the
    release (default) neither the caller nor the owner thread keeps its workers after the call; with
    OMNILAB_OMP_RELEASE=off both pools stay (the state that throttled)."""
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
    if setting == "auto":  # no pool left by the earlier calls; the caller's new one is released by the next call
        assert r["grown"] == r["base"] + 1 and r["after"] == r["base"]
    else:  # the caller's pool from loading, and the owner's, stay throughout
        assert r["grown"] == r["base"] and r["after"] == r["base"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a 2-thread parallel region")
@pytest.mark.slow
def test_two_pipelines_side_by_side_keep_no_idle_pool(tiny_ckpt):
    """Two pipelines in one process (a comparison in a notebook, quality.compare, the bench's interleaved rounds):
    each has its own owner thread, so the one not computing must not keep its pool either, or it throttles the
    other's (vLLM in-process step 119-228 ms beside an eager pipeline, 74-76 ms with the owner's release). Same
    script with and without the release: the difference is one worker per pool at 2 threads, the caller's and
    both owners'."""
    code = """
import omnilab
a = omnilab.Pipeline.from_pretrained({path!r}, backend="eager")
b = omnilab.Pipeline.from_pretrained({path!r}, backend="eager")
for p in (a, b, a, b):
    p.generate("Hi there.", speaker="vivian", language="english", max_new_tokens=4)
print(json.dumps({{"after": n()}}))
a.close(); b.close()
"""
    path = str(tiny_ckpt("custom_voice"))
    off = _run(code.format(path=path), {"OMNILAB_OMP_RELEASE": "off"})
    auto = _run(code.format(path=path), {"OMNILAB_OMP_RELEASE": "auto"})
    assert off["after"] - auto["after"] == 3, (off, auto)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a 2-thread parallel region")
def test_the_thread_that_built_a_pipeline_keeps_no_pool_when_others_drive_it(tiny_ckpt):
    """A server builds its pipeline in one thread and streams from others; ``omnilab bench --serve`` builds its
    in-process twin on the main thread and drives it from client threads. The builder never calls the pipeline
    again, so it must leave ``from_pretrained`` without a pool (released there, after the last call it hands the
    owner thread): with the release the process keeps two workers fewer than with ``off`` (the builder's and the
    owner's), not one."""
    code = """
import omnilab
region()  # the builder's own torch work (loading a 0.6B, quantizing, timing) leaves it a pool
pipe = omnilab.Pipeline.from_pretrained({path!r}, backend="eager")
t = threading.Thread(target=lambda: pipe.generate("Hi there.", speaker="vivian", language="english",
                                                  max_new_tokens=4))
t.start(); t.join()
print(json.dumps({{"after": n()}}))
pipe.close()
"""
    path = str(tiny_ckpt("custom_voice"))
    off = _run(code.format(path=path), {"OMNILAB_OMP_RELEASE": "off"})
    auto = _run(code.format(path=path), {"OMNILAB_OMP_RELEASE": "auto"})
    assert off["after"] - auto["after"] == 2, (off, auto)


def test_a_bad_setting_names_the_accepted_values(monkeypatch):
    from omnilab.stages import omp_pool
    monkeypatch.setenv(omp_pool.ENV, "sometimes")
    with pytest.raises(ConfigError, match="OMNILAB_OMP_RELEASE='sometimes'; accepted: auto, off"):
        omp_pool.release_caller_pool()

