"""Talker network: released tensor names, shapes, KV-cache equivalence, deterministic random init."""
import pytest
import torch

from omnilab.models import tiny
from omnilab.models.decoder import KVCache, RopeTable
from omnilab.models.layers import RotaryEmbedding
from omnilab.models.talker import Talker, init_random_


def make(seed=0, **kw):
    cfg = tiny.config(**kw)
    t = Talker(cfg)
    init_random_(t, torch.Generator().manual_seed(seed))
    return cfg, t.eval()


def expected_names(num_layers: int, cp_layers: int, projection: bool) -> set[str]:
    """Released ``talker.*`` names (docs/model.md#tensor-names-and-prefix-stripping) with the ``talker.`` prefix stripped."""
    def layer(prefix):
        return {f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"} | {
            f"{prefix}.self_attn.q_norm.weight", f"{prefix}.self_attn.k_norm.weight",
            f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight", f"{prefix}.mlp.down_proj.weight",
            f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"}
    names = {"model.codec_embedding.weight", "model.text_embedding.weight", "model.norm.weight",
             "text_projection.linear_fc1.weight", "text_projection.linear_fc1.bias",
             "text_projection.linear_fc2.weight", "text_projection.linear_fc2.bias", "codec_head.weight",
             "code_predictor.model.norm.weight"}
    for i in range(num_layers):
        names |= layer(f"model.layers.{i}")
    for i in range(cp_layers):
        names |= layer(f"code_predictor.model.layers.{i}")
    for q in range(15):
        names |= {f"code_predictor.model.codec_embedding.{q}.weight", f"code_predictor.lm_head.{q}.weight"}
    if projection:
        names |= {"code_predictor.small_to_mtp_projection.weight", "code_predictor.small_to_mtp_projection.bias"}
    return names


@pytest.mark.parametrize("hidden,projection", [(64, False), (96, True)])
def test_state_dict_names_and_shapes_match_release(hidden, projection):
    cfg, t = make(hidden=hidden)
    sd = t.state_dict()
    g = tiny.TINY
    assert set(sd) == expected_names(g["layers"], g["cp_layers"], projection)
    h, hc, d = hidden, g["cp_hidden"], g["head_dim"]
    assert sd["model.codec_embedding.weight"].shape == (3072, h)
    assert sd["model.text_embedding.weight"].shape == (151936, g["text_hidden"])
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (g["heads"] * d, h)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (g["kv"] * d, h)
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (h, g["heads"] * d)
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (d,)
    assert sd["text_projection.linear_fc1.weight"].shape == (g["text_hidden"], g["text_hidden"])
    assert sd["text_projection.linear_fc2.weight"].shape == (h, g["text_hidden"])
    assert sd["codec_head.weight"].shape == (3072, h)
    assert sd["code_predictor.model.codec_embedding.3.weight"].shape == (2048, h)  # talker width
    assert sd["code_predictor.lm_head.14.weight"].shape == (2048, hc)
    assert sd["code_predictor.model.layers.0.self_attn.q_proj.weight"].shape == (g["heads"] * d, hc)
    if projection:
        assert sd["code_predictor.small_to_mtp_projection.weight"].shape == (hc, h)
    # strict load of the same names works (what a real checkpoint load does)
    t2 = Talker(cfg)
    t2.load_state_dict(sd, strict=True)


def test_embedding_and_forward_shapes():
    cfg, t = make()
    h = cfg.talker.hidden_size
    assert t.embed_text([1, 2, 3]).shape == (3, h)
    assert t.embed_text([]).shape == (0, h)
    assert t.embed_codec([2148, 2149]).shape == (2, h)
    codes = torch.randint(0, 2048, (5, 16))
    frame = t.embed_frame(codes)
    assert frame.shape == (5, h)
    manual = t.model.codec_embedding(codes[:, 0]) + sum(
        t.code_predictor.model.codec_embedding[q - 1](codes[:, q]) for q in range(1, 16))
    torch.testing.assert_close(frame, manual, rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 7, h) * 0.02
    out = t(x)
    assert out.shape == (2, 7, h)
    assert t.logits(out).shape == (2, 7, 3072)


def test_incremental_decode_equals_full_sequence():
    cfg, t = make(seed=1)
    x = torch.randn(1, 12, cfg.talker.hidden_size) * 0.02
    full = t(x)
    cache = t.new_cache(capacity=4)  # small on purpose: must grow
    parts = [t(x[:, :8], cache)]
    for i in range(8, 12):
        parts.append(t(x[:, i:i + 1], cache))
    assert cache.length == 12 and cache.capacity >= 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    # chunked prefill on top of a cache (explicit offset causal mask)
    cache2 = t.new_cache(capacity=16)
    chunked = torch.cat([t(x[:, :5], cache2), t(x[:, 5:], cache2)], dim=1)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)


def test_batched_rows_with_own_caches_match_single_rows():
    cfg, t = make(seed=2)
    h = cfg.talker.hidden_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randn(1, n, h, generator=g) * 0.02 for n in (3, 9, 6)]
    caches = [t.new_cache(16) for _ in prompts]
    for p, c in zip(prompts, caches):
        t(p, [c])
    step = torch.randn(3, 1, h, generator=g) * 0.02
    batched = t(step, caches)
    for i, p in enumerate(prompts):
        ref = t(torch.cat([p, step[i:i + 1]], dim=1))[:, -1:]
        torch.testing.assert_close(batched[i:i + 1], ref, rtol=1e-5, atol=1e-5)


def test_rope_table_is_bitwise_equal_to_rotary_embedding():
    table = RopeTable(128, 1e6)
    rot = RotaryEmbedding(128, 1e6)
    pos = torch.tensor([[0, 1, 2, 17, 300, 4095]])
    for dtype in (torch.float32, torch.bfloat16):
        c1, s1 = table.get(pos, dtype)
        c2, s2 = rot(pos, dtype)
        assert torch.equal(c1, c2) and torch.equal(s1, s2)
        c3, s3 = table.span(5, 3, dtype)
        c4, s4 = rot(torch.arange(5, 8)[None], dtype)
        assert torch.equal(c3, c4) and torch.equal(s3, s4)


def test_init_random_is_deterministic_and_well_scaled():
    _, a = make(seed=7)
    _, b = make(seed=7)
    _, c = make(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["codec_head.weight"], sc["codec_head.weight"])
    std = sa["model.text_embedding.weight"].std().item()
    assert abs(std - 0.02) < 1e-3
    assert torch.all(sa["model.norm.weight"] == 1) and torch.all(sa["model.layers.1.self_attn.k_norm.weight"] == 1)
    assert torch.all(sa["text_projection.linear_fc1.bias"] == 0)


def test_kv_cache_refuses_overflow_when_fixed():
    c = KVCache(1, 1, 2, 4, capacity=2, dtype=torch.float32, grow=False)
    with pytest.raises(RuntimeError):
        c.reserve(3)


def test_meta_device_build_then_init_matches_regular_build():
    """Fast big-model construction (meta -> to_empty -> init_random_) must give the same model."""
    cfg, ref = make(seed=3)
    with torch.device("meta"):
        t = Talker(cfg)
    t.to_empty(device="cpu")
    init_random_(t, torch.Generator().manual_seed(3))
    x = torch.randn(1, 6, cfg.talker.hidden_size) * 0.02
    assert torch.equal(t.eval()(x), ref(x))
    h = torch.randn(1, cfg.talker.hidden_size)
    from omnilab.sampling import Warp
    greedy = Warp(False, 1.0, 0, 1.0)
    assert torch.equal(t.code_predictor.generate(h, t.embed_codec([7]), greedy),
                       ref.code_predictor.generate(h, ref.embed_codec([7]), greedy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_is_bitwise_equal_to_the_textbook_op_order(dtype):
    """The fused q/k norm + roll-based RoPE must equal the reference op order exactly
    (q_norm, k_norm separately, rotate_half RoPE, SDPA with GQA, SwiGLU)."""
    import torch.nn.functional as F
    from omnilab.models.layers import apply_rope
    cfg, t = make(seed=5)
    t = t.to(dtype)
    layer = t.model.layers[0]
    a = layer.self_attn
    x = (torch.randn(1, 9, cfg.talker.hidden_size) * 0.5).to(dtype)
    rot = RotaryEmbedding(cfg.talker.head_dim, cfg.talker.rope_theta)
    cos, sin = rot(torch.arange(9)[None], dtype)

    # Both sides outside autograd: the norms then take the same implementation (omnilab.kernels.norm), whose
    # result per row does not depend on how the rows are stacked (q and k heads together or apart).
    with torch.inference_mode():
        h = layer.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(1, 9, -1, a.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(h).view(1, 9, -1, a.head_dim)).transpose(1, 2)
        v = a.v_proj(h).view(1, 9, -1, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.head_dim ** -0.5, enable_gqa=True)
        x1 = x + a.o_proj(o.transpose(1, 2).reshape(1, 9, -1))
        expected = x1 + layer.mlp(layer.post_attention_layernorm(x1))
        cs, sn = t.rope.span(0, 9, dtype, signed=True)
        got = layer(x, cs, sn, 0, None)
    assert torch.equal(got, expected.detach())
