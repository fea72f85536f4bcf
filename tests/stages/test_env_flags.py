"""omnilab's boolean environment variables go through one parser (omnilab/stages/_env.py: ``env_flag``): a word that
is neither true nor false is a ``ConfigError`` naming the variable and the accepted words, never a silent "off"."""
from __future__ import annotations

import pytest

from omnilab.errors import ConfigError
from omnilab.stages._env import env_flag
from omnilab.stages.vllm.config import VllmStageConfig, compile_predictor_flag, engine_env

ACCEPTED = r"accepted values are 1 / true / yes / on and 0 / false / no / off"


@pytest.mark.parametrize("raw, want", [("1", True), ("Yes", True), (" on ", True), ("TRUE", True), ("0", False),
                                       ("off", False), ("No", False), ("", None), ("  ", None)])
def test_the_accepted_words(raw, want):
    assert env_flag({"OMNILAB_CPU_INDUCTOR": raw}, "OMNILAB_CPU_INDUCTOR") is want
    assert env_flag({}, "OMNILAB_CPU_INDUCTOR") is None


@pytest.mark.parametrize("raw", ["banana", "maybe", "2", "enabled", "y"])
def test_cpu_inductor_refuses_other_words(raw):
    with pytest.raises(ConfigError, match=rf"OMNILAB_CPU_INDUCTOR='{raw}': {ACCEPTED}"):
        compile_predictor_flag(None, {"OMNILAB_CPU_INDUCTOR": raw})


def test_predictor_per_row_is_read_and_checked_by_the_client():
    c = VllmStageConfig()
    with pytest.raises(ConfigError, match=rf"OMNILAB_VLLM_PREDICTOR_PER_ROW='maybe': {ACCEPTED}"):
        engine_env(c, {"OMNILAB_VLLM_PREDICTOR_PER_ROW": "maybe"}, compile_predictor=False)
    on = engine_env(c, {"OMNILAB_VLLM_PREDICTOR_PER_ROW": "yes"}, compile_predictor=False)
    assert on["OMNILAB_VLLM_PREDICTOR_PER_ROW"] == "1"  # what the runner reads in the engine's worker
    assert engine_env(c, {"OMNILAB_VLLM_PREDICTOR_PER_ROW": "off"},
                      compile_predictor=False)["OMNILAB_VLLM_PREDICTOR_PER_ROW"] is None
    assert engine_env(VllmStageConfig(predictor_per_row=True), {},
                      compile_predictor=False)["OMNILAB_VLLM_PREDICTOR_PER_ROW"] == "1"


@pytest.mark.parametrize("var", ["OMNILAB_CPU_INDUCTOR", "OMNILAB_VLLM_PREDICTOR_PER_ROW"])
def test_a_bad_word_is_refused_on_the_eager_backend_too(tiny_ckpt, monkeypatch, var):
    """The eager backend compiles nothing and has no vLLM predictor, but a garbage value is still a ConfigError
    naming it (never silently off), before anything loads."""
    from omnilab.pipeline import Pipeline

    monkeypatch.setenv(var, "banana")
    with pytest.raises(ConfigError, match=f"{var}='banana': accepted values are 1 / true"):
        Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
