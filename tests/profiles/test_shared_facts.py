"""One copy of each fact the planner, the models and the vLLM engine share, each with the test that would have
caught its copies disagreeing: per-token KV bytes (the planner counted the unpadded head size, the engine the
head size vLLM's CPU attention pads it to), the KV block size, and the released talker geometry the cost model
assumes. The chunk rule's test is in tests/models/test_code2wav_stream.py; the tiny geometry's in
tests/checkpoint/test_random.py."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from omnilab.checkpoint.configs import CHECKPOINT_SIZES, config_json, speech_tokenizer_config_dict
from omnilab.config import Qwen3TTSConfig, SpeechTokenizerConfig
from omnilab.hardware import probe_hardware
from omnilab.profiles import ModelGeometry, plan
from omnilab.profiles.cost import BLOCK_SIZE, SUPPORTED_HEAD_SIZES, padded_head_size
from omnilab.stages.vllm import config as vllm_config

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"


def _config(size: str) -> Qwen3TTSConfig:
    return Qwen3TTSConfig.from_dict(json.loads(config_json(size, "custom_voice")))


@pytest.mark.parametrize("size", CHECKPOINT_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_kv_bytes_per_token_equal_what_the_engine_sizes(size, dtype):
    cfg = _config(size)
    engine = vllm_config.kv_bytes_per_token(cfg, dtype)  # what VllmTalkerStage sizes its cache with
    planner = ModelGeometry.from_config(cfg).kv_bytes_per_token(dtype.itemsize)  # what memory.kv_budget uses
    assert planner == engine
    t = cfg.talker  # vLLM's attention layer runs at the padded head size (stages/vllm/model.py)
    assert engine == t.num_hidden_layers * 2 * t.num_key_value_heads * padded_head_size(t.head_dim) * dtype.itemsize
    name = "float32" if dtype == torch.float32 else "bfloat16"
    p = plan(probe_hardware(FIX / "xeon_2s_avx512_smt.json"), cfg, env={}, overrides={"dtype": name})
    assert f"x {engine} B/token" in p.kv_cache_bytes.reason  # the planned budget is counted in the same bytes


def test_head_sizes_pad_to_the_next_supported_one():
    assert [padded_head_size(d) for d in (8, 16, 32, 33, 128, 500)] == [32, 32, 32, 64, 128, 512]
    assert list(SUPPORTED_HEAD_SIZES) == sorted(SUPPORTED_HEAD_SIZES)
    assert vllm_config.padded_head_size is padded_head_size  # the engine's model layer uses this function
    with pytest.raises(ValueError, match="head_dim 513 is larger than vLLM's CPU attention supports"):
        padded_head_size(513)


def test_one_kv_block_size():
    p = plan(probe_hardware(FIX / "vm2_avx2.json"), env={})
    assert vllm_config.VllmStageConfig().block_size == BLOCK_SIZE == p.engine_args("talker")["block_size"]


@pytest.mark.parametrize("size, released", [("0.6b", "0b6"), ("1.7b", "1b7")])
def test_released_cost_geometry_is_the_checkpoint_geometry(size, released):
    """``ModelGeometry.released`` (plain Python, no checkpoint import) states the released widths again; it must
    equal the geometry read from the released-layout config files."""
    decoder = SpeechTokenizerConfig.from_dict(speech_tokenizer_config_dict(size)).decoder
    got = ModelGeometry.from_config(_config(size), decoder)
    assert dataclasses.replace(got, name="") == dataclasses.replace(ModelGeometry.released(released), name="")


def test_a_reduced_test_geometry_is_not_named_after_the_released_size(tiny_ckpt):
    """The tiny checkpoint keeps tts_model_size "0b6" (it sets the variant's behaviour), but the profile's geometry
    name says it is a reduced geometry, so a plan never reads as the 0.6B model; the 0.6B geometry keeps its name."""
    from omnilab.checkpoint.load import read_configs
    from omnilab.profiles.cost import ModelGeometry

    cfg, speech = read_configs(tiny_ckpt("custom_voice"))
    g = ModelGeometry.from_config(cfg, speech.decoder)
    assert g.name.startswith("custom_voice, reduced geometry (") and "0b6" not in g.name
    assert ModelGeometry.released("0b6").name == "Qwen3-TTS 0.6B (released geometry)"
