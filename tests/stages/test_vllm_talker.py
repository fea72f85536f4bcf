"""The talker inside vLLM's CPU engine, in-process: codes equal the eager backend's (greedy for every
variant and text mode, and sampled with a seed), stop semantics, continuous batching with chunked prefill
and a forced preemption, abort, step timings, unsupported options and the Pipeline on ``backend="vllm"``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from _deps import need  # noqa: E402
import torch

need("vllm")

from omnilab.stages.eager import run_to_completion  # noqa: E402
from omnilab.errors import InputError, UnsupportedError  # noqa: E402
from omnilab.checkpoint.load import load_model  # noqa: E402
from omnilab.requests import UserRequest, build_request  # noqa: E402
from omnilab.sampling import SamplingParams  # noqa: E402
from omnilab.stages.eager import EagerTalkerStage  # noqa: E402
from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage  # noqa: E402

from _vllm_common import (TEXT, VARIANTS, eager_codes, first_difference, greedy, user_requests,  # noqa: E402
                          vllm_run)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """variant -> (LoadedModel, in-process VllmTalkerStage), built on first use."""
    made = {}

    def get(kind: str):
        if kind not in made:
            model = load_model(tiny_ckpt(kind), dtype="float32")
            made[kind] = (model, VllmTalkerStage(model, VllmStageConfig(max_model_len=256, block_size=32)))
        return made[kind]

    yield get
    for _, stage in made.values():
        stage.close()


@pytest.mark.parametrize("kind", VARIANTS)
def test_greedy_codes_equal_eager(engines, kind):
    model, stage = engines(kind)
    for ureq in user_requests(kind):
        preq, _ = build_request(model, ureq)
        ref = eager_codes(model, preq, greedy(model))
        got, outs = vllm_run(stage, preq, greedy(model))
        assert got.shape == ref.shape == (9, 16)
        assert torch.equal(got, ref), f"{kind}: vLLM codes differ from eager for {ureq}"
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert [o.frame_index for o in outs] == list(range(9))
    assert stage.summary()["states"] == []


def test_sampled_codes_equal_eager_for_same_seed(engines):
    model, stage = engines("custom_voice")
    preq, _ = build_request(model, user_requests("custom_voice")[0])
    params = SamplingParams.from_defaults(model.generation, max_new_tokens=12, seed=1234)
    got, outs = vllm_run(stage, preq, params)
    assert torch.equal(got, eager_codes(model, preq, params))
    assert all(o.seed == 1234 for o in outs)
    other, _ = vllm_run(stage, preq, SamplingParams.from_defaults(model.generation, max_new_tokens=12, seed=99))
    assert not torch.equal(got, other)


def test_stop_semantics_match_eager(engines, monkeypatch):
    """EOS forced after 4 tokens in both backends: eager reports it on the 4th frame, vLLM one step later
    with codes=None; max_new_tokens=1 yields no frame."""
    import omnilab.stages.eager as eager_mod
    import omnilab.stages.vllm.runner as runner_mod
    from omnilab.sampling import talker_scores

    def eos_after_4(logits, histories, params, eos_id):
        scores = talker_scores(logits, histories, params, eos_id)
        for b, h in enumerate(histories):
            if len(h) == 4:
                scores[b, eos_id] = math.inf
        return scores

    monkeypatch.setattr(eager_mod, "talker_scores", eos_after_4)
    monkeypatch.setattr(runner_mod, "talker_scores", eos_after_4)
    model, stage = engines("custom_voice")
    preq, _ = build_request(model, user_requests("custom_voice")[0])
    params = greedy(model, 50)
    eager = EagerTalkerStage(model)
    eager.add_request("r", preq, params)
    ref = run_to_completion(eager.engine)["r"]
    got, outs = vllm_run(stage, preq, params)
    assert ref["finish_reason"] == "eos" and torch.equal(got, ref["codes"]) and len(got) == 4
    assert outs[-1].codes is None and outs[-1].finished and outs[-1].finish_reason == "eos"
    assert outs[-1].frame_index == 4 and not any(o.finished for o in outs[:-1])
    assert stage.summary()["states"] == []

    got, outs = vllm_run(stage, preq, greedy(model, 1))
    assert len(got) == 0 and [(o.finished, o.finish_reason) for o in outs] == [(True, "length")]


def test_step_outputs_carry_timings_and_hidden(engines):
    model, stage = engines("custom_voice")
    preq, _ = build_request(model, user_requests("custom_voice")[0])
    stage.add_request("t", preq, greedy(model, 4))
    outs = []
    while stage.has_unfinished():
        outs += stage.step(return_hidden=True)
    stage.step(return_hidden=False)
    first, later = outs[0], outs[1:]
    assert first.prefill_ms > 0 and all(o.prefill_ms == 0 for o in later)
    for o in outs:
        assert o.hidden is not None and o.hidden.shape == (model.config.talker.hidden_size,)
        assert o.talker_ms > 0 and o.predictor_ms > 0 and o.input_prep_ms > 0 and o.sampling_ms > 0
        assert o.schedule_ms > 0 and o.batch_rows == 1
        inside = o.input_prep_ms + o.talker_ms + o.predictor_ms
        assert inside <= o.step_ms * 1.05 + 1.0
    # the hidden state that produced c0 is the one the eager engine reports
    eager = EagerTalkerStage(model)
    eager.add_request("t", preq, greedy(model, 4))
    ref = run_to_completion(eager.engine, return_hidden=True)["t"]["hidden"]
    torch.testing.assert_close(torch.stack([o.hidden for o in outs]), ref.float(), atol=1e-4, rtol=1e-4)


def test_abort_frees_state_and_engine_stays_usable(engines):
    model, stage = engines("custom_voice")
    preq, _ = build_request(model, user_requests("custom_voice")[0])
    stage.add_request("gone", preq, greedy(model, 40))
    for _ in range(3):
        stage.step()
    internal_id = stage._live["gone"].int_id
    assert internal_id in stage.runner.tts_states
    out = stage.abort("gone")
    assert out.finished and out.finish_reason == "abort" and out.codes is None
    assert stage.abort("gone") is None and not stage.has_unfinished()
    assert stage.runner.tts_states == {}
    got, _ = vllm_run(stage, preq, greedy(model))
    assert torch.equal(got, eager_codes(model, preq, greedy(model)))
    assert stage.runner.tts_states == {} and internal_id not in stage.summary()["vllm_requests"]
    with pytest.raises(InputError, match="already running"):
        stage.add_request("x", preq, greedy(model))
        stage.add_request("x", preq, greedy(model))
    stage.abort("x")


def test_unsupported_options_say_so(engines):
    with pytest.raises(UnsupportedError, match="sleep mode"):
        VllmStageConfig(engine_kwargs={"enable_sleep_mode": True})
    with pytest.raises(UnsupportedError, match="CUDA graphs"):
        VllmStageConfig(engine_kwargs={"cudagraph_capture_sizes": [1, 2]})
    _, stage = engines("custom_voice")
    with pytest.raises(UnsupportedError, match="not supported on CPU"):
        stage.sleep()
    with pytest.raises(UnsupportedError, match="not supported on CPU"):
        stage.worker.sleep()
    with pytest.raises(InputError, match="multiple of 32"):
        VllmStageConfig(block_size=48)


CONCURRENT_TEXTS = ["Hi.", "Hello world, this is a somewhat longer test sentence.", "Short one here.",
                    "A much longer sentence that goes on and on to make the prompt considerably longer."]


def _run_many(stage, items, arrivals):
    """-> {request: (codes [T, 16], final-norm hidden [T, H])}."""
    codes = {k: [] for k in range(len(items))}
    hidden = {k: [] for k in range(len(items))}
    done, step = set(), 0
    while len(done) < len(items):
        for k, a in enumerate(arrivals):
            if a == step:
                stage.add_request(k, *items[k])
        for o in stage.step(return_hidden=True) if stage.has_unfinished() else []:
            if o.codes is not None:
                codes[o.request_id].append(torch.as_tensor(o.codes))
                hidden[o.request_id].append(torch.as_tensor(o.hidden).float())
            if o.finished:
                done.add(o.request_id)
        step += 1
    return {k: (torch.stack(codes[k]), torch.stack(hidden[k])) for k in codes}


@pytest.mark.slow
def test_concurrent_requests_with_chunked_prefill_and_preemption_equal_solo(confident_tiny):
    """4 requests (prompts 13..31 positions) arriving at steps 0, 1, 3, 4; prefill chunks of 16 tokens and
    only 5 KV blocks of 32 tokens, so the scheduler must preempt and recompute. Greedy on the confident tiny
    checkpoint (margins far above fp32 rounding, docs/quality.md#confident-random-checkpoints): every request gives
    its solo codes exactly, 19 to 29 frames. The code predictor runs row by row here: fp32 GEMMs over 1 vs several
    rows round differently."""
    model = load_model(confident_tiny(), dtype="float32")
    cfg = VllmStageConfig(max_model_len=96, block_size=32, num_gpu_blocks_override=5, max_num_batched_tokens=16,
                          predictor_per_row=True)
    with VllmTalkerStage(model, cfg) as stage:
        items = []
        for j, text in enumerate(CONCURRENT_TEXTS):
            preq, _ = build_request(model, UserRequest(text=text, speaker="vivian", language="english"))
            items.append((preq, greedy(model, [30, 20, 26, 24][j])))
        solo = {k: _run_many(stage, [items[k]], [0])[0] for k in range(4)}
        before = stage.summary()
        together = _run_many(stage, items, [0, 1, 3, 4])
        after = stage.summary()
        assert after["resumed"] > before["resumed"], "no request was preempted"
        assert after["partial_prefills"] > before["partial_prefills"], "no prompt was prefilled in chunks"
        for k in range(4):
            (c1, h1), (c2, _) = solo[k], together[k]
            assert len(c1) == items[k][1].max_new_tokens - 1 >= 16
            assert c1.shape == c2.shape and torch.equal(c1, c2), \
                f"request {k} differs when batched with others: {first_difference(model, c1, h1, c2, items[k][1])}"
        assert after["states"] == []


def test_pipeline_vllm_backend_matches_eager(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    kw = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=9)
    with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32") as eager:
        ref = eager.generate(TEXT, **kw)
        ref_stream = np.concatenate([c.audio for c in eager.stream(TEXT, **kw)])
    with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="vllm", dtype="float32") as pipe:
        assert pipe.backend == "vllm"
        res = pipe.generate(TEXT, **kw)
        np.testing.assert_array_equal(res.codes, ref.codes)
        np.testing.assert_array_equal(res.audio, ref.audio)
        chunks = list(pipe.stream(TEXT, **kw))
        sizes = pipe.profile.chunk_sizes(8)  # the plan's schedule (first chunk, ramp, steady) over the 8 frames
        ends = np.cumsum(sizes).tolist()
        assert [(c.frame_start, c.frame_end) for c in chunks] == list(zip([0] + ends[:-1], ends)) and chunks[-1].is_last
        assert sizes[0] == 1 and len(chunks) >= 2  # audio starts after one frame
        np.testing.assert_array_equal(np.concatenate([c.audio for c in chunks]), ref_stream)
        # step-wise
        rid = pipe.talker.start(TEXT, **kw)
        frames, step_ids = [], []
        while pipe.talker.has_unfinished():
            outs = pipe.talker.step()
            step_ids.append((set(outs), {o.request_id for o in outs.values()}))
            frames += [o.codes for o in outs.values() if o.codes is not None]
        np.testing.assert_array_equal(torch.stack(frames).numpy(), ref.codes)
        # cancelling a stream aborts it: no talker or decoder state left, next request unaffected
        it = pipe.stream(TEXT, **dict(kw, max_new_tokens=40))
        next(it)
        it.close()
        assert pipe.talker.num_live == 0 and pipe.code2wav.num_sessions == 0
        assert pipe._talker.runner.tts_states == {}
        np.testing.assert_array_equal(pipe.generate(TEXT, **kw).codes, ref.codes)
        # the id start() returned keys every step's output (one FrameOutput per live request), has the
        # pipeline's form, and is not one of the earlier requests' ids
        assert rid.startswith("req-") and rid[4:].isdigit()
        assert step_ids and all(ids == ({rid}, {rid}) for ids in step_ids)
        assert rid not in {res.request_id, chunks[0].request_id} and res.request_id != chunks[0].request_id
    with pytest.raises(InputError, match="closed"):
        pipe.generate(TEXT, **kw)
