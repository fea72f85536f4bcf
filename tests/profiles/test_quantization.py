"""The deploy profile's ``quantization`` field: planned, overridden, carried by the YAML and the worker environment,
and what the pipeline loads (the profile says what runs)."""
from __future__ import annotations

from pathlib import Path

import pytest

from omnilab.config import parse_quantization
from omnilab.errors import ConfigError
from omnilab.hardware import probe_hardware
from omnilab.profiles import DeployProfile, ModelGeometry, plan

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"
HW = FIX / "vm2_avx2.json"
TINY_K = ModelGeometry("tiny widths", talker_hidden=64, talker_intermediate=128, talker_heads=4, talker_head_dim=16,
                       predictor_hidden=64, predictor_intermediate=128, predictor_heads=4, predictor_head_dim=16)


def q(value, env=None, geo=None):
    return plan(probe_hardware(HW), geo, overrides={"quantization": value}, env=env or {}).quantization


def test_auto_is_none_and_says_why():
    r = plan(probe_hardware(HW), env={}).quantization
    assert (r.value, r.source) == ("none", "auto") and "opt-in" in r.reason


@pytest.mark.parametrize("given, value", [("int8", "int8"), ("int4", "int4-g128"), ("int4-g32", "int4-g32"),
                                          ("INT4/64", "int4-g64"), ("none", "none"), (None, "none")])
def test_spellings_resolve_to_one_value(given, value):
    assert q(given).value == value


def test_int4_group_follows_the_decode_widths():
    r = q("int4", geo=TINY_K)  # K = 64 and 128: the default 128 does not divide 64
    assert r.value == "int4-g64" and "largest accepted" in r.reason
    with pytest.raises(ConfigError, match=r"group 128 does not divide.*accepted here: int4-g32, int4-g64"):
        q("int4-g128", geo=TINY_K)


@pytest.mark.parametrize("bad", ["int5", "int8-g32", "int4-g48", "yes", True])
def test_bad_values_name_the_accepted_ones(bad):
    with pytest.raises(ConfigError, match="accepted"):
        q(bad)


def test_the_variable_wins_over_the_argument():
    r = q("int8", env={"OMNILAB_QUANTIZATION": "int4-g64"})
    assert r.value == "int4-g64" and r.source == "env OMNILAB_QUANTIZATION"


def test_the_estimate_reads_fewer_bytes_when_quantized():
    """At the same threads int4-all's byte-bound part is (0.5 + 2/128) / 2 of bf16 storage's; the per-frame fixed
    part (sampling, heads, Python) stays, so the whole step is under 0.4x. The int4 recipe keeps the predictor
    (most of the bytes) at int8: between int4-all and int8."""
    fix = {"talker_threads": 2, "mode": "shared"}
    ms = {q: plan(probe_hardware(HW), overrides={"quantization": q, **fix}, env={}).estimate.talker_ms_per_frame
          for q in ("none", "int8", "int4", "int4-all")}
    assert ms["int4-all"] < 0.4 * ms["none"]
    assert ms["int4-all"] < ms["int4"] < ms["int8"] < 0.6 * ms["none"]


def test_yaml_round_trip_and_the_worker_environment():
    p = plan(probe_hardware(HW), overrides={"quantization": "int4-g64"}, env={})
    text = p.to_yaml()
    assert "OMNILAB_QUANTIZATION: int4-g64" in text
    assert DeployProfile.from_yaml(text) == p
    assert p.to_env("talker")["OMNILAB_QUANTIZATION"] == "int4-g64" and "OMNILAB_QUANTIZATION" not in p.to_env(
        "code2wav")
    none = plan(probe_hardware(HW), env={})
    assert DeployProfile.from_yaml(none.to_yaml()) == none and "OMNILAB_QUANTIZATION" not in none.to_env("talker")


def test_cli_plan_takes_quantization(capsys):
    from omnilab.cli.profile import plan_main
    assert plan_main(["--root", str(HW), "--quantization", "int8", "--json"]) == 0
    assert '"value": "int8"' in capsys.readouterr().out
    assert plan_main(["--root", str(HW), "--quantization", "int3"]) == 2
    assert "not a quantization" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["eager"])
def test_the_pipeline_loads_what_the_profile_says(tiny_ckpt, backend, monkeypatch):
    from tests.conftest import clear_override_env
    from omnilab.pipeline import Pipeline

    clear_override_env(monkeypatch)
    with Pipeline.from_pretrained(tiny_ckpt(), backend=backend, quantization="int4") as pipe:
        method, group = parse_quantization(pipe.profile.quantization.value, "profile")
        loaded = pipe.deployment.quantization.choice
        assert (loaded.method, loaded.group_size) == (method, group) == ("int4", 64)  # tiny K = 64, 128
    with Pipeline.from_pretrained(tiny_ckpt(), backend=backend, deploy_profile=None, quantization="int8") as pipe:
        assert pipe.profile is None and pipe.deployment.quantization.choice.method == "int8"
    with pytest.raises(ConfigError, match="quant_group_size"):
        Pipeline.from_pretrained(tiny_ckpt(), backend=backend, quantization="int8", quant_group_size=64)


def test_a_pack_quantized_checkpoint_is_what_the_profile_says(tiny_ckpt, tmp_path, monkeypatch):
    from tests.conftest import clear_override_env
    from omnilab.checkpoint.write_quantized import quantize_checkpoint
    from omnilab.pipeline import Pipeline

    clear_override_env(monkeypatch)
    dst = quantize_checkpoint(tiny_ckpt(), tmp_path / "int4", "int4", 32, progress=False)
    with Pipeline.from_pretrained(dst, backend="eager") as pipe:
        field = pipe.profile.quantization
        assert (field.value, field.source) == ("int4-g32", "checkpoint") and "pack-quantized" in field.reason
        loaded = pipe.deployment.quantization.choice
        assert (loaded.method, loaded.group_size, loaded.source) == ("int4", 32, "checkpoint")
