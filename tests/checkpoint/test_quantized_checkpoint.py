"""Quantized checkpoints on disk (omnilab/checkpoint/quantized.py, write_quantized.py; docs/quantization.md):
compressed-tensors pack-quantized packing, the written directory, loading it equals quantizing at load (the same
QuantizedWeight and the same greedy codes on eager and vLLM), a checkpoint packed elsewhere (-8 codes, bf16 scales)
and every refused format. (Named ..._checkpoint: tests/stages/test_quantized.py owns the basename.)

Equality here is by construction, not by CPU: the file stores the codes and fp32 scales of ``kernels.quant.quantize``
on the file's own values, and the loader repacks them with ``from_codes`` (integer and copy operations only), so
the kernel layout is bitwise the at-load one and every later operation runs on identical operands."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _deps import need  # noqa: E402
import torch
from safetensors import safe_open

from omnilab.checkpoint.load import load_model
from omnilab.checkpoint.quantized import (PackedGroup, PackedScheme, pack_int32, parse_scheme, quantization_config,
                                          quantization_for, unpack_int32)
from omnilab.checkpoint.random import write_safetensors
from omnilab.checkpoint.write_quantized import quantize_checkpoint
from omnilab.errors import CheckpointError, ConfigError, InputError
from omnilab.kernels.quant import QuantizedWeight

KW = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=5)
TEXT = "Hello world, this is a test."


@pytest.fixture(scope="module")
def ckpts(tiny_ckpt, tmp_path_factory):
    """{"src", "int8", "int4", "int4-all"}: the tiny CustomVoice checkpoint and its quantized copies (int4 parts: group
    64, the largest accepted size dividing the tiny K = 64 / 128; "int4": int4 talker, int8 predictor)."""
    src = tiny_ckpt("custom_voice")
    root = tmp_path_factory.mktemp("quantized")
    return {"src": src, **{m: quantize_checkpoint(src, root / m, m, progress=False) for m in ("int8", "int4", "int4-all")}}


@pytest.fixture(scope="module")
def loaded(ckpts):
    """``loaded(kind, method)``: kind "file" loads the quantized copy, "at_load" the source with quantization=method
    (fp32, no encoders; cached for the module)."""
    cache = {}

    def get(kind: str, method: str):
        if (kind, method) not in cache:
            cache[kind, method] = (load_model(ckpts[method], dtype="float32", load_encoders=False) if kind == "file"
                                   else load_model(ckpts["src"], dtype="float32", load_encoders=False,
                                                   quantization=quantization_for(ckpts["src"], method)[0]))
        return cache[kind, method]

    return get


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _variant(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """A copy of ``src`` (big files linked) whose config.json quantization_config goes through ``config(qc)``
    and whose model.safetensors tensors go through ``tensors(dict)``."""
    for p in src.rglob("*"):
        if p.is_file():
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.symlink_to(p)
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        config(cfg["quantization_config"])
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = _tensors(src)
        tensors(t)
        (dst / "model.safetensors").unlink()
        write_safetensors(dst / "model.safetensors", t.items())
    return dst


def _reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' documented recipe, in integer arithmetic: unsigned = code + 2^(bits-1), pad K with 0,
    word = sum_j unsigned[j] << (bits * j), taken as two's-complement int32."""
    per = 32 // bits
    u = codes.long() + (1 << (bits - 1))
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % per))
    words = sum(u[:, j::per] << (bits * j) for j in range(per))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _quantized_weights(talker) -> dict[str, QuantizedWeight]:
    return {n: m.__dict__["weight"] for n, m in talker.named_modules()
            if isinstance(m.__dict__.get("weight"), QuantizedWeight)}


# ---- packing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,lo,hi", [(4, -8, 7), (8, -128, 127)])
@pytest.mark.parametrize("k", [64, 37, 3])
def test_pack_matches_the_documented_recipe_and_round_trips(bits, lo, hi, k):
    codes = torch.randint(lo, hi + 1, (7, k), generator=torch.Generator().manual_seed(k)).to(torch.int8)
    codes[0, :2] = torch.tensor([lo, hi], dtype=torch.int8)  # both ends of the range
    packed = pack_int32(codes, bits)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (7, -(-k * bits // 32))
    assert torch.equal(packed, _reference_pack(codes, bits))
    assert torch.equal(unpack_int32(packed, bits, k), codes)


def test_packing_and_config_agree_with_compressed_tensors():
    """Where vLLM's compressed-tensors package is installed: its pack/unpack give the same words, and its config
    model (which forbids unknown fields) and vLLM's CompressedTensorsConfig read the written config."""
    helpers = need("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.quantization import QuantizationConfig

    for bits, lo, hi in ((4, -8, 7), (8, -128, 127)):
        codes = torch.randint(lo, hi + 1, (5, 37), generator=torch.Generator().manual_seed(bits)).to(torch.int8)
        assert torch.equal(helpers.pack_to_int32(codes, bits), pack_int32(codes, bits))
        assert torch.equal(helpers.unpack_from_int32(pack_int32(codes, bits), bits, torch.Size([5, 37])), codes)
    for method, group, want in (("int8", None, "channel"), ("int4", 64, "group")):
        qc = QuantizationConfig.model_validate(quantization_config(method, group, ["talker.text_projection.linear_fc1"]))
        w = qc.config_groups["group_0"].weights
        assert (qc.format, w.num_bits, w.strategy, w.group_size, w.symmetric) == (
            "pack-quantized", 8 if method == "int8" else 4, want, group, True)


# ---- the written directory -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "int4-all"])
def test_written_checkpoint_layout(ckpts, method):
    src, dst = ckpts["src"], ckpts[method]
    files = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
    assert files == {p.relative_to(dst) for p in dst.rglob("*") if p.is_file()}
    for f in files - {Path("config.json"), Path("model.safetensors")}:  # speech_tokenizer/ and the rest unchanged
        assert (src / f).read_bytes() == (dst / f).read_bytes(), f
    cfg, src_cfg = json.loads((dst / "config.json").read_text()), json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg
    w = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"], qc["config_groups"]["group_0"]["targets"]) == (
        "compressed-tensors", "pack-quantized", ["Linear"])
    assert qc["config_groups"]["group_0"]["input_activations"] is None and w["symmetric"] is True
    assert (w["num_bits"], w["strategy"], w["group_size"]) == ((8, "channel", None) if method == "int8" else
                                                               (4, "group", 64))
    assert qc["ignore"] == ["talker.text_projection.linear_fc1", "talker.text_projection.linear_fc2"]
    before, after = _tensors(src), _tensors(dst)
    decode = {k for k in before if k.startswith("talker.") and k.endswith("weight") and k[:-7] + ".weight_packed" in after}
    assert len(decode) == 44 and not decode & set(after)  # the tiny talker's 44 decode matrices, no dense copy left
    for k in decode:
        n, kk = before[k].shape
        m, bits = k[:-len(".weight")], (8 if method == "int8" else 4)
        assert after[f"{m}.weight_packed"].dtype == torch.int32
        assert tuple(after[f"{m}.weight_packed"].shape) == (n, kk * bits // 32)
        # exactly the at-load scales, in their in-memory dtype: fp32 per int8 channel, fp16 per int4 group
        assert after[f"{m}.weight_scale"].dtype == (torch.float32 if bits == 8 else torch.float16)
        assert tuple(after[f"{m}.weight_scale"].shape) == ((n, 1) if method == "int8" else (n, kk // 64))
        assert after[f"{m}.weight_shape"].dtype == torch.int64 and after[f"{m}.weight_shape"].tolist() == [n, kk]
    for k in set(before) - decode:  # embeddings, norms, text projection: bytes as stored
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k


def test_compressed_tensors_decompresses_our_file_to_codes_times_scales(ckpts, loaded):
    """compressed-tensors' own decompressor (if installed) on the int4 file gives codes * scale, the matrix our
    QuantizedWeight.dequantize() gives: the product of the same operands per element on both sides, exact in our
    fp32, rounded once to the decompressor's dtype (the scales' fp16) on its side."""
    need("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = QuantizationConfig.model_validate(json.loads((ckpts["int4-all"] / "config.json").read_text())
                                               ["quantization_config"]).config_groups["group_0"]
    t = _tensors(ckpts["int4-all"])
    qw = _quantized_weights(loaded("file", "int4-all").talker)
    for name in ("codec_head", "model.layers.1.mlp.down_proj", "code_predictor.lm_head.7"):
        m = f"talker.{name}"
        dense = PackedQuantizationCompressor.decompress({p: t[f"{m}.{p}"] for p in
                                                        ("weight_packed", "weight_scale", "weight_shape")}, scheme)
        assert dense["weight"].dtype == t[f"{m}.weight_scale"].dtype == torch.float16, name
        assert torch.equal(dense["weight"], qw[name].dequantize().half()), name


def test_refuses_to_overwrite_and_to_requantize(ckpts, tmp_path):
    with pytest.raises(CheckpointError, match=r"already exists and is not empty; pass overwrite=True \(--overwrite\)"):
        quantize_checkpoint(ckpts["src"], ckpts["int8"], "int8", progress=False)
    with pytest.raises(ConfigError, match="already quantized.*never re-quantized"):
        quantize_checkpoint(ckpts["int8"], tmp_path / "again", "int4", progress=False)
    with pytest.raises(ConfigError, match=r"method 'int3'.*accepted: int8, int4"):
        quantize_checkpoint(ckpts["src"], tmp_path / "x", "int3", progress=False)
    with pytest.raises(ConfigError, match=r"quant_group_size=48; accepted: 32, 64, 128"):
        quantize_checkpoint(ckpts["src"], tmp_path / "x", "int4", 48, progress=False)
    with pytest.raises(ConfigError, match=r"quant_group_size=128 does not divide.*accepted here: 32, 64"):
        quantize_checkpoint(ckpts["src"], tmp_path / "x", "int4", 128, progress=False)
    with pytest.raises(InputError, match="overlap"):
        quantize_checkpoint(ckpts["src"], ckpts["src"] / "inside", "int8", progress=False)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))  # nothing half-written


# ---- loading ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "int4", "int4-all"])
def test_loading_gives_the_quantize_at_load_weights(loaded, method):
    packed, at_load = loaded("file", method), loaded("at_load", method)
    q = packed.quantization
    assert q is packed.talker.quantization and (q.method, q.source) == (method, "checkpoint")
    assert "pack-quantized" in q.reason and "quantization_config" in q.reason
    assert q.key() == at_load.quantization.key()  # same method, group and activations
    a, b = _quantized_weights(packed.talker), _quantized_weights(at_load.talker)
    assert len(a) == 44 and a.keys() == b.keys()
    for name in a:
        assert (a[name].method, a[name].group_size, a[name].shape, a[name].activations) == (
            b[name].method, b[name].group_size, b[name].shape, b[name].activations)
        assert torch.equal(a[name].qweight, b[name].qweight) and torch.equal(a[name].scales, b[name].scales), name
    sa, sb = packed.talker.state_dict(), at_load.talker.state_dict()
    assert sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def test_eager_pipeline_from_the_file_equals_quantizing_at_load(ckpts, monkeypatch):
    """int4 end to end through from_pretrained (int8's weights are shown equal above: its codes are equal by the
    same construction)."""
    from omnilab.pipeline import Pipeline

    method = "int4"
    monkeypatch.delenv("OMNILAB_QUANTIZATION", raising=False)
    with Pipeline.from_pretrained(ckpts[method], backend="eager", dtype="float32") as pipe:
        codes = pipe.generate(TEXT, **KW).codes
        row = pipe.deployment.quantization
        assert row.choice.source == "checkpoint" and 0 < row.after_bytes < row.before_bytes
        assert "pack-quantized" in dict(pipe.deployment.rows())["quantization"]
    with Pipeline.from_pretrained(ckpts["src"], backend="eager", dtype="float32", quantization=method) as pipe:
        ref = pipe.generate(TEXT, **KW).codes
        assert pipe.deployment.quantization.after_bytes == row.after_bytes
    assert codes.shape[0] > 0 and np.array_equal(codes, ref)


@pytest.mark.vllm
def test_vllm_engine_loading_the_file_equals_eager_quantizing_at_load(ckpts, loaded):
    """The engine loads the int4 file itself (client without a talker: the talker-worker path, the choice travelling
    as Quantization.key()); its greedy codes equal eager's on the source quantized at load."""
    need("vllm")
    from omnilab.requests import UserRequest, build_request
    from omnilab.sampling import SamplingParams
    from omnilab.stages.eager import EagerTalkerStage, run_to_completion
    from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage

    ref_model = loaded("at_load", "int4-all")
    preq = build_request(ref_model, UserRequest(text=TEXT, speaker="vivian", language="english"))[0]
    params = SamplingParams.from_defaults(ref_model.generation, do_sample=False, subtalker_do_sample=False,
                                          max_new_tokens=4)
    eager = EagerTalkerStage(ref_model)
    eager.add_request("r", preq, params)
    ref = run_to_completion(eager.engine)["r"]["codes"]
    client = load_model(ckpts["int4-all"], dtype="float32", load_talker=False,
                        quantization=quantization_for(ckpts["int4-all"])[0])
    stage = VllmTalkerStage(client, VllmStageConfig(max_model_len=256, block_size=32))
    try:
        talker = stage.runner.talker
        assert isinstance(talker.codec_head.weight, QuantizedWeight) and talker.quantization.method == "int4-all"
        stage.add_request("r", preq, params)
        frames = []
        while stage.has_unfinished():
            frames += [o.codes for o in stage.step() if o.request_id == "r" and o.codes is not None]
        assert torch.equal(torch.stack(frames), ref)
    finally:
        stage.close()


def test_checkpoint_packed_elsewhere_with_minus_eight_and_bf16_scales(ckpts, tmp_path):
    """A file as another tool writes it: int4 codes using -8 (our symmetric quantizer never does), bf16 scales,
    int32 weight_shape, the recipe's own packing, a config with more fields and a regex in ignore."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-8, 8, (3072, 64), generator=g).to(torch.int8)
    codes[:, 0] = -8
    scales = (torch.rand(3072, 1, generator=g) / 7 + 1e-3).to(torch.bfloat16)

    def tensors(t):
        t["talker.codec_head.weight_packed"] = _reference_pack(codes, 4)
        t["talker.codec_head.weight_scale"] = scales
        t["talker.codec_head.weight_shape"] = torch.tensor([3072, 64], dtype=torch.int32)

    def config(qc):
        qc.update(ignore=["talker.text_projection.linear_fc1", "re:.*linear_fc2$"], sparsity_config={},
                  version="0.17.0")
        qc["config_groups"]["group_0"]["weights"].update(group_size=64, observer="mse", actorder="static")

    path = _variant(ckpts["int4-all"], tmp_path / "foreign", config=config, tensors=tensors)
    qw = load_model(path, dtype="float32", load_encoders=False).talker.codec_head.weight
    assert qw.method == "int4" and qw.group_size == 64
    assert torch.equal(qw.codes(), codes) and int(qw.codes().min()) == -8
    assert torch.equal(qw.row_scales(), scales.float())  # bf16 -> fp32 is exact
    assert torch.equal(qw.dequantize(), codes.float() * scales.float())


# ---- refused formats ---------------------------------------------------------------------------------
def _weights(**kw):
    def edit(qc):
        qc["config_groups"]["group_0"]["weights"].update(kw)
    return edit


@pytest.mark.parametrize("edit,match", [
    (lambda qc: qc.update(quant_method="gptq"), r"quant_method='gptq' is not supported; accepted: 'compressed-tensors'"),
    (lambda qc: qc.update(quant_method="awq"), r"quant_method='awq' is not supported; accepted: 'compressed-tensors'"),
    (lambda qc: qc.update(format="int-quantized"), r"format='int-quantized' is not supported; accepted: 'pack-quantized'"),
    (_weights(num_bits=2), r"num_bits=2 is not supported; accepted: 4, 8"),
    (_weights(symmetric=False), r"symmetric=False is not supported; accepted: True"),
    (_weights(strategy="tensor"), r"strategy \(4 bits\)='tensor' is not supported; accepted: 'group'"),
    (_weights(num_bits=8, strategy="group"), r"strategy \(8 bits\)='group' is not supported; accepted: 'channel'"),
    (_weights(group_size=16), r"group_size=16 is not supported; accepted: 32, 64, 128"),
    (_weights(type="float"), r"type='float' is not supported; accepted: 'int'"),
    (_weights(dynamic=True), r"dynamic=True is not supported; accepted: False"),
    (_weights(actorder="group"), r"actorder='group' is not supported"),
    (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
     r"input_activations \(activation quantization\)=.* is not supported; accepted: None"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme=.* is not supported; accepted: None"),
    (lambda qc: qc["config_groups"].update(group_1={"targets": ["re:.*lm_head.*"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}),
     r"config_groups mix int4 group sizes"),  # an int8 + an int4 group is a recipe (test_recipes_...); two sizes not
])
def test_refused_configs_name_the_value_and_the_accepted_ones(ckpts, edit, match):
    qc = json.loads((ckpts["int4-all"] / "config.json").read_text())["quantization_config"]
    edit(qc)
    with pytest.raises(ConfigError, match=match):
        parse_scheme(qc)


def test_a_refused_config_fails_the_pipeline_before_loading(ckpts, tmp_path):
    from omnilab.pipeline import Pipeline

    path = _variant(ckpts["int4-all"], tmp_path / "gptq", config=lambda qc: qc.update(quant_method="gptq"))
    with pytest.raises(ConfigError, match="quant_method='gptq'"):
        Pipeline.from_pretrained(path, backend="eager", dtype="float32")


def _drop(*names):
    def edit(t):
        for n in names:
            del t[n]
    return edit


def _swap_in(module: str, source: str):
    """``module``'s packed tensors replaced by ``source``'s (consistent among themselves, another geometry)."""
    def edit(t):
        for p in ("weight_packed", "weight_scale", "weight_shape"):
            t[f"talker.{module}.{p}"] = t[f"talker.{source}.{p}"].clone()
    return edit


def _pack_text_projection(t):
    w = t["talker.text_projection.linear_fc1.weight"]
    del t["talker.text_projection.linear_fc1.weight"]
    t["talker.text_projection.linear_fc1.weight_packed"] = pack_int32(torch.zeros(w.shape, dtype=torch.int8), 4)
    t["talker.text_projection.linear_fc1.weight_scale"] = torch.ones(w.shape[0], w.shape[1] // 32)
    t["talker.text_projection.linear_fc1.weight_shape"] = torch.tensor(list(w.shape))


def _dense_codec_head(t):
    _drop(*(f"talker.codec_head.{p}" for p in ("weight_packed", "weight_scale", "weight_shape")))(t)
    t["talker.codec_head.weight"] = torch.zeros(3072, 64, dtype=torch.bfloat16)


def _shape(value):
    def edit(t):
        t["talker.codec_head.weight_shape"] = torch.tensor(value)
    return edit


@pytest.mark.parametrize("edit,config,error,match", [
    (_drop("talker.codec_head.weight_scale"), None, CheckpointError,
     r"quantized module talker.codec_head has weight_packed, weight_shape but no weight_scale"),
    (_drop("talker.model.layers.0.mlp.up_proj.weight_shape"), None, CheckpointError, r"up_proj .*but no weight_shape"),
    (_drop("talker.model.layers.0.mlp.up_proj.weight_packed"), None, CheckpointError, r"up_proj .*but no weight_packed"),
    (_dense_codec_head, None, CheckpointError,
     r"1 decode matrix targeted by quantization_config .*without weight_packed/weight_scale/weight_shape: "
     r"talker.codec_head"),
    (_shape([3072, 128]), None, CheckpointError,
     r"talker.codec_head.weight_packed is int32 \[3072, 8\]; weight_shape \[3072, 128\] .* needs int32 \[3072, 16\]"),
    (_swap_in("codec_head", "code_predictor.lm_head.0"), None, ConfigError,
     r"shape mismatch.*talker.codec_head.weight file \(2048, 64\) vs config \(3072, 64\)"),
    (_pack_text_projection, None, CheckpointError,
     r"quantized tensor talker.text_projection.linear_fc1.weight_packed is not a talker decode matrix"),
    (None, _weights(group_size=128), ConfigError, r"group_size 128 does not divide K=64"),
    (lambda t: t.update({"talker.codec_head.weight_zero_point": torch.ones(3072, 1, dtype=torch.int32)}), None,
     ConfigError, r"weight_zero_point is not all zero \(asymmetric\); accepted: symmetric"),
])
def test_refused_tensors_name_the_tensor(ckpts, tmp_path, edit, config, error, match):
    path = _variant(ckpts["int4-all"], tmp_path / "bad", config=config, tensors=edit)
    with pytest.raises(error, match=match):
        load_model(path, dtype="float32", load_encoders=False)


def test_packed_tensors_without_a_quantization_config_are_refused(ckpts, tmp_path):
    path = _variant(ckpts["int8"], tmp_path / "noconfig", config=lambda qc: qc.clear())
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"holds packed tensors \(\*.weight_packed\) but config.json has no "
                                              r"quantization_config"):
        load_model(path, dtype="float32", load_encoders=False)


def test_quantization_argument_on_a_quantized_checkpoint(ckpts, monkeypatch):
    from omnilab.pipeline import Pipeline

    monkeypatch.delenv("OMNILAB_QUANTIZATION", raising=False)
    for asked, group in (("int4-all", None), ("int4-all", 64)):  # the checkpoint's own: fine
        assert quantization_for(ckpts["int4-all"], asked, group)[0].source == "checkpoint"
    with pytest.raises(ConfigError, match=r"quantization='int8' asks for int8 but the checkpoint is already quantized "
                                          r"\(int4-all group 64.*accepted: None or .*'int4-all-g64'"):
        Pipeline.from_pretrained(ckpts["int4-all"], backend="eager", dtype="float32", quantization="int8")
    with pytest.raises(ConfigError, match=r"asks for int4-all group 32 .*already quantized \(int4-all group 64"):
        quantization_for(ckpts["int4-all"], "int4-all", 32)
    with pytest.raises(ConfigError, match=r"asks for int4 .*already quantized \(int4-all group 64"):
        quantization_for(ckpts["int4-all"], "int4")  # another recipe: the predictor's format differs
    monkeypatch.setenv("OMNILAB_QUANTIZATION", "none")
    with pytest.raises(ConfigError, match=r"OMNILAB_QUANTIZATION=none asks for unquantized matrices"):
        quantization_for(ckpts["int8"])
    monkeypatch.setenv("OMNILAB_QUANTIZATION", "int8")
    assert quantization_for(ckpts["int8"])[0].source == "checkpoint"


def test_scheme_ignore_and_targets():
    s = PackedScheme((PackedGroup("int4", 64, ("Linear",)),), ("talker.codec_head", "re:.*lm_head\\.1\\d$"))
    assert not s.targets_module("talker.codec_head") and not s.targets_module("talker.code_predictor.lm_head.12")
    assert s.targets_module("talker.code_predictor.lm_head.2") and s.targets_module("talker.model.layers.0.mlp.up_proj")
    assert not PackedScheme((PackedGroup("int8", None, ("re:.*mlp.*",)),)).targets_module("talker.codec_head")


def test_recipes_quantize_exactly_the_parts_they_name(loaded, ckpts):
    """Each recipe's format per part (int8 everywhere; int4: int4 talker layers and codec head, int8 predictor;
    int4-all: int4 everywhere), counted on the QuantizedWeights a file loads into and on its config groups."""
    from omnilab.config import QUANT_PARTS, QUANT_RECIPES, quant_part

    for recipe in ("int8", "int4", "int4-all"):
        weights = _quantized_weights(loaded("file", recipe).talker)  # name (without talker.) -> QuantizedWeight
        counts: dict[tuple[str, str], int] = {}
        for name, qw in weights.items():
            counts[quant_part(name), qw.method] = counts.get((quant_part(name), qw.method), 0) + 1
        # tiny: 2 talker layers x 7, codec head, 2 predictor layers x 7, 15 heads (no input projection at 0.6B shape)
        per_part = {"talker_layers": 14, "codec_head": 1, "predictor_layers": 14, "predictor_heads": 15}
        assert counts == {(p, f): per_part[p] for p, f in zip(QUANT_PARTS, QUANT_RECIPES[recipe])}, recipe
    qc = json.loads((ckpts["int4"] / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [(g["weights"]["num_bits"], g["weights"]["group_size"]) for g in qc.values()] == [(4, 64), (8, None)]
    assert all("Linear" not in g["targets"] for g in qc.values())  # the parts are named, so no group overlaps


def test_int4_keeps_the_code_predictor_at_int8(loaded):
    """What ``int4`` means: the predictor (layers, heads) is never below 8 bits unless a recipe (int4-all) says so."""
    q = loaded("at_load", "int4").quantization
    assert q.mixed and q.label.startswith("int4: int4 talker") and "code predictor stays int8" in q.reason
    weights = _quantized_weights(loaded("at_load", "int4").talker)
    assert {qw.method for n, qw in weights.items() if n.startswith("code_predictor.")} == {"int8"}
    assert {qw.method for n, qw in weights.items() if not n.startswith("code_predictor.")} == {"int4"}
    # int8 parts of a mixed recipe keep int8's activations (fp32), the int4 parts int4's (int8)
    assert {(qw.method, qw.activations) for qw in weights.values()} == {("int8", "int16"), ("int4", "int8")}


def test_bad_recipe_names_list_the_accepted_ones():
    from omnilab.config import parse_quantization

    for bad in ("int4-some", "int2", "int8-g32", "int4-all-g48"):
        with pytest.raises(ConfigError, match=r"accepted: .*int4-all|accepted: 32, 64, 128"):
            parse_quantization(bad, "quantization")
    assert parse_quantization("int4-all-g32", "q") == ("int4-all", 32)
    assert parse_quantization("INT4-g64", "q") == ("int4", 64)


def test_least_squares_int4_file_stores_fp16_scales_and_loads_the_at_load_weights(ckpts, tmp_path, monkeypatch):
    """OMNILAB_INT4_SCALES=wls: the file's int4 scales are fp16 (half the bytes; chosen fp16-exact), its int8 parts
    fp32, and it loads with no arguments into exactly the QuantizedWeights quantizing at load builds."""
    monkeypatch.setenv("OMNILAB_INT4_SCALES", "wls")
    dst = quantize_checkpoint(ckpts["src"], tmp_path / "wls", "int4", progress=False)
    t = _tensors(dst)
    assert t["talker.codec_head.weight_scale"].dtype == torch.float16
    assert t["talker.code_predictor.lm_head.0.weight_scale"].dtype == torch.float32  # int8 part
    a = _quantized_weights(load_model(dst, dtype="float32", load_encoders=False).talker)
    at_load = load_model(ckpts["src"], dtype="float32", load_encoders=False,
                         quantization=quantization_for(ckpts["src"], "int4")[0])
    assert at_load.quantization.int4_scales == "wls"
    b = _quantized_weights(at_load.talker)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].qweight, b[name].qweight) and torch.equal(a[name].scales, b[name].scales), name
