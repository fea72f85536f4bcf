"""The frame recurrence (omnilab.models.frame.next_frames): its contract on the tiny model, and that both talker
engines (eager and the vLLM runner) really run it."""
from __future__ import annotations

import pytest

from _deps import need  # noqa: E402
import torch

from omnilab.models import frame, tiny
from omnilab.models.prompt import Prompt
from omnilab.models.talker import Talker, init_random_
from omnilab.sampling import SamplingParams

SAMPLED = SamplingParams(subtalker_do_sample=True, subtalker_temperature=0.9, subtalker_top_k=50)
GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False)


@pytest.fixture(scope="module", params=[64, 96], ids=["0.6b-like", "1.7b-like"])
def talker(request):
    t = Talker(tiny.config("custom_voice", hidden=request.param))  # 96: small_to_mtp_projection path too
    init_random_(t, torch.Generator().manual_seed(0))
    return t.eval()


def _rows(t: Talker, b: int, seed: int = 0):
    """b rows: hidden [B, H], c0 [B], prompts with 3 trailing text vectors each."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t.hidden_size, generator=g)
    c0 = torch.randint(0, 2048, (b,), generator=g)
    prompts = [Prompt(torch.randn(5, t.hidden_size, generator=g), torch.randn(3, t.hidden_size, generator=g),
                      torch.randn(t.hidden_size, generator=g)) for _ in range(b)]
    return h, c0, prompts


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_shapes_codes_and_next_inputs(talker):
    h, c0, prompts = _rows(talker, 4)
    ks = [0, 2, 3, 7]  # trailing[0], trailing[2], then tts_pad (queue of 3 used up)
    fs = frame.next_frames(talker, h, c0, prompts, ks, [SAMPLED] * 4, _gens([1, 2, 3, 4]))
    assert fs.codes.shape == (4, 16) and fs.codes.dtype == torch.long
    assert torch.equal(fs.codes[:, 0], c0) and int(fs.codes[:, 1:].max()) < 2048 and int(fs.codes.min()) >= 0
    assert fs.inputs.shape == (4, talker.hidden_size) and fs.inputs.dtype == talker.dtype
    assert fs.input_rows == (0, 1, 2, 3)
    text = torch.stack([prompts[0].trailing[0], prompts[1].trailing[2], prompts[2].tts_pad, prompts[3].tts_pad])
    assert torch.equal(fs.inputs, talker.embed_frame(fs.codes) + text)  # same ops: equal by construction
    assert fs.predictor_ms >= fs.sampling_ms > 0.0 and fs.input_ms >= 0.0
    # the code predictor part is CodePredictor.generate on (h, C(c0)) with each row's generator, drawn in order
    rest = talker.code_predictor.generate(h, talker.model.codec_embedding(c0), [SAMPLED.subtalker_warp] * 4,
                                          _gens([1, 2, 3, 4]))
    assert torch.equal(fs.codes[:, 1:], rest)


def test_need_input_selects_rows(talker):
    h, c0, prompts = _rows(talker, 3)
    fs = frame.next_frames(talker, h, c0, prompts, [0, 1, 5], [GREEDY] * 3, [None] * 3,
                           need_input=[True, False, True])
    assert fs.codes.shape == (3, 16) and fs.input_rows == (0, 2) and fs.inputs.shape == (2, talker.hidden_size)
    assert torch.equal(fs.inputs, talker.embed_frame(fs.codes[[0, 2]])
                       + torch.stack([prompts[0].trailing[0], prompts[2].tts_pad]))
    none = frame.next_frames(talker, h, c0, prompts, [0, 1, 5], [GREEDY] * 3, [None] * 3, need_input=[False] * 3)
    assert none.inputs.shape == (0, talker.hidden_size) and none.input_rows == ()
    empty = frame.next_frames(talker, h[:0], c0[:0], [], [], [], [])
    assert empty.codes.shape == (0, 16) and empty.inputs.shape == (0, talker.hidden_size)
    with pytest.raises(ValueError, match="3 rows"):
        frame.next_frames(talker, h, c0, prompts[:2], [0, 1], [GREEDY] * 2, [None] * 2)


def test_per_row_result_does_not_depend_on_batch_mates(talker):
    """per_row=True: every row runs alone, so its codes, input vector and generator stream are bitwise those of
    the row run by itself, whatever its batch mates (sampling, each row with its own seed)."""
    h, c0, prompts = _rows(talker, 3)
    params = [SAMPLED, GREEDY, SAMPLED]
    gens = _gens([11, 12, 13])
    together = frame.next_frames(talker, h, c0, prompts, [0, 1, 4], params, gens, per_row=True)
    for i, k in enumerate([0, 1, 4]):
        g = torch.Generator().manual_seed(11 + i)
        alone = frame.next_frames(talker, h[i:i + 1], c0[i:i + 1], prompts[i:i + 1], [k], params[i:i + 1], [g])
        assert torch.equal(together.codes[i], alone.codes[0]), i
        assert torch.equal(together.inputs[i], alone.inputs[0]), i
        assert torch.equal(gens[i].get_state(), g.get_state()), f"row {i} drew a different number of times"
    g = torch.Generator().manual_seed(11)  # row 0 again, with other mates (hidden, c0, frame, params)
    mixed_h = torch.cat([h[:1], torch.randn(2, talker.hidden_size)])
    mixed = frame.next_frames(talker, mixed_h, torch.cat([c0[:1], c0[1:].flip(0)]), prompts, [0, 3, 3],
                              [SAMPLED, SAMPLED, GREEDY], [g, None, None], per_row=True)
    assert torch.equal(mixed.codes[0], together.codes[0]) and torch.equal(mixed.inputs[0], together.inputs[0])


# ---- both engines run it ---------------------------------------------------------------------------------------
@pytest.fixture
def counted(monkeypatch):
    """Count calls (and frames) through omnilab.models.frame.next_frames."""
    calls: list[int] = []
    real = frame.next_frames

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out.codes.shape[0])
        return out

    monkeypatch.setattr(frame, "next_frames", wrapper)
    return calls


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    from omnilab.checkpoint.load import load_model
    from omnilab.requests import UserRequest, build_request

    model = load_model(tiny_ckpt("custom_voice"), dtype="float32")
    preq, _ = build_request(model, UserRequest(text="Hello there.", speaker="vivian", language="english",
                                               non_streaming_mode=False))
    params = SamplingParams.from_defaults(model.generation, do_sample=False, subtalker_do_sample=False,
                                          max_new_tokens=4)  # 3 frames
    return model, preq, params


def _run(stage, preq, params) -> torch.Tensor:
    stage.add_request("r", preq, params)
    codes = []
    while stage.has_unfinished():
        codes += [o.codes for o in stage.step() if o.codes is not None]
    return torch.stack(codes)


def test_eager_engine_runs_the_frame_recurrence(loaded, counted):
    from omnilab.stages.eager import EagerTalkerStage

    model, preq, params = loaded
    codes = _run(EagerTalkerStage(model), preq, params)
    assert codes.shape == (3, 16) and counted == [1, 1, 1]


@pytest.mark.vllm
def test_vllm_runner_runs_the_frame_recurrence(loaded, counted):
    need("vllm")
    from omnilab.stages.eager import EagerTalkerStage
    from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage

    model, preq, params = loaded
    with VllmTalkerStage(model, VllmStageConfig(max_model_len=256, block_size=32)) as stage:  # in-process
        codes = _run(stage, preq, params)
    assert codes.shape == (3, 16) and sum(counted) == 3 and len(counted) == 3
    counted.clear()
    assert torch.equal(codes, _run(EagerTalkerStage(model), preq, params)) and counted == [1, 1, 1]
