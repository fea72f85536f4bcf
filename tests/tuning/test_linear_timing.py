"""The timing of the linear paths (omnilab.tuning.timing): measured, cached per key, refreshed, off; and the two
paths it chooses in kernels.linear (bf16 decode rows through the kernel, bf16 prefill GEMMs), each equal by
construction to the computation it names. Timing figures are never asserted (a shared host): only their shape."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from omnilab.kernels import gemv
from omnilab.kernels.gemv import _SLOT, _call
from omnilab.tuning import timing

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNILAB_CACHE", str(tmp_path))
    monkeypatch.setattr(timing, "TIMING_MIB", 8)  # a small pass: the arithmetic and caching, not the figures
    timing._MEMO.clear()
    timing.reset()
    yield tmp_path
    timing._MEMO.clear()
    timing.reset()


def test_a_timing_has_every_candidate_and_is_cached(fresh, monkeypatch):
    t = timing.path_times(threads=1, env="on")
    assert set(t.decode) >= {"fp32-kernel", "bf16-torch"} and set(t.prefill) == {"fp32", "bf16"}
    assert all(ms > 0 for rows in t.decode.values() for ms in rows.values()) and t.matrix_bytes > 0
    monkeypatch.setattr(timing, "_schedstat", lambda: (1, 0))  # a quiet host, so the entry is written
    timing._MEMO.clear()
    t = timing.path_times(threads=1, env="refresh")
    files = list((fresh / "timing").glob("paths-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == t.key
    timing._MEMO.clear()
    calls = []
    monkeypatch.setattr(timing, "measure", lambda *a, **k: calls.append(1))
    again = timing.path_times(threads=1, env="on")
    assert again.cached and again.decode == t.decode and not calls  # read back, not measured again
    assert timing._key(1)[0] != timing._key(2)[0]  # the thread count is part of the key


def test_a_noisy_timing_is_not_cached(fresh, monkeypatch):
    seq = iter([(0, 0), (100, 50)])  # 50 % of the CPU time spent waiting on the run queue
    monkeypatch.setattr(timing, "_schedstat", lambda: next(seq))
    t = timing.path_times(threads=1, env="on")
    assert t.extra["wait_share"] == 0.5 and "noisy, not cached" in t.describe()
    assert not list((fresh / "timing").glob("paths-*.json"))


def test_off_gives_no_timing_and_the_isa_rule(fresh, monkeypatch):
    assert timing.path_times(env="off") is None
    monkeypatch.setenv("OMNILAB_PLAN_TIMING", "off")
    p = timing.resolve_paths()
    assert p.source == "off" and p.prefill == "fp32" and p.bf16_decode == "kernel"


def test_variables_choose_the_paths_and_bad_values_are_errors(fresh, monkeypatch):
    from omnilab.errors import ConfigError
    monkeypatch.setenv("OMNILAB_BF16_DECODE", "torch")
    monkeypatch.setenv("OMNILAB_PREFILL_GEMM", "bf16")
    p = timing.resolve_paths()
    assert (p.bf16_decode, p.prefill, p.source) == ("torch", "bf16", "env")
    monkeypatch.setenv("OMNILAB_PREFILL_GEMM", "fp16")
    with pytest.raises(ConfigError, match="OMNILAB_PREFILL_GEMM='fp16'; accepted: auto, fp32, bf16"):
        timing.resolve_paths()


def _use(monkeypatch, **kw):
    monkeypatch.setattr(gemv, "_INSTALLED", [timing.LinearPaths(**{"bf16_decode": "kernel", "prefill": "fp32",
                                                                    "reason": "test", "source": "env", **kw})])


def test_linear_paths_installs_what_it_resolves(fresh, monkeypatch):
    monkeypatch.setenv("OMNILAB_PREFILL_GEMM", "bf16")
    monkeypatch.setenv("OMNILAB_BF16_DECODE", "torch")
    assert gemv._paths().prefill == "fp32"  # the prior until resolved
    timing.linear_paths()
    assert (gemv._paths().prefill, gemv._paths().bf16_decode) == ("bf16", "torch")
    timing.reset()
    assert gemv._paths().prefill == "fp32"


def test_bf16_decode_rows_take_the_kernel_on_widened_inputs(monkeypatch):
    lib = _SLOT.loaded()
    if lib is None:
        pytest.skip("no omnilab GEMV kernel on this machine (no compiler or ISA)")
    torch.manual_seed(0)
    w, b = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    _use(monkeypatch, bf16_decode="kernel")
    y = gemv.linear(x, w, b)
    # equal by construction: the same kernel over the exactly widened inputs, rounded to bf16 once
    assert y.dtype == torch.bfloat16 and torch.equal(y, _call(lib, x.float(), w, b.float(), 3).bfloat16())
    _use(monkeypatch, bf16_decode="torch")
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))


def test_prefill_over_bf16_matrices_follows_the_choice(monkeypatch):
    torch.manual_seed(0)
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40)
    x = torch.randn(2, 20, 64)  # 40 rows: above the kernel's 16, a prefill
    _use(monkeypatch, prefill="bf16")
    assert torch.equal(gemv.linear(x, w, b), F.linear(x.bfloat16(), w).float() + b)
    _use(monkeypatch, prefill="fp32")
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w.float(), b))
