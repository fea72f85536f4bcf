"""The decoder layer's direct one-token step (omnilab.models.decode_step) is bitwise the general path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnilab.models import decode_step
from omnilab.models.decoder import KVCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _layer_case(pipe, batch: int, per_row: bool, seed: int = 0):
    cp = pipe.model.talker.code_predictor
    layer, pc = cp.model.layers[0], pipe.model.config.code_predictor
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, pc.hidden_size, generator=g)

    def caches():
        gen = torch.Generator().manual_seed(seed + 1)
        if per_row:
            out = []
            for i in range(batch):
                c = KVCache(pc.num_hidden_layers, 1, pc.num_key_value_heads, pc.head_dim, 16 + 8 * i, torch.float32)
                c.k[0].copy_(torch.randn(c.k[0].shape, generator=gen))
                c.v[0].copy_(torch.randn(c.v[0].shape, generator=gen))
                c.length = 3 + 2 * i
                out.append(c)
            return out
        c = KVCache(pc.num_hidden_layers, batch, pc.num_key_value_heads, pc.head_dim, 16, torch.float32)
        c.k[0].copy_(torch.randn(c.k[0].shape, generator=gen))
        c.v[0].copy_(torch.randn(c.v[0].shape, generator=gen))
        c.length = 5
        return c

    rows = [3 + 2 * i for i in range(batch)] if per_row else [5] * batch
    cos, sin = cp.rope.get(torch.tensor(rows)[:, None], torch.float32, signed=True)
    if not per_row:
        cos, sin = cos[:1].contiguous(), sin[:1].contiguous()
    return layer, x, cos, sin, caches


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("batch,per_row", [(1, False), (3, False), (2, True)])
def test_the_direct_step_is_bitwise_the_general_path(tiny_ckpt, monkeypatch, quantization, batch, per_row):
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32",
                                    quantization=quantization)
    try:
        layer, x, cos, sin, caches = _layer_case(pipe, batch, per_row)
        out, kv = {}, {}
        with torch.inference_mode():
            for mode in ("off", "auto"):
                monkeypatch.setenv(decode_step.ENV, mode)
                c = caches()
                out[mode] = layer.forward(x, cos, sin, 0, c)
                cs = c if isinstance(c, list) else [c]
                kv[mode] = [(t.k[0].clone(), t.v[0].clone()) for t in cs]
        assert layer._step._plan is not None, "the direct step must apply to this layer"
        assert torch.equal(out["off"], out["auto"])
        for (ka, va), (kb, vb) in zip(kv["off"], kv["auto"]):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    finally:
        pipe.close()


def test_greedy_codes_and_the_off_switch(tiny_ckpt, monkeypatch):
    """The user's path: the same greedy codes with the direct step as without; a bad mode names the accepted ones."""
    from omnilab.errors import ConfigError
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32", quantization="int4")
    try:
        got = {}
        for mode in ("off", "auto"):
            monkeypatch.setenv(decode_step.ENV, mode)
            r = pipe.generate("The direct step.", speaker="vivian", do_sample=False, subtalker_do_sample=False,
                              max_new_tokens=10)
            got[mode] = np.asarray(r.codes)
        assert np.array_equal(got["off"], got["auto"])
        monkeypatch.setenv(decode_step.ENV, "always")
        with pytest.raises(ConfigError, match="OMNILAB_DECODE_STEP='always'.*accepted: auto, off"):
            decode_step.enabled()
    finally:
        pipe.close()
