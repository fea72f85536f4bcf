"""The quantized GEMV's software-prefetch distances (tuning/prefetch.py, qgemv.cpp's omnilab_qgemv_set_prefetch):
the override's spelling, the rule that turns times into a choice, the timing and its cache, and that a distance
never changes a result (a prefetch only moves data into cache: the arithmetic is the same instruction sequence,
so equality is bitwise by construction, on every ISA)."""
from __future__ import annotations

import json

import pytest
import torch

from omnilab.errors import ConfigError
from omnilab.kernels import qgemv, quant
from omnilab.kernels.build import build_library
from omnilab.tuning import prefetch

from _kernel_common import FLAGS, ISAS, skip_without_isa  # noqa: E402

skip_without_isa()
QISAS = [i for i in ISAS if i != "avx512" or "avx512_vnni" in FLAGS]


@pytest.fixture(scope="module", params=QISAS)
def lib(request):
    lib = qgemv._Lib(build_library("qgemv", request.param))
    yield lib
    lib.set_prefetch(*prefetch.PRIOR)


@pytest.mark.parametrize("raw,want", [("", None), ("auto", None), (" AUTO ", None), ("0", (0, 0, 0)),
                                      ("4096", (4096, 4096, 4096)), ("0, 2048,8192", (0, 2048, 8192))])
def test_parse(raw, want):
    assert prefetch.parse(raw) == want


@pytest.mark.parametrize("raw", ["fast", "100", "-64", "65600", "64,128", "1,2,3,4", "64,,128"])
def test_parse_rejects_with_the_accepted_values(raw):
    with pytest.raises(ConfigError, match="OMNILAB_QGEMV_PREFETCH.*accepted: auto.*multiple of 64"):
        prefetch.parse(raw)


def test_kernel_rejects_bad_distances_and_changes_nothing(lib):
    assert lib.set_prefetch(0, 1024, 4096) == 0
    assert lib.set_prefetch(100, 64, 64) == -1
    assert lib.set_prefetch(64, 64, 65536 + 64) == -1
    assert lib.set_prefetch(-1, -1, 8192) == 0  # negative: keep that slot


def test_choose_keeps_the_prior_within_the_margin_and_takes_a_clearly_faster_one():
    t = {s: {c: 10.0 for c in prefetch.CANDIDATES} for s in prefetch.SLOTS}
    t["one_row_int8_act"][4096] = 10.0 * (1 - prefetch.MARGIN / 2)   # inside the margin: prior (0) kept
    t["rows_int8_act"][8192] = 7.0                                   # clearly faster: taken
    t["fp32_act"][0] = 12.0
    dist, why = prefetch.choose(t)
    assert dist == (prefetch.PRIOR[0], 8192, prefetch.PRIOR[2])
    assert "rows_int8_act 8192" in why and "8192: 7.0" in why


@pytest.mark.parametrize("method,gs,act8", [("int4", 128, 1), ("int4", 32, 1), ("int8", None, 0), ("int8", None, 1)])
def test_distance_never_changes_a_result(lib, method, gs, act8):
    """Rows 1, 4 and 16 through each distance: bitwise the no-prefetch result."""
    g = torch.Generator().manual_seed(3)
    qw = quant.quantize(torch.randn(2048, 1024, generator=g) / 32, method, gs)
    x = torch.randn(16, 1024, generator=g)
    activations = "int8" if act8 else "fp32"
    try:
        lib.set_prefetch(0, 0, 0)
        ref = {m: qgemv.qgemv_rows(x[:m], qw, lib=lib, activations=activations) for m in (1, 4, 16)}
        for d in (64, 1024, 8192, 65536):
            assert lib.set_prefetch(d, d, d) == 0
            for m, want in ref.items():
                assert torch.equal(qgemv.qgemv_rows(x[:m], qw, lib=lib, activations=activations), want), (d, m)
    finally:
        lib.set_prefetch(*prefetch.PRIOR)


def test_measure_times_every_slot_and_candidate(lib):
    times, wait = prefetch.measure(lib.fn, lib.set_prefetch, threads=1, mib=1)
    assert set(times) == set(prefetch.SLOTS)
    assert all(set(t) == set(prefetch.CANDIDATES) and all(ms > 0 for ms in t.values()) for t in times.values())
    assert 0 <= wait


def test_resolve_env_timing_off_and_the_cache(lib, monkeypatch, tmp_path):
    monkeypatch.setenv("OMNILAB_CACHE", str(tmp_path))
    monkeypatch.setenv(prefetch.ENV, "1024,2048,4096")
    p = prefetch.resolve(lib)
    assert (p.distances, p.source) == ((1024, 2048, 4096), "env") and "OMNILAB_QGEMV_PREFETCH" in p.reason
    monkeypatch.setenv(prefetch.ENV, "auto")
    monkeypatch.setenv("OMNILAB_PLAN_TIMING", "off")
    p = prefetch.resolve(lib)
    assert (p.distances, p.source) == (prefetch.PRIOR, "prior") and "OMNILAB_PLAN_TIMING=off" in p.reason
    monkeypatch.setenv("OMNILAB_PLAN_TIMING", "auto")
    monkeypatch.setattr(prefetch, "TIMING_MIB", 1)
    calls = []
    real = prefetch.measure

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **{**k, "mib": 1})

    monkeypatch.setattr(prefetch, "measure", counted)
    first = prefetch.resolve(lib, threads=1)
    assert first.source in ("timing", "cached") and len(calls) == 1
    files = list((tmp_path / "timing").glob("qgemv-prefetch-*.json"))
    if first.reason.find("not cached") < 0:  # a quiet machine: written, and read back without timing
        assert len(files) == 1 and set(json.loads(files[0].read_text())["times"]) == set(prefetch.SLOTS)
        again = prefetch.resolve(lib, threads=1)
        assert again.source == "cached" and again.distances == first.distances and len(calls) == 1
        files[0].write_text("{damaged")
        assert prefetch.resolve(lib, threads=1).source == "timing" and len(calls) == 2


def test_choice_says_the_distances(monkeypatch):
    monkeypatch.delenv(qgemv.ENV, raising=False)
    monkeypatch.setenv(prefetch.ENV, "2048")
    qgemv.reset()
    try:
        c = qgemv.qgemv_choice()
        if c.mode == "omnilab":
            assert c.prefetch == (2048, 2048, 2048) and "software prefetch 2048/2048/2048 bytes" in c.reason
    finally:
        lib = qgemv.loaded_library()
        if lib is not None:
            lib.set_prefetch(*prefetch.PRIOR)
        qgemv.reset()
