"""code2wav streaming: exact state, chunk-schedule invariance, batching, bounded state."""
from __future__ import annotations

import pytest
import torch

from omnilab.config import Code2WavConfig
from omnilab.errors import InputError
from omnilab.models.code2wav import ChunkSchedule, Code2Wav, init_random_
from omnilab.models.code2wav_stream import decode_chunks

SPF = 1920
TINY = dict(codebook_size=64, codebook_dim=16, num_quantizers=16, latent_dim=32, hidden_size=16, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8, sliding_window=72,
            upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2), decoder_dim=64)


def tiny_model(seed: int = 0, **init_kw) -> Code2Wav:
    torch.set_num_threads(1)
    m = Code2Wav(Code2WavConfig(**TINY)).eval()
    return init_random_(m, torch.Generator().manual_seed(seed), **init_kw)


def rand_codes(frames: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["codebook_size"], (batch, 16, frames), generator=torch.Generator().manual_seed(seed))

FRAMES = 100  # > 72 + the conv receptive field, so the sliding window and the KV cache both matter
ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    return tiny_model(layer_scale=0.5)  # larger layer scale: the transformer visibly shapes the audio


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return rand_codes(FRAMES, seed=7)


@pytest.fixture(scope="module")
def offline(model, codes) -> torch.Tensor:
    return model(codes)


def stream(model: Code2Wav, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    st = model.start_stream(codes.shape[0])
    outs, pos = [], 0
    for n in sizes:
        wav = model.decode_chunk(st, codes[..., pos:pos + n])
        assert wav.shape == (codes.shape[0], 1, n * SPF)
        outs.append(wav)
        pos += n
        assert st.frames_done == pos
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("sizes", [
    pytest.param(ChunkSchedule(1, (), 25).sizes(FRAMES), id="1-then-25"),
    pytest.param(ChunkSchedule(0, (2, 4, 8, 16), 25).sizes(FRAMES), id="ramp-2-4-8-16-25"),
    pytest.param([1] * FRAMES, id="all-1-frame"),
    pytest.param([FRAMES], id="one-chunk"),
    pytest.param([71, 1, 1, 27], id="around-the-window"),
])
def test_streaming_equals_offline(model, codes, offline, sizes):
    torch.testing.assert_close(stream(model, codes, sizes), offline, rtol=0, atol=ATOL)


def test_sliding_window_is_exercised(model, codes, offline):
    """Decoding the tail alone (no history) must differ: the state carries real context."""
    tail = model(codes[..., 80:])
    assert (tail - offline[..., 80 * SPF:]).abs().max() > 1e-3


def test_state_is_bounded(model, codes):
    st = model.start_stream()
    shapes, nbytes = st.cache_shapes(), st.num_bytes()
    kv = [s for k, s in shapes.items() if k.endswith("self_attn")]
    assert kv and all(s == (1, 2, 2, 71, 8) for s in kv)  # [B, k|v, heads, window - 1, head_dim]
    for start in range(0, FRAMES, 10):
        model.decode_chunk(st, codes[..., start:start + 10])
        assert st.cache_shapes() == shapes and st.num_bytes() == nbytes
    assert st.frames_done == FRAMES


def test_batched_streams_equal_each_alone(model, codes):
    other = rand_codes(FRAMES, seed=8)
    a_alone = stream(model, codes, [3, 10, 10, 10])
    b_alone = stream(model, other, [10, 10, 13])
    a, b = model.start_stream(), model.start_stream()
    outs_a = [model.decode_chunk(a, codes[..., :3])]  # a is 3 frames ahead: rows at different positions
    outs_b = []
    for i in range(3):
        wa, wb = model.decode_chunks([a, b], [codes[..., 3 + 10 * i:13 + 10 * i], other[..., 10 * i:10 * i + 10]])
        outs_a.append(wa)
        outs_b.append(wb)
    outs_b += model.decode_chunks([b], [other[..., 30:33]])  # unequal lengths take the one-by-one path
    assert (a.frames_done, b.frames_done) == (33, 33)
    torch.testing.assert_close(torch.cat(outs_a, -1), a_alone, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat(outs_b, -1), b_alone, rtol=0, atol=ATOL)


def test_mixed_lengths_and_batch_sizes(model, codes):
    pair = torch.cat([codes, rand_codes(FRAMES, seed=9)], dim=0)
    s1, s2, s3 = model.start_stream(), model.start_stream(2), model.start_stream()
    w1, w2, w3 = decode_chunks(model, [s1, s2, s3], [codes[..., :4], pair[..., :4], codes[..., :6]])
    assert w1.shape == (1, 1, 4 * SPF) and w2.shape == (2, 1, 4 * SPF) and w3.shape == (1, 1, 6 * SPF)
    torch.testing.assert_close(w2, model(pair[..., :4]), rtol=0, atol=ATOL)
    torch.testing.assert_close(w1, w2[:1], rtol=0, atol=ATOL)
    torch.testing.assert_close(w3, model(codes[..., :6]), rtol=0, atol=ATOL)
    with pytest.raises(InputError, match="twice"):
        decode_chunks(model, [s1, s1], [codes[..., :1], codes[..., :1]])


def test_reset_and_free(model, codes):
    st = model.start_stream()
    first = model.decode_chunk(st, codes[..., :5])
    model.decode_chunk(st, codes[..., 5:9])
    st.reset()
    assert st.frames_done == 0
    torch.testing.assert_close(model.decode_chunk(st, codes[..., :5]), first, rtol=0, atol=0)
    st.free()
    assert st.is_freed
    with pytest.raises(InputError, match="freed"):
        model.decode_chunk(st, codes[..., :1])


def test_state_checks(model, codes):
    st = model.start_stream(2)
    with pytest.raises(InputError, match=r"\[2, 16, F\]"):
        model.decode_chunk(st, codes[..., :1])
    other = tiny_model(seed=3)
    with pytest.raises(InputError, match="another"):
        other.decode_chunk(model.start_stream(), codes[..., :1])
    bad = model.start_stream()
    with pytest.raises(InputError):
        model.decode_chunk(bad, torch.full((1, 16, 2), 99))
    assert bad.frames_done == 0  # a failed chunk leaves the state unchanged
    torch.testing.assert_close(model.decode_chunk(bad, codes[..., :2]), model(codes[..., :2]), rtol=0, atol=0)


def test_chunk_schedule():
    assert ChunkSchedule(1, (2, 4, 8, 16), 25).sizes(60) == [1, 2, 4, 8, 16, 25, 4]
    assert ChunkSchedule().sizes(51) == [1, 25, 25]
    assert ChunkSchedule(0, (), 25).sizes(50) == [25, 25]
    assert ChunkSchedule(4, (4, 8), 25).sizes(3) == [3]
    assert ChunkSchedule().sizes(0) == []
    s = ChunkSchedule(1, [2, 4], 25)
    assert s.ramp == (2, 4) and [s.chunk_frames(i) for i in range(5)] == [1, 2, 4, 25, 25]
    for total in range(0, 80, 7):
        assert sum(s.sizes(total)) == total
    for bad in (dict(first_frames=-1), dict(steady_frames=0), dict(ramp=(3, 0))):
        with pytest.raises(InputError):
            ChunkSchedule(**bad)


def test_one_chunk_rule_for_the_pipeline_and_the_profile():
    """``ChunkSchedule`` (what the pipeline streams with) and ``profiles.cost.chunk_schedule`` (the deploy
    profile's ``chunk_sizes`` and the playback simulation) are one rule. They disagreed on ``first_frames=0``
    (``[0, 25, 25]`` against ``[25, 25]``): 0 skips the first chunk, no chunk is empty."""
    import random

    from omnilab.profiles.cost import chunk_schedule

    assert chunk_schedule(0, (), 25, 50) == ChunkSchedule(0, (), 25).sizes(50) == [25, 25]
    rng = random.Random(13)
    cases = [(f, r, s, t) for f in (0, 1, 2) for r in ((), (2,), (2, 4, 8)) for s in (1, 3, 25) for t in range(0, 40)]
    cases += [(rng.randint(0, 30), tuple(rng.randint(1, 30) for _ in range(rng.randint(0, 5))), rng.randint(1, 50),
               rng.randint(0, 500)) for _ in range(2000)]
    for first, ramp, steady, total in cases:
        s = ChunkSchedule(first, ramp, steady)
        sizes = s.sizes(total)
        assert sizes == chunk_schedule(first, ramp, steady, total), (first, ramp, steady, total)
        assert sum(sizes) == total and all(n >= 1 for n in sizes), (first, ramp, steady, total)
        # every chunk but the (cut) last is the unbounded stream's chunk of that index
        assert sizes[:-1] == [s.chunk_frames(i) for i in range(len(sizes) - 1)]
