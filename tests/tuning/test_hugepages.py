"""Decode weights in a huge-page arena: the choice and its errors, which tensors go there, loaders unchanged."""
from __future__ import annotations

import re

import pytest

from omnilab.errors import ConfigError
import torch

from omnilab.tuning import hugepages as hp


@pytest.mark.parametrize("thp,enabled", [("always", True), ("madvise", True), ("never", False), (None, False)])
def test_auto_follows_the_kernel_thp_mode(thp, enabled):
    c = hp.hugepages_choice(env="auto", thp=thp)
    assert c.enabled is enabled and c.source == "env"
    assert (repr(thp) if thp else "not Linux THP") in c.reason


def test_off_by_default_with_the_measurement_as_reason(monkeypatch):
    monkeypatch.delenv(hp.ENV, raising=False)
    c = hp.hugepages_choice(thp="always")
    assert not c.enabled and c.source == "default" and "OMNILAB_HUGEPAGES=on" in c.reason


def test_env_modes_and_errors():
    assert not hp.hugepages_choice(env="off", thp="always").enabled
    assert hp.hugepages_choice(env="on", thp="madvise").source == "env"
    with pytest.raises(RuntimeError, match="OMNILAB_HUGEPAGES=on needs transparent huge pages.*'never'"):
        hp.hugepages_choice(env="on", thp="never")
    with pytest.raises(ConfigError, match="OMNILAB_HUGEPAGES='yes' is not a mode; accepted: off, on, auto"):
        hp.hugepages_choice(env="yes")


def test_streamed_names():
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.27.mlp.down_proj.weight", "codec_head.weight",
           "code_predictor.model.layers.4.mlp.gate_proj.weight", "code_predictor.lm_head.14.weight",
           "code_predictor.small_to_mtp_projection.weight"]
    no = ["model.text_embedding.weight", "model.codec_embedding.weight", "model.layers.0.input_layernorm.weight",
          "model.layers.0.self_attn.q_norm.weight", "text_projection.linear_fc1.weight", "model.norm.weight",
          "code_predictor.model.codec_embedding.3.weight", "code_predictor.small_to_mtp_projection.bias"]
    assert all(hp.talker_streamed_name(n) for n in yes)
    assert not any(hp.talker_streamed_name(n) for n in no)


def test_arena_put_casts_aligns_and_refuses_overflow():
    a = hp.WeightArena(hp.WeightArena.size_for([((3, 5), torch.float32), ((7,), torch.float32)]))
    src = torch.randn(3, 5).bfloat16()
    x = a.put(src, torch.float32)
    assert x.dtype == torch.float32 and torch.equal(x, src.float()) and x in a
    y = a.put(torch.ones(7))
    assert y.data_ptr() % hp.ALIGN_BYTES == 0 and torch.equal(y, torch.ones(7))
    assert torch.randn(2) not in a
    with pytest.raises(RuntimeError, match="weight arena full"):
        hp.WeightArena(hp.HUGE_BYTES).put(torch.empty(hp.HUGE_BYTES // 4 + 1))


def _vma_flags(address: int) -> dict[str, str]:
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        lo, hi = (int(v, 16) for v in block.split()[0].split("-"))
        if lo <= address < hi:
            return dict(line.split(":", 1) for line in block.splitlines()[1:] if ":" in line)
    raise AssertionError("address not mapped")


@pytest.mark.parametrize("storage", ["bf16", "compute"])
@pytest.mark.parametrize("loader", ["load_model", "vllm_worker"])
def test_loaders_place_streamed_matrices_in_huge_pages(tiny_ckpt, monkeypatch, loader, storage):
    if not hp.hugepages_choice(env="auto").enabled:
        pytest.skip("transparent huge pages unavailable here")
    from omnilab.config import Qwen3TTSConfig
    from omnilab.checkpoint.load import load_model
    from omnilab.checkpoint.worker_weights import load_talker_weights

    path = tiny_ckpt()
    cfg = Qwen3TTSConfig.load(path / "config.json")

    def load():
        if loader == "load_model":
            return load_model(path, dtype="float32", load_code2wav=False).talker
        return load_talker_weights(path, cfg, torch.float32)

    from omnilab.tuning import storage as st

    monkeypatch.setenv(st.ENV, storage)
    monkeypatch.setenv(hp.ENV, "on")
    talker = load()
    monkeypatch.setenv(hp.ENV, "off")
    plain = load()
    arena = talker.weight_arena
    assert plain.weight_arena is None and arena is not None
    params = dict(talker.named_parameters())
    inside = {n for n, p in params.items() if p in arena}
    assert inside == {n for n in params if hp.talker_streamed_name(n)} and len(inside) > 10
    assert all(params[n].dtype == (torch.bfloat16 if storage == "bf16" else torch.float32) for n in inside)
    ref = plain.state_dict()
    for name, t in talker.state_dict().items():  # same values, names, dtypes as torch's allocations
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name
    assert _vma_flags(arena.address)["THPeligible"].strip() == "1"


def test_pack_moves_a_built_model_in_place():
    from omnilab.models import tiny
    from omnilab.models.talker import Talker, init_random_

    t = Talker(tiny.config(hidden=64))
    init_random_(t, torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in t.named_parameters()}
    objects = {n: p for n, p in t.named_parameters()}
    arena = hp.pack(t)
    moved = {n for n, p in t.named_parameters() if p in arena}
    assert moved == {n for n in before if hp.talker_streamed_name(n)} and t.weight_arena is arena
    assert all(objects[n] is p and torch.equal(p, before[n]) for n, p in t.named_parameters())
