"""The dtype and linear paths chosen from a timing (omnilab.profiles.timing), with injected figures, on the planner's
hardware fixtures: the rules must pick the measured-faster path and say the figures, and fall back to the ISA rule
without a timing. (A real timing is taken in tests/tuning/test_linear_timing.py; its figures are never asserted.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from omnilab.hardware import probe_hardware
from omnilab.profiles import plan, resolve_profile
from omnilab.profiles.timing import (PathTimes, bf16_decode_from_times, dtype_from_times, prefill_from_times)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"
MB = 256 * 2**20


def times(fp32=60.0, bf16_torch=120.0, bf16_kernel=62.0, pre_fp32=70.0, pre_bf16=15.0) -> PathTimes:
    return PathTimes({"fp32-kernel": {1: fp32, 4: fp32 * 1.5}, "bf16-torch": {1: bf16_torch, 4: bf16_torch},
                      "bf16-kernel": {1: bf16_kernel, 4: bf16_kernel * 1.5}},
                     {"fp32": pre_fp32, "bf16": pre_bf16}, MB, 64, 2)


def test_fp32_compute_wins_when_it_decodes_faster_and_says_the_figures():
    name, why = dtype_from_times(True, "x86 with amx_bf16", times())
    assert name == "float32"
    assert "60.0" in why and "62.0" in why and "amx_bf16" in why  # the measured figures, in the reason


def test_bf16_wins_only_by_more_than_the_margin():
    assert dtype_from_times(True, "bf16", times(fp32=60.0, bf16_kernel=50.0))[0] == "bfloat16"
    assert dtype_from_times(True, "bf16", times(fp32=60.0, bf16_kernel=59.0))[0] == "float32"  # a tie keeps fp32
    assert dtype_from_times(True, "bf16", times(fp32=60.0, bf16_torch=40.0, bf16_kernel=90.0))[0] == "bfloat16"


def test_no_native_bf16_is_fp32_whatever_the_timing():
    assert dtype_from_times(False, "x86 without avx512_bf16", times(fp32=90, bf16_kernel=10))[0] == "float32"


def test_no_timing_is_the_isa_rule():
    assert dtype_from_times(True, "x86 with avx512_bf16", None)[0] == "bfloat16"
    assert dtype_from_times(False, "avx2 only", None)[0] == "float32"
    assert bf16_decode_from_times(None)[0] == "kernel"
    assert prefill_from_times(True, None)[0] == "fp32"


def test_bf16_decode_and_prefill_follow_the_faster_path():
    assert bf16_decode_from_times(times(bf16_torch=120, bf16_kernel=60))[0] == "kernel"
    assert bf16_decode_from_times(times(bf16_torch=30, bf16_kernel=60))[0] == "torch"
    assert prefill_from_times(True, times(pre_fp32=70, pre_bf16=15)) == ("bf16", prefill_from_times(
        True, times(pre_fp32=70, pre_bf16=15))[1])
    assert prefill_from_times(True, times(pre_fp32=15, pre_bf16=70))[0] == "fp32"
    assert prefill_from_times(False, times(pre_fp32=70, pre_bf16=15))[0] == "fp32"  # no native bf16: never


def test_round_trip_through_the_cache_format():
    t = times()
    back = PathTimes.from_dict(t.to_dict(), cached=True)
    assert back.decode == t.decode and back.prefill == t.prefill and back.cached
    assert "cached timing" in back.describe()


def test_planner_dtype_follows_the_timing_on_an_amx_fixture():
    hw = probe_hardware(FIX / "spr_amx_snc2.json")
    assert plan(hw, env={}).dtype.value == "bfloat16"  # the ISA prior
    p = plan(hw, env={}, path_times=times())
    assert p.dtype.value == "float32" and "timing" in p.dtype.reason
    assert plan(hw, env={}, path_times=times(fp32=90, bf16_kernel=40)).dtype.value == "bfloat16"
    # an explicit dtype is never overruled by a timing
    assert plan(hw, env={"OMNILAB_DTYPE": "bfloat16"}, path_times=times()).dtype.value == "bfloat16"


def test_a_complete_preset_is_not_replanned_by_a_timing():
    hw = probe_hardware(FIX / "vm2_avx2.json")
    as_written = resolve_profile("vm-2core", hardware=hw, env={})
    assert resolve_profile("vm-2core", hardware=hw, env={}, path_times=times()) == as_written
    assert resolve_profile("vm-2core", hardware=hw, env={}, max_model_len=2048) != as_written  # a real re-plan


@pytest.mark.parametrize("bad", ["sometimes", "1"])
def test_bad_timing_mode_is_an_error(bad):
    from omnilab.errors import ConfigError
    from omnilab.tuning.timing import timing_mode
    with pytest.raises(ConfigError, match="OMNILAB_PLAN_TIMING.*accepted: auto, on, off, refresh"):
        timing_mode(bad)
