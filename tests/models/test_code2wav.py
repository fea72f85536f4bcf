"""code2wav offline behaviour: released tensor layout, output contract, random init, causality."""
from __future__ import annotations

import pytest
import torch

from omnilab.config import Code2WavConfig
from omnilab.errors import InputError
from omnilab.models.code2wav import Code2Wav, init_random_

SPF = 1920
# Two decodes of the same frames through different shapes (batch 2 vs 1, a chunk with left context vs the
# whole) are equal up to rounding, not bitwise: MKL/oneDNN pick other blockings per shape, CPU, ISA and thread
# count, i.e. other summation orders. A reordered fp32 sum of K terms moves by at most ~K * 2^-24 of its
# absolute sum (Higham), in practice ~sqrt(K) * 2^-24: with K <= 7 * 64 here and a few dozen layers whose
# activations stay O(1), that is ~1e-6 on audio bounded by 1 (measured: 1.2e-6 on Zen 4 AVX-512, 1.4e-6
# under AVX2 caps at one thread). 1e-5 leaves margin for other CPUs; a real bug (a leak between rows, a
# wrong left context) moves samples by O(1e-2) or more.
REORDER_ATOL = 1e-5

REAL = dict(codebook_size=2048, codebook_dim=512, num_quantizers=16, latent_dim=1024, hidden_size=512,
            intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
            sliding_window=72, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2), decoder_dim=1536)
TINY = dict(REAL, codebook_size=64, codebook_dim=16, latent_dim=32, hidden_size=16, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8, decoder_dim=64)


def tiny_model(seed: int = 0, **init_kw) -> Code2Wav:
    torch.set_num_threads(1)
    m = Code2Wav(Code2WavConfig(**TINY)).eval()
    return init_random_(m, torch.Generator().manual_seed(seed), **init_kw)


def rand_codes(frames: int, batch: int = 1, seed: int = 1, size: int = TINY["codebook_size"]) -> torch.Tensor:
    return torch.randint(0, size, (batch, 16, frames), generator=torch.Generator().manual_seed(seed))


def released_decoder_shapes() -> dict[str, tuple[int, ...]]:
    """Expected ``decoder.*`` names/shapes of speech_tokenizer/model.safetensors (docs/model.md#tensor-names-and-prefix-stripping)."""
    e: dict[str, tuple[int, ...]] = {}
    for part, n in (("rvq_first", 1), ("rvq_rest", 15)):
        q = f"quantizer.{part}."
        e[q + "input_proj.weight"] = (256, 512, 1)
        e[q + "output_proj.weight"] = (512, 256, 1)
        for i in range(n):
            e[q + f"vq.layers.{i}._codebook.cluster_usage"] = (2048,)
            e[q + f"vq.layers.{i}._codebook.embedding_sum"] = (2048, 256)
    e["pre_conv.conv.weight"], e["pre_conv.conv.bias"] = (1024, 512, 3), (1024,)
    t = "pre_transformer."
    e[t + "input_proj.weight"], e[t + "input_proj.bias"] = (512, 1024), (512,)
    e[t + "output_proj.weight"], e[t + "output_proj.bias"] = (1024, 512), (1024,)
    e[t + "norm.weight"] = (512,)
    for i in range(8):
        p = f"{t}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            e[p + n + ".weight"] = (512,)
        for n in ("q_proj", "k_proj", "v_proj"):
            e[p + f"self_attn.{n}.weight"] = (1024, 512)
        e[p + "self_attn.o_proj.weight"] = (512, 1024)
        e[p + "mlp.gate_proj.weight"] = e[p + "mlp.up_proj.weight"] = (1024, 512)
        e[p + "mlp.down_proj.weight"] = (512, 1024)
        e[p + "self_attn_layer_scale.scale"] = e[p + "mlp_layer_scale.scale"] = (512,)
    for u in (0, 1):
        p = f"upsample.{u}."
        e[p + "0.conv.weight"], e[p + "0.conv.bias"] = (1024, 1024, 2), (1024,)
        e[p + "1.dwconv.conv.weight"], e[p + "1.dwconv.conv.bias"] = (1024, 1, 7), (1024,)
        e[p + "1.norm.weight"] = e[p + "1.norm.bias"] = e[p + "1.gamma"] = (1024,)
        e[p + "1.pwconv1.weight"], e[p + "1.pwconv1.bias"] = (4096, 1024), (4096,)
        e[p + "1.pwconv2.weight"], e[p + "1.pwconv2.bias"] = (1024, 4096), (1024,)
    e["decoder.0.conv.weight"], e["decoder.0.conv.bias"] = (1536, 1024, 7), (1536,)
    for b, (cin, cout, r) in enumerate(((1536, 768, 8), (768, 384, 5), (384, 192, 4), (192, 96, 3)), start=1):
        p = f"decoder.{b}.block."
        e[p + "0.alpha"] = e[p + "0.beta"] = (cin,)
        e[p + "1.conv.weight"], e[p + "1.conv.bias"] = (cin, cout, 2 * r), (cout,)
        for u in (2, 3, 4):
            for a in ("act1", "act2"):
                e[p + f"{u}.{a}.alpha"] = e[p + f"{u}.{a}.beta"] = (cout,)
            e[p + f"{u}.conv1.conv.weight"], e[p + f"{u}.conv1.conv.bias"] = (cout, cout, 7), (cout,)
            e[p + f"{u}.conv2.conv.weight"], e[p + f"{u}.conv2.conv.bias"] = (cout, cout, 1), (cout,)
    e["decoder.5.alpha"] = e["decoder.5.beta"] = (96,)
    e["decoder.6.conv.weight"], e["decoder.6.conv.bias"] = (1, 96, 7), (1,)
    return e


def test_state_dict_matches_released_layout():
    with torch.device("meta"):
        m = Code2Wav(Code2WavConfig(**REAL))
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    want = released_decoder_shapes()
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    assert {k: v for k, v in got.items() if want[k] != v} == {}
    assert sum(v.numel() for v in m.state_dict().values()) == pytest.approx(114.3e6, rel=0.01)


def test_strict_load_round_trip():
    a, b = tiny_model(0), tiny_model(1)
    codes = rand_codes(3)
    assert not torch.equal(a(codes), b(codes))
    b.load_state_dict(a.state_dict(), strict=True)  # also checks derived caches follow the new weights
    torch.testing.assert_close(b(codes), a(codes), rtol=0, atol=0)


def test_output_length_range_and_batch():
    m = tiny_model()
    for frames in (1, 2, 30):
        wav = m(rand_codes(frames, batch=2))
        assert wav.shape == (2, 1, frames * SPF) and wav.dtype == torch.float32
        assert wav.abs().max() <= 1.0
    codes = rand_codes(4, batch=2)
    torch.testing.assert_close(m(codes)[1:], m(codes[1:]), rtol=0, atol=REORDER_ATOL)
    assert (m(codes)[0] - m(codes)[1]).abs().max() > 1e-2  # the rows really differ
    assert m(rand_codes(0)).shape == (1, 1, 0)


def test_random_init_gives_sane_audio_without_denormals():
    for seed in (0, 1, 2):
        m = tiny_model(seed)
        wav = m(rand_codes(6, seed=seed + 10))
        rms = wav.pow(2).mean().sqrt().item()
        assert 0.01 <= rms <= 0.5, rms
        assert (wav.abs() >= 0.999).float().mean().item() < 0.5
    for name, p in m.named_parameters():
        tiny = (p != 0) & (p.abs() < 1e-30)
        assert not tiny.any(), name
    embedding_sum = m.quantizer.rvq_rest.vq.layers[3]._codebook.embedding_sum
    assert 0.8 < embedding_sum.std().item() < 1.2
    assert torch.equal(m.quantizer.rvq_first.vq.layers[0]._codebook.cluster_usage, torch.ones(64))


def test_init_is_deterministic():
    a, b, c = tiny_model(5), tiny_model(5), tiny_model(6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["decoder.0.conv.weight"], sc["decoder.0.conv.weight"])


@pytest.mark.slow
def test_random_init_real_geometry_audio():
    torch.set_num_threads(2)
    m = init_random_(Code2Wav(Code2WavConfig(**REAL)).eval(), torch.Generator().manual_seed(0))
    wav = m(rand_codes(3, size=2048))
    rms = wav.pow(2).mean().sqrt().item()
    assert 0.01 <= rms <= 0.5 and (wav.abs() >= 0.999).float().mean().item() < 0.5


def test_code_validation():
    m = tiny_model()
    codes = rand_codes(3)
    padded = codes.clone()
    padded[..., -1] = -1  # padding frames decode as code 0 (reference tokenizer clamps them)
    zeroed = codes.clone()
    zeroed[..., -1] = 0
    torch.testing.assert_close(m(padded), m(zeroed), rtol=0, atol=0)
    with pytest.raises(InputError, match="codebook_size"):
        m(torch.full((1, 16, 2), 64))
    with pytest.raises(InputError, match="shape"):
        m(codes[:, :15])
    with pytest.raises(InputError, match="integer"):
        m(codes.float())


def test_causality():
    m = tiny_model(layer_scale=0.5)
    codes = rand_codes(12)
    full = m(codes)
    torch.testing.assert_close(m(codes[..., :5]), full[..., :5 * SPF], rtol=0, atol=1e-5)
    changed = codes.clone()
    changed[..., 7:] = (changed[..., 7:] + 1) % 64
    other = m(changed)
    torch.testing.assert_close(other[..., :7 * SPF], full[..., :7 * SPF], rtol=0, atol=1e-5)
    assert (other[..., 7 * SPF:] - full[..., 7 * SPF:]).abs().max() > 1e-3


def test_internal_blocks_and_tiles_do_not_change_the_result():
    m = tiny_model(layer_scale=0.5)
    codes = rand_codes(40)
    ref = m(codes)
    m.block_frames, m.tile_frames = 7, (3, None, 2, None, 1, 1, 1)
    torch.testing.assert_close(m(codes), ref, rtol=0, atol=1e-5)
    m.block_frames, m.tile_frames = 1000, (None,) * 7
    torch.testing.assert_close(m(codes), ref, rtol=0, atol=1e-5)


def test_decode_is_chunked_decode_with_left_context():
    m = tiny_model(layer_scale=0.5)
    codes = rand_codes(23)
    torch.testing.assert_close(m.decode(codes), m(codes), rtol=0, atol=0)  # T <= 300: one forward
    out = m.decode(codes, chunk_frames=10, left_context_frames=4)
    assert out.shape == (1, 1, 23 * SPF)
    torch.testing.assert_close(out[..., :10 * SPF], m(codes[..., :10]), rtol=0, atol=REORDER_ATOL)
    torch.testing.assert_close(out[..., 10 * SPF:20 * SPF], m(codes[..., 6:20])[..., 4 * SPF:], rtol=0,
                               atol=REORDER_ATOL)
    torch.testing.assert_close(out[..., 20 * SPF:], m(codes[..., 16:23])[..., 4 * SPF:], rtol=0, atol=REORDER_ATOL)
    # ... and the left context matters: without it the chunk boundary is audibly different
    cut = m(codes[..., 10:20])[..., :SPF]
    assert (cut - out[..., 10 * SPF:11 * SPF]).abs().max() > 10 * REORDER_ATOL


def test_snake_cache_follows_in_place_weight_edits():
    m = tiny_model()
    codes = rand_codes(2)
    m.prepare()
    before = m(codes)
    with torch.no_grad():
        m.decoder[5].alpha.add_(0.5)
        m.decoder[2].block[1].conv.weight.mul_(1.1)
    fresh = tiny_model()
    fresh.load_state_dict(m.state_dict())
    after = m(codes)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, fresh(codes), rtol=0, atol=0)


def test_attention_window_is_72_frames_including_self():
    """One transformer layer: frame i sees frames i-71..i, so a change at frame 10 reaches frame 81, not 82."""
    cfg = Code2WavConfig(**dict(TINY, num_hidden_layers=1))
    m = init_random_(Code2Wav(cfg).eval(), torch.Generator().manual_seed(0), layer_scale=1.0)
    x = torch.randn(1, 100, cfg.latent_dim, generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[:, 10] += 1.0

    def run(inp):
        with torch.no_grad():
            return m.pre_transformer(inp, torch.zeros(1, dtype=torch.long), m._new_buffers(1))
    diff = (run(x) - run(y)).abs().amax(dim=-1)[0]  # [100]
    assert diff[:10].max() == 0
    assert (diff[10:82] > 1e-4).all()
    assert diff[82:].max() == 0
