"""OMNILAB_CODE2WAV_DTYPE: the rule on fake hardware, the explicit modes, errors, and the choice reaching the
pipeline (``pipe.deployment`` row, the decoder the stage runs). No speed is measured here."""
from __future__ import annotations

import pytest
import torch

from omnilab.errors import ConfigError
from omnilab.tuning.code2wav_dtype import EMULATED, ENV, MEASURED, MEASURED_NO_AMX, code2wav_dtype_choice

AMX = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


def choice(mode: str = "", flags=AMX, requested="auto", arch: str = "x86_64"):
    return code2wav_dtype_choice(requested, env=mode, flags=flags, arch=arch)


def test_auto_picks_bf16_with_amx_only_quoting_the_measured_figures():
    c = choice(flags=AMX)
    assert (c.dtype, c.native, c.source, c.torch_dtype) == ("bfloat16", True, "auto", torch.bfloat16)
    assert MEASURED in c.reason and "ms/frame" in c.reason  # the figures the rule rests on are quoted
    assert c == choice(flags=AMX, requested=torch.bfloat16)  # a bf16 pipeline: the same
    c = choice(flags=AVX512_BF16)  # native bf16 without AMX measured slower than fp32
    assert (c.dtype, c.native) == ("float32", True) and MEASURED_NO_AMX in c.reason
    assert choice("bfloat16", flags=AVX512_BF16).dtype == "bfloat16"  # still available explicitly


def test_auto_keeps_fp32_without_native_bf16_and_for_an_fp32_pipeline(monkeypatch):
    c = choice(flags=AVX2)
    assert (c.dtype, c.native, c.torch_dtype) == ("float32", False, torch.float32)
    assert "emulated" in c.reason
    for asked in (torch.float32, "fp32", "float32"):  # dtype="float32" asked for fp32 numerics
        c = choice(flags=AMX, requested=asked)
        assert (c.dtype, c.native) == ("float32", True) and "float32" in c.reason and ENV in c.reason
    monkeypatch.setenv("OMNILAB_DTYPE", "float32")  # not asked by argument: the pipeline's variable counts
    assert choice(flags=AMX, requested=None).dtype == "float32"
    monkeypatch.setenv("OMNILAB_DTYPE", "bfloat16")
    assert choice(flags=AMX, requested=None).dtype == "bfloat16"
    assert choice(flags={"asimd", "bf16"}, arch="aarch64").dtype == "float32"  # not measured there
    assert choice("bfloat16", flags={"asimd", "bf16"}, arch="aarch64").native is True


def test_explicit_modes_win_and_emulated_bf16_says_so():
    c = choice("bfloat16", flags=AVX2)
    assert (c.dtype, c.native, c.source) == ("bfloat16", False, "env")
    assert EMULATED in c.reason and "emulated" in c.label
    c = choice(" BFloat16 ", flags=AMX, requested=torch.float32)  # explicit beats the fp32 pipeline rule
    assert (c.dtype, c.native) == ("bfloat16", True) and EMULATED not in c.reason
    c = choice("float32", flags=AMX)
    assert (c.dtype, c.source, c.label) == ("float32", "env", "float32") and ENV in c.reason


def test_unknown_mode_names_the_variable_value_and_accepted(monkeypatch):
    with pytest.raises(ConfigError, match=r"OMNILAB_CODE2WAV_DTYPE='fp16'.*auto, float32, bfloat16"):
        choice("fp16")
    monkeypatch.setenv(ENV, "bf16")  # read from the environment when env= is not given
    with pytest.raises(ConfigError, match="'bf16'"):
        code2wav_dtype_choice(flags=AMX)
    monkeypatch.setenv(ENV, "float32")
    assert code2wav_dtype_choice(flags=AMX).source == "env"


@pytest.mark.parametrize("mode,dtype", [("bfloat16", torch.bfloat16), ("", torch.float32)])
def test_choice_reaches_the_eager_pipeline(tiny_ckpt, monkeypatch, mode, dtype):
    """``dtype="float32"`` under auto keeps fp32 on every CPU; an explicit bfloat16 runs everywhere (emulated where
    the CPU lacks bf16), and ``pipe.deployment`` shows the row."""
    from omnilab.pipeline import Pipeline

    monkeypatch.setenv(ENV, mode)
    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32",
                                    deploy_profile=None)
    try:
        assert pipe.model.code2wav.compute_dtype == dtype
        assert pipe.code2wav.info()["code2wav_dtype"] == str(dtype).removeprefix("torch.")
        rows = dict(pipe.deployment.rows())
        assert rows["code2wav dtype"].startswith(pipe.deployment.code2wav_dtype.label)
        audio = pipe.code2wav.decode(torch.randint(0, 2048, (3, 16)))
        assert audio.dtype.name == "float32" and audio.shape == (3 * 1920,)
    finally:
        pipe.close()


def test_bad_value_fails_at_load_and_the_cli_prints_the_choice(tiny_ckpt, monkeypatch):
    import subprocess
    import sys

    from omnilab.pipeline import Pipeline

    monkeypatch.setenv(ENV, "half")
    with pytest.raises(ConfigError, match="OMNILAB_CODE2WAV_DTYPE='half'"):
        Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32", deploy_profile=None)
    monkeypatch.setenv(ENV, "float32")
    out = subprocess.run([sys.executable, "-m", "omnilab.kernels"], capture_output=True, text=True, check=True).stdout
    assert "code2wav dtype for dtype='auto': float32 (env)" in out and f"{ENV}=float32" in out


def test_auto_follows_this_machines_timing_where_bf16_is_native():
    """The timing decides where bf16 is native (the AMX prior and the avx512_bf16 prior were each wrong somewhere:
    a Zen 5 core runs the bf16 GEMMs x2 faster without AMX); only a clear gain gives up fp32's exact numerics."""
    from omnilab.profiles.timing import C2W_MARGIN, code2wav_dtype_rule

    fast = {"float32": 40.0, "bfloat16": 20.0, "threads": 2, "frames": 10}
    tie = {"float32": 40.0, "bfloat16": 40.0 * C2W_MARGIN + 1, "threads": 2, "frames": 10}
    dtype, native, why = code2wav_dtype_rule("auto", AVX512_BF16, "x86_64", "", fast)
    assert (dtype, native) == ("bfloat16", True) and "bf16 20.0 vs fp32 40.0 ms/frame" in why
    assert code2wav_dtype_rule("auto", AMX, "x86_64", "", tie)[0] == "float32"  # not clearly faster: fp32
    assert code2wav_dtype_rule("auto", AVX512_BF16, "x86_64", "", None)[0] == "float32"  # timing off: the prior
    assert code2wav_dtype_rule("auto", AMX, "x86_64", "float32", fast)[0] == "float32"  # fp32 asked
    assert code2wav_dtype_rule("float32", AMX, "x86_64", "", fast)[0] == "float32"  # the variable wins


def test_the_timing_is_measured_once_and_cached(tmp_path, monkeypatch):
    from omnilab.hardware import cpu_has_native_bf16
    from omnilab.tuning import code2wav_timing

    if not cpu_has_native_bf16()[0]:
        pytest.skip("the code2wav timing runs where bf16 is native (elsewhere bf16 is emulated: the rule says fp32)")
    monkeypatch.setenv("OMNILAB_CACHE", str(tmp_path))
    monkeypatch.setattr(code2wav_timing, "_MEMO", {})
    monkeypatch.setenv("OMNILAB_PLAN_TIMING", "off")
    assert code2wav_timing.code2wav_times() is None
    monkeypatch.setenv("OMNILAB_PLAN_TIMING", "auto")
    got = code2wav_timing.code2wav_times(threads=1)
    assert got["float32"] > 0 and got["bfloat16"] > 0 and got["threads"] == 1 and got["frames"] > 0
    files = list((tmp_path / "timing").glob("code2wav-*.json"))
    assert len(files) == (1 if got.get("wait_share", 0) <= 0.10 else 0)  # a noisy timing is not cached
    monkeypatch.setattr(code2wav_timing, "_MEMO", {})
    monkeypatch.setattr(code2wav_timing, "measure", lambda *a, **k: pytest.fail("measured again"))
    if files:
        again = code2wav_timing.code2wav_times(threads=1)
        assert again["cached"] and again["float32"] == pytest.approx(got["float32"])
