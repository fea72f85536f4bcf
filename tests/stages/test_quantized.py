"""``quantization=`` end to end (quantized at load, in memory): the decode matrices become ``QuantizedWeight``s
of the chosen method and group (everything else as loaded without it), eager runs, greedy codes of the vLLM
backend equal eager's under int8 and int4 (same loader, same values, same kernels, same threads: equal by
construction), a row's codes do not depend on its batch mates, bad values name the accepted ones and
``OMNILAB_QUANTIZATION`` wins over the argument. The unquantized default path is covered by test_eager.py,
test_vllm_talker.py, tests/test_pipeline.py and tests/checkpoint."""
from __future__ import annotations

import pytest

from _deps import need  # noqa: E402
import torch

from omnilab.checkpoint.load import load_model
from omnilab.checkpoint.tensor_index import TensorIndex, weight_files
from omnilab.errors import ConfigError
from omnilab.kernels.quant import AUTO_ACTIVATIONS, QuantizedWeight, quantization_choice, quantize
from omnilab.requests import UserRequest, build_request
from omnilab.sampling import SamplingParams
from omnilab.stages.eager import EagerTalkerStage, run_to_completion
from omnilab.tuning.storage import talker_streamed_name

TEXT = "Hello world, this is a test."
KW = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=6)


def _ks(path) -> list[int]:
    index = TensorIndex(weight_files(path, "model"))
    return [index.shape(k)[1] for k in index.where if k.startswith("talker.") and talker_streamed_name(k[7:])]


def _load(path, method, group=None, **kw):
    return load_model(path, dtype="float32", quantization=quantization_choice(method, group, env="", act_env="",
                                                                              ks=_ks(path)), **kw)


def _greedy(model, n: int = 4) -> SamplingParams:
    return SamplingParams.from_defaults(model.generation, do_sample=False, subtalker_do_sample=False, max_new_tokens=n)


def _eager(model, preqs: dict, n: int = 4) -> dict:
    stage = EagerTalkerStage(model)
    for rid, preq in preqs.items():
        stage.add_request(rid, preq, _greedy(model, n))
    return {rid: out["codes"] for rid, out in run_to_completion(stage.engine).items()}


def _requests(model) -> dict:
    reqs = {"a": UserRequest(text=TEXT, speaker="vivian", language="english"),
            "b": UserRequest(text="Second one here.", speaker="eric", non_streaming_mode=False)}
    return {rid: build_request(model, r)[0] for rid, r in reqs.items()}


@pytest.mark.parametrize("method", ["int8", "int4-all"])  # one format everywhere (int4's parts: checkpoint tests)
def test_decode_matrices_quantized_at_load_and_nothing_else(tiny_ckpt, method):
    path = tiny_ckpt("custom_voice")
    plain = load_model(path, dtype="float32").talker
    q = _load(path, method)
    talker = q.talker
    group = q.quantization.group_size
    fmt = method[:4]  # the format of every part: int8 / int4
    assert q.quantization.method == method and (group == 64 if fmt == "int4" else group is None)  # tiny K: 64
    ref_state = plain.state_dict()
    state = talker.state_dict()
    quantized = {k for k in ref_state if talker_streamed_name(k)}
    assert quantized and set(state) == set(ref_state) - quantized  # the quantized parameters left the state dict
    for k, t in state.items():  # embeddings, norms, biases: exactly as loaded without quantization
        assert t.dtype == ref_state[k].dtype and torch.equal(t, ref_state[k]), k
    for k in quantized:
        owner, _, attr = k.rpartition(".")
        qw = getattr(talker.get_submodule(owner), attr)
        assert isinstance(qw, QuantizedWeight) and qw.method == fmt and qw.shape == tuple(ref_state[k].shape)
        assert qw.group_size == (group if fmt == "int4" else qw.shape[1])
        assert qw.activations == AUTO_ACTIVATIONS[fmt] == {"int8": "int16", "int4": "int8"}[fmt]
    # from the file's values: the plain fp32 talker holds them exactly (bf16 -> fp32 is exact)
    k = "code_predictor.lm_head.3.weight"
    qw = talker.code_predictor.lm_head[3].weight
    assert torch.equal(qw.codes(), quantize(ref_state[k].float(), fmt, group, q.quantization.int4_scales).codes())


def test_quantized_eager_pipeline_runs_and_shows_the_row(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32",
                                  quantization="int4") as pipe:
        res = pipe.generate(TEXT, **KW)
        assert res.codes.shape[1] == 16 and 0 < res.codes.shape[0] <= 6 and res.audio.size > 0
        assert isinstance(pipe.model.talker.codec_head.weight, QuantizedWeight)
        row = pipe.deployment.quantization
        assert row.choice.method == "int4" and row.choice.group_size == 64 and row.kernel
        # int4 talker + int8 predictor: on tiny the 15 predictor heads (2048 x 64) are most of the decode bytes and
        # int8 codes are half of bf16's, so about half; int4-all's codes would be a quarter
        assert 0 < row.after_bytes < 0.55 * row.before_bytes
        text = dict(pipe.deployment.rows())["quantization"]
        assert "int4" in text and "group 64" in text and "int8 activations" in text and "MiB" in text


def test_row_codes_do_not_depend_on_batch_mates_int4(tiny_ckpt):
    model = _load(tiny_ckpt("custom_voice"), "int4")
    preqs = _requests(model)
    together = _eager(model, preqs)
    for rid, preq in preqs.items():
        assert torch.equal(_eager(model, {rid: preq})[rid], together[rid]), f"{rid} differs when batched"


@pytest.mark.vllm
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_vllm_greedy_codes_equal_eager(tiny_ckpt, method):
    """One in-process engine per method: int8 shares the client's quantized talker; int4 has the engine load its
    own (the worker path: the choice travels in the view config and the strict loader quantizes it again)."""
    need("vllm")
    from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage

    path = tiny_ckpt("custom_voice")
    model = _load(path, method)
    preqs = _requests(model)
    ref = {rid: _eager(model, {rid: p})[rid] for rid, p in preqs.items()}
    client = model if method == "int8" else _load(path, method, load_talker=False)
    stage = VllmTalkerStage(client, VllmStageConfig(max_model_len=256, block_size=32))
    try:
        talker = stage.runner.talker
        assert (talker is model.talker) == (method == "int8")
        assert isinstance(talker.codec_head.weight, QuantizedWeight) and talker.codec_head.weight.method == method
        assert stage.summary()["quantization"] == model.quantization.label
        for rid, preq in preqs.items():
            stage.add_request(rid, preq, _greedy(model))
            frames = []
            while stage.has_unfinished():
                frames += [o.codes for o in stage.step() if o.request_id == rid and o.codes is not None]
            assert torch.equal(torch.stack(frames), ref[rid]), f"{method} {rid}: vLLM codes differ from eager"
    finally:
        stage.close()


def test_bad_values_name_the_accepted_ones(tiny_ckpt, monkeypatch):
    from omnilab.pipeline import Pipeline

    monkeypatch.delenv("OMNILAB_QUANTIZATION", raising=False)
    with pytest.raises(ConfigError, match=r"'int3'.*accepted: 'none', 'int8', 'int4', 'int4-all'.*'int4-g32'"):
        Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", quantization="int3")
    with pytest.raises(ConfigError, match=r"quant_group_size=48; accepted: 32, 64, 128"):
        quantization_choice("int4", 48, env="", ks=[64, 128])
    with pytest.raises(ConfigError, match=r"quant_group_size=128 does not divide.*accepted here: 32, 64"):
        quantization_choice("int4", 128, env="", ks=[64, 128])
    with pytest.raises(ConfigError, match="applies to int4 only"):
        quantization_choice("int8", 64, env="")
    with pytest.raises(ConfigError, match=r"OMNILAB_QUANTIZATION='fp8'.*accepted"):
        quantization_choice("int8", env="fp8")
    with pytest.raises(ConfigError, match=r"OMNILAB_QUANT_ACTIVATIONS='int4'; accepted: auto, int8, int16, fp32"):
        quantization_choice("int8", env="", act_env="int4")
    q = quantization_choice("int4", env="", act_env="", ks=[1024, 3072])
    assert q.group_size == 128 and "default" in q.reason and "int8 activations" in q.reason
    assert quantization_choice(None, env="").enabled is False
    assert quantization_choice("none", env="").method == "none"


def test_env_wins_over_the_argument(tiny_ckpt, monkeypatch):
    from omnilab.pipeline import Pipeline

    monkeypatch.setenv("OMNILAB_QUANTIZATION", "int8")
    with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32",
                                  quantization="int4") as pipe:
        q = pipe.deployment.quantization.choice
        assert (q.method, q.source) == ("int8", "env") and "OMNILAB_QUANTIZATION=int8" in q.reason
        assert pipe.model.talker.model.layers[0].mlp.down_proj.weight.method == "int8"
    monkeypatch.setenv("OMNILAB_QUANTIZATION", "none")
    assert quantization_choice("int4").enabled is False
