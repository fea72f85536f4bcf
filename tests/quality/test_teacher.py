"""Teacher forcing (omnilab/quality/teacher.py): replaying an eager greedy run on its own model returns its own
codes exactly (same ops, shapes and threads as the eager engine, in one process: equal by construction), the
stop step sees EOS where the run stopped, the processed scores are ``talker_scores`` of the raw logits, and a
talker that lives in a worker process is refused with a clear error.
(Base ICL replay: tests/quality/test_compare.py.)"""
from __future__ import annotations

import types

import pytest
import torch

from omnilab.errors import InputError, UnsupportedError
from omnilab.quality.teacher import forcing_talker, teacher_force
from omnilab.requests import UserRequest, build_request
from omnilab.sampling import SamplingParams, talker_scores

from _quality_common import GEN, TEXTS, eos_pipe, load_pipe  # noqa: F401  (fixtures)

GREEDY = dict(do_sample=False, subtalker_do_sample=False)


def _force(pipe, text, res, stop_step=False, raw=False, **req):
    preq = build_request(pipe.model, UserRequest(text=text, **req), warn=False)[0]
    params = SamplingParams.from_defaults(pipe.model.generation, max_new_tokens=GEN["max_new_tokens"], **GREEDY)
    codes = torch.as_tensor(res.codes)
    return teacher_force(pipe.model.talker, pipe.model.config, preq, codes, params, stop_step=stop_step, raw=raw)


@pytest.mark.parametrize("text", TEXTS)
def test_replay_of_an_eager_greedy_run_returns_its_codes(tiny_pipe, text):
    res = tiny_pipe.generate(text, **GEN, **GREEDY)
    f = _force(tiny_pipe, text, res, speaker="vivian", language="english")
    assert f.frames == len(res.codes) == GEN["max_new_tokens"] - 1 and f.stop_scores is None
    assert torch.equal(f.argmax, torch.as_tensor(res.codes))


def test_stop_step_scores_the_eos_the_run_stopped_on(eos_pipe):
    res = eos_pipe.generate(TEXTS[0], **GEN, **GREEDY)
    assert res.finish_reason == "eos" and len(res.codes) == 2
    f = _force(eos_pipe, TEXTS[0], res, stop_step=True, speaker="vivian", language="english")
    assert torch.equal(f.argmax, torch.as_tensor(res.codes))
    assert int(f.stop_scores.argmax()) == eos_pipe.model.config.talker.codec_eos_token_id


def test_processed_scores_are_talker_scores_of_the_raw_logits(tiny_pipe):
    res = tiny_pipe.generate(TEXTS[1], **GEN, **GREEDY)
    raw = _force(tiny_pipe, TEXTS[1], res, raw=True, speaker="vivian", language="english")
    done = _force(tiny_pipe, TEXTS[1], res, speaker="vivian", language="english")
    params = SamplingParams.from_defaults(tiny_pipe.model.generation, **GREEDY)
    eos = tiny_pipe.model.config.talker.codec_eos_token_id
    codes = torch.as_tensor(res.codes)
    for t in range(len(codes)):  # same fp32 ops on the same logits: exact
        want = talker_scores(raw.c0_scores[t:t + 1], [codes[:t, 0]], [params], eos)
        assert torch.equal(done.c0_scores[t:t + 1], want)
    assert torch.isinf(done.c0_scores[:, 2048:]).sum() > 0 and torch.isfinite(raw.c0_scores).all()


def test_a_talker_in_a_worker_process_is_refused():
    pipe = types.SimpleNamespace(model=types.SimpleNamespace(talker=None), backend="vllm")
    with pytest.raises(UnsupportedError, match="deploy='inprocess'"):
        forcing_talker(pipe)


def test_bad_codes_and_sampling_are_refused(tiny_pipe):
    m = tiny_pipe.model
    preq = build_request(m, UserRequest(text=TEXTS[0], speaker="vivian"))[0]
    greedy = SamplingParams.from_defaults(m.generation, **GREEDY)
    with pytest.raises(InputError, match=r"\[T, 16\]"):
        teacher_force(m.talker, m.config, preq, torch.zeros(3, 15, dtype=torch.long), greedy)
    with pytest.raises(InputError, match="do_sample=False"):
        teacher_force(m.talker, m.config, preq, torch.zeros(3, 16, dtype=torch.long),
                      SamplingParams.from_defaults(m.generation))
