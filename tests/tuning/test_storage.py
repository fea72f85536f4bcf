"""Decode-matrix storage of an fp32 talker: the choice and its errors, both loaders, and the model's output."""
from __future__ import annotations

import numpy as np
import pytest

from omnilab.errors import ConfigError
import torch

from omnilab.kernels import gemv
from omnilab.tuning import storage as st


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(st.ENV, raising=False)
    monkeypatch.delenv(gemv.ENV, raising=False)
    gemv.reset()
    yield monkeypatch
    gemv.reset()


def test_choice_rules(env):
    auto = st.weight_storage_choice(torch.float32)
    assert auto.source == "auto"
    if gemv.gemv_choice().mode == "omnilab":
        assert auto.bf16 and auto.label == "bf16 storage, fp32 compute" and "half the bytes" in auto.reason
    bf = st.weight_storage_choice(torch.bfloat16)
    assert not bf.bf16 and "compute dtype is bfloat16" in bf.reason
    comp = st.weight_storage_choice(torch.float32, env="compute")
    assert not comp.bf16 and comp.source == "env" and comp.label == "float32 (compute dtype)"
    env.setenv(gemv.ENV, "torch")
    gemv.reset()
    off = st.weight_storage_choice(torch.float32)
    assert not off.bf16 and "no omnilab GEMV kernel" in off.reason
    with pytest.raises(RuntimeError, match="OMNILAB_DECODE_WEIGHTS=bf16 needs omnilab's GEMV kernel"):
        st.weight_storage_choice(torch.float32, env="bf16")


def test_bad_values_name_the_accepted_ones(env):
    with pytest.raises(ConfigError, match="OMNILAB_DECODE_WEIGHTS='half' .*accepted: auto, bf16, compute"):
        st.weight_storage_choice(torch.float32, env="half")
    with pytest.raises(ConfigError, match="needs a float32 or bfloat16 compute dtype, got float16"):
        st.weight_storage_choice(torch.float16, env="bf16")


def test_only_streamed_bf16_matrices_stay_bf16():
    s = st.WeightStorage(True, "float32", "test", "env")
    assert s.keeps_bf16("model.layers.3.mlp.down_proj.weight", torch.bfloat16)
    assert s.keeps_bf16("code_predictor.lm_head.7.weight", torch.bfloat16)
    assert not s.keeps_bf16("model.layers.3.mlp.down_proj.weight", torch.float32)  # never rounds an fp32 file
    for name in ("model.layers.0.input_layernorm.weight", "model.norm.weight", "text_projection.linear_fc1.weight",
                 "model.codec_embedding.weight", "code_predictor.small_to_mtp_projection.bias"):
        assert not s.keeps_bf16(name, torch.bfloat16), name
    assert not st.WeightStorage(False, "float32", "test", "env").keeps_bf16("codec_head.weight", torch.bfloat16)


@pytest.mark.parametrize("loader", ["load_model", "vllm_worker"])
def test_loaders_keep_the_files_bf16_matrices(tiny_ckpt, env, loader):
    """bf16 storage: every streamed matrix is the file's bf16 tensor, everything else is loaded as before, and
    the values equal the fp32 load exactly (bf16 -> fp32 is exact)."""
    from omnilab.config import Qwen3TTSConfig
    from omnilab.checkpoint.load import load_model
    from omnilab.checkpoint.worker_weights import load_talker_weights

    if gemv.gemv_choice().mode != "omnilab":
        pytest.skip("no GEMV kernel here")
    path = tiny_ckpt()
    cfg = Qwen3TTSConfig.load(path / "config.json")

    def load(mode):
        env.setenv(st.ENV, mode)
        if loader == "load_model":
            return load_model(path, dtype="float32", load_code2wav=False).talker
        return load_talker_weights(path, cfg, torch.float32)

    compact, full = load("bf16"), load("compute")
    assert compact.weight_storage.bf16 and not full.weight_storage.bf16
    assert compact.dtype == full.dtype == torch.float32
    ref = full.state_dict()
    streamed = 0
    for name, t in compact.state_dict().items():
        if st.talker_streamed_name(name):
            streamed += 1
            assert t.dtype == torch.bfloat16 and ref[name].dtype == torch.float32, name
        else:
            assert t.dtype == ref[name].dtype, name
        assert torch.equal(t.float(), ref[name].float()), name
    assert streamed > 10
    nbytes = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters()  # noqa: E731
                           if st.talker_streamed_name(n))
    assert nbytes(compact) * 2 == nbytes(full)


def test_bf16_storage_generates_what_fp32_copies_generate(tiny_ckpt, env):
    """Same prompt, greedy: the codes are identical and the talker's hidden states agree to fp32 rounding."""
    from omnilab.pipeline import Pipeline

    if gemv.gemv_choice().mode != "omnilab":
        pytest.skip("no GEMV kernel here")
    kw = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=12)
    out = {}
    for mode in ("compute", "bf16"):
        env.setenv(st.ENV, mode)
        with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32") as pipe:
            assert pipe.deployment.weights.bf16 == (mode == "bf16")
            rows = dict(pipe.deployment.rows())
            assert rows["decode weights"].startswith(pipe.deployment.weights.label)
            t = pipe.model.talker
            with torch.inference_mode():
                x = torch.randn(1, 7, t.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.1
                hidden = t(x)  # 7 rows: the kernel over bf16 weights, MKL over fp32 copies
            out[mode] = (pipe.generate("Hello there, a short test.", **kw).codes, hidden)
    np.testing.assert_array_equal(out["bf16"][0], out["compute"][0])
    torch.testing.assert_close(out["bf16"][1], out["compute"][1], rtol=1e-4, atol=1e-5)


def test_bad_env_fails_at_load(tiny_ckpt, env):
    from omnilab.pipeline import Pipeline

    env.setenv(st.ENV, "fp16")
    with pytest.raises(ConfigError, match="OMNILAB_DECODE_WEIGHTS='fp16'"):
        Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
