"""The decoder layer's direct one-token step and the whole stack's one-call step (omnilab.models.decode_step) are
bitwise the general path."""
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
        for mode in ("off", "layer", "auto"):
            monkeypatch.setenv(decode_step.ENV, mode)
            r = pipe.generate("The direct step.", speaker="vivian", do_sample=False, subtalker_do_sample=False,
                              max_new_tokens=10)
            got[mode] = np.asarray(r.codes)
        assert np.array_equal(got["off"], got["auto"]) and np.array_equal(got["off"], got["layer"])
        monkeypatch.setenv(decode_step.ENV, "always")
        with pytest.raises(ConfigError, match="OMNILAB_DECODE_STEP='always'.*accepted: auto, layer, off"):
            decode_step.enabled()
    finally:
        pipe.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("batch,per_row", [(1, False), (3, False), (2, True)])
def test_the_one_call_stack_is_bitwise_the_layer_steps_and_the_general_path(tiny_ckpt, monkeypatch, quantization,
                                                                            batch, per_row, dtype):
    """run_stack at one token per row (the talker's per-row caches, the predictor's shared cache): the same hidden
    states and the same k/v written in every layer whether the stack runs in one kernel call, layer by layer from
    Python, or through the general path. bf16 compute too: there the stack rounds every op as torch's bf16 ops do
    (bf16 rows widened exactly into the fp32 kernels, results rounded once; the per-layer calls are fp32-only, so
    ``layer`` is the general path)."""
    from omnilab.models.decoder import run_stack
    from omnilab.pipeline import Pipeline

    # the dtype asked here is the one under test: the AVX2 pass's OMNILAB_DTYPE=float32 (kept for vLLM's AMX attention)
    # would override it, and the eager stack's bf16 path must hold on the AVX2 builds too
    monkeypatch.delenv("OMNILAB_DTYPE", raising=False)
    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype=dtype,
                                    quantization=quantization)
    dt = getattr(torch, dtype)
    try:
        cp, pc = pipe.model.talker.code_predictor, pipe.model.config.code_predictor
        lengths = [3 + 2 * i for i in range(batch)] if per_row else [5] * batch

        def caches():
            gen = torch.Generator().manual_seed(7)
            cs = ([KVCache(pc.num_hidden_layers, 1, pc.num_key_value_heads, pc.head_dim, 16 + 8 * i, dt)
                   for i in range(batch)] if per_row else
                  [KVCache(pc.num_hidden_layers, batch, pc.num_key_value_heads, pc.head_dim, 16, dt)])
            for c, n in zip(cs, lengths):
                for t in c.k + c.v:
                    t.copy_(torch.randn(t.shape, generator=gen))
                c.length = n
            return cs if per_row else cs[0]

        x = torch.randn(batch, 1, pc.hidden_size, generator=torch.Generator().manual_seed(8)).to(dt)
        out, kv = {}, {}
        with torch.inference_mode():
            for mode in ("off", "layer", "auto"):
                monkeypatch.setenv(decode_step.ENV, mode)
                c = caches()
                out[mode] = run_stack(cp.model.layers, cp.model.norm, cp.rope, x, c)
                cs = c if isinstance(c, list) else [c]
                kv[mode] = [[t.clone() for t in cc.k + cc.v] for cc in cs]
                assert [cc.length for cc in cs] == ([n + 1 for n in lengths] if per_row else [lengths[0] + 1])
        assert cp.model.layers._stack_step._plans, "the one-call stack must apply to these layers"
        assert cp.model.layers._stack_step._plans[0]["dtype"] == dt and out["auto"].dtype == dt
        assert cp.model.layers._stack_step._valid, "the last call (auto) ran the one-call stack"
        for mode in ("layer", "auto"):
            assert torch.equal(out["off"], out[mode]), mode
            for a, b in zip(kv["off"], kv[mode]):
                assert all(torch.equal(p, q) for p, q in zip(a, b)), mode
    finally:
        pipe.close()


def test_a_replaced_weight_is_seen_by_the_next_checked_step(tiny_ckpt, monkeypatch):
    """The one-call stack keeps raw pointers: a weight replaced between frames (a new Parameter) is picked up at the
    next checked call, and an unchecked call after one that did not run the stack checks anyway."""
    from omnilab.models.decoder import run_stack
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
    try:
        cp, pc = pipe.model.talker.code_predictor, pipe.model.config.code_predictor
        x = torch.randn(1, 1, pc.hidden_size, generator=torch.Generator().manual_seed(3))

        def run(mode, recheck=True):
            monkeypatch.setenv(decode_step.ENV, mode)
            c = KVCache(pc.num_hidden_layers, 1, pc.num_key_value_heads, pc.head_dim, 16, torch.float32)
            with torch.inference_mode():
                return run_stack(cp.model.layers, cp.model.norm, cp.rope, x, c, recheck=recheck)

        before = run("auto")
        down = cp.model.layers[-1].mlp.down_proj
        assert down.weight.dtype == torch.bfloat16, "the decode kernels must take this weight"
        down.weight = torch.nn.Parameter(down.weight.detach() * 2, requires_grad=False)
        after = run("auto")
        assert not torch.equal(before, after) and torch.equal(after, run("off"))
        run("layer")  # not the one-call stack: the next unchecked call must check
        down.weight = torch.nn.Parameter(down.weight.detach() * 2, requires_grad=False)
        assert torch.equal(run("auto", recheck=False), run("off"))
    finally:
        pipe.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_short_prefill_runs_as_stack_rows_and_agrees_with_the_general_path(tiny_ckpt, monkeypatch, quantization,
                                                                             batch, dtype):
    """The code predictor's first step ([h, C(c0)]: 2 tokens per sequence) runs as rows of the one-call stack, each
    token at its own position over its sequence's cache row. Against the general path (torch's causal attention over
    the 2 tokens) the hidden states and the k/v written agree within rounding: the same GEMV kernels (bitwise per
    row), another summation order in attention and the norms: fp32 within 1e-4 relative (~1e-7 per op, a few
    layers), bf16 within 4e-2 (each side rounds its attention ops to bf16 in its own places, ~2^-8 relative each:
    about 5 bf16 steps). The cache lengths advance by 2 either way, and the next one-token step over those caches
    agrees the same way. Tolerances, not bit-equality: the kernels' lane order differs between ISA builds."""
    from omnilab.models.decoder import run_stack
    from omnilab.pipeline import Pipeline

    monkeypatch.delenv("OMNILAB_DTYPE", raising=False)
    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype=dtype,
                                    quantization=quantization)
    dt = getattr(torch, dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dt == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    try:
        cp, pc = pipe.model.talker.code_predictor, pipe.model.config.code_predictor
        g = torch.Generator().manual_seed(3)
        x = torch.randn(batch, 2, pc.hidden_size, generator=g).to(dt)
        x1 = torch.randn(batch, 1, pc.hidden_size, generator=g).to(dt)
        out, nxt, kv = {}, {}, {}
        with torch.inference_mode():
            for mode in ("off", "auto"):
                monkeypatch.setenv(decode_step.ENV, mode)
                stack = cp.model.layers.__dict__.get("_stack_step")
                if stack is not None:
                    stack._valid = False
                c = KVCache(pc.num_hidden_layers, batch, pc.num_key_value_heads, pc.head_dim, 16, dt)
                out[mode] = run_stack(cp.model.layers, cp.model.norm, cp.rope, x, c)
                if mode == "auto":
                    assert cp.model.layers._stack_step._valid, "the 2-token prefill ran the one-call stack"
                assert c.length == 2
                kv[mode] = [t[:, :, :2].clone() for t in c.k + c.v]
                nxt[mode] = run_stack(cp.model.layers, cp.model.norm, cp.rope, x1, c)
                assert c.length == 3
        assert out["auto"].shape == (batch, 2, pc.hidden_size) and out["auto"].dtype == dt
        torch.testing.assert_close(out["auto"].float(), out["off"].float(), **tol)
        for a, b in zip(kv["auto"], kv["off"]):
            torch.testing.assert_close(a.float(), b.float(), **tol)
        torch.testing.assert_close(nxt["auto"].float(), nxt["off"].float(), **tol)
    finally:
        pipe.close()
