"""Eager talker engine: batching independence, stop rules, seeds, abort, hidden states."""
import pytest
import torch

from omnilab.errors import InputError
from omnilab.models import tiny
from omnilab.models.prompt import PromptRequest, build_prompt
from omnilab.models.talker import Talker, init_random_
from omnilab.stages.eager import EagerTalkerEngine, run_to_completion
from omnilab.sampling import SamplingParams

GREEDY = dict(do_sample=False, subtalker_do_sample=False)


@pytest.fixture(scope="module")
def model():
    cfg = tiny.config("custom_voice", "1b7", hidden=96)  # predictor projection path too
    t = Talker(cfg)
    init_random_(t, torch.Generator().manual_seed(0))
    return cfg, t.eval()


def prompt(model, text=(9707, 11, 1879), speaker="vivian", **kw):
    cfg, t = model
    return build_prompt(t, cfg, PromptRequest(list(text), speaker=speaker, language="english", **kw))


def solo(model, p, params, **engine_kw):
    e = EagerTalkerEngine(model[1], model[0], **engine_kw)
    e.add_request("x", p, params)
    return run_to_completion(e, return_hidden=True)["x"]


@pytest.mark.parametrize("batched", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_request_alone_equals_request_among_others(model, batched):
    cfg, t = model
    target = prompt(model, non_streaming_mode=False)  # streaming: trailing text queue in use
    params = SamplingParams(max_new_tokens=12, **GREEDY)
    alone = solo(model, target, params, batched=batched)
    e = EagerTalkerEngine(t, cfg, batched=batched)
    e.add_request("other1", prompt(model, text=(5, 6, 7, 8, 9, 10), speaker="ryan"), params)
    e.step()
    e.step()
    e.add_request("target", target, params)
    first = [o for o in e.step(return_hidden=True) if o.request_id == "target"]
    assert len(first) == 1 and first[0].frame_index == 0
    e.add_request("other2", prompt(model, text=(42,), speaker="eric"), SamplingParams(max_new_tokens=30, seed=1))
    got = run_to_completion(e, return_hidden=True)["target"]
    codes = torch.cat([first[0].codes[None], got["codes"]])
    hidden = torch.cat([first[0].hidden[None], got["hidden"]])
    assert torch.equal(codes, alone["codes"])
    assert got["finish_reason"] == "length"
    if batched:
        torch.testing.assert_close(hidden, alone["hidden"], rtol=1e-5, atol=1e-5)
    else:  # rows run one by one: bitwise independent of batch mates
        assert torch.equal(hidden, alone["hidden"])


def test_max_new_tokens_counts_talker_tokens_like_hf(model):
    p = prompt(model)
    for n in (2, 5):
        out = solo(model, p, SamplingParams(max_new_tokens=n, **GREEDY))
        assert out["codes"].shape == (n - 1, 16) and out["finish_reason"] == "length"
    e = EagerTalkerEngine(model[1], model[0])
    e.add_request("one", p, SamplingParams(max_new_tokens=1))
    (o,) = e.step()
    assert o.codes is None and o.finished and o.finish_reason == "length" and not e.has_unfinished()


def test_eos_stops_and_min_new_tokens_respected(model):
    cfg, t = model
    t2 = Talker(cfg)
    t2.load_state_dict(t.state_dict())
    head = torch.nn.Linear(cfg.talker.hidden_size, cfg.talker.vocab_size, bias=True)
    with torch.no_grad():  # same head plus a huge EOS bias: EOS wins as soon as it is allowed
        head.weight.copy_(t.codec_head.weight)
        head.bias.zero_()
        head.bias[cfg.talker.codec_eos_token_id] = 1e4
    t2.codec_head = head
    m2 = (cfg, t2.eval())
    p = build_prompt(t2, cfg, PromptRequest([9707, 11], speaker="vivian"))
    for min_new in (2, 4):
        out = solo(m2, p, SamplingParams(max_new_tokens=50, min_new_tokens=min_new, **GREEDY))
        assert out["finish_reason"] == "eos" and out["codes"].shape == (min_new, 16)
        assert int(out["codes"][:, 0].max()) < 2048
    e = EagerTalkerEngine(t2, cfg)
    e.add_request("z", p, SamplingParams(max_new_tokens=50, min_new_tokens=0, **GREEDY))
    (o,) = e.step()
    assert o.codes is None and o.finish_reason == "eos" and e.kv_bytes == 0


def test_seeds_reproduce_and_are_reported(model):
    p = prompt(model)
    a = solo(model, p, SamplingParams(max_new_tokens=6, seed=11))
    b = solo(model, p, SamplingParams(max_new_tokens=6, seed=11))
    c = solo(model, p, SamplingParams(max_new_tokens=6, seed=12))
    assert a["seed"] == 11 and torch.equal(a["codes"], b["codes"]) and not torch.equal(a["codes"], c["codes"])
    r = solo(model, p, SamplingParams(max_new_tokens=6))
    again = solo(model, p, SamplingParams(max_new_tokens=6, seed=r["seed"]))
    assert torch.equal(r["codes"], again["codes"])


def test_abort_frees_state(model):
    cfg, t = model
    e = EagerTalkerEngine(t, cfg)
    params = SamplingParams(max_new_tokens=100, **GREEDY)
    e.add_request("a", prompt(model), params)
    e.add_request("b", prompt(model), params)
    e.step()
    assert e.num_live == 2 and e.kv_bytes > 0
    kv_two = e.kv_bytes
    o = e.abort("a")
    assert o.finished and o.finish_reason == "abort" and o.codes is None
    assert e.num_live == 1 and e.kv_bytes == kv_two // 2
    assert [x.request_id for x in e.step()] == ["b"]
    assert e.abort("a") is None
    e.add_request("c", prompt(model), params)
    assert e.abort("c").finish_reason == "abort"  # aborted before its prefill
    e.abort("b")
    assert not e.has_unfinished() and e.kv_bytes == 0 and e.step() == []


def test_outputs_carry_hidden_timings_and_reject_bad_input(model):
    cfg, t = model
    p = prompt(model)
    e = EagerTalkerEngine(t, cfg)
    e.add_request("h", p, SamplingParams(max_new_tokens=5, **GREEDY))
    (o,) = e.step(return_hidden=True)
    h0 = t(p.embeds[None])[0, -1]
    torch.testing.assert_close(o.hidden, h0, rtol=1e-5, atol=1e-5)
    assert o.frame_index == 0 and o.codes.shape == (16,) and o.prefill_ms > 0 and o.predictor_ms > 0
    assert o.talker_ms > 0 and o.sampling_ms >= 0
    (o2,) = e.step()
    assert o2.frame_index == 1 and o2.prefill_ms == 0 and o2.hidden is None
    with pytest.raises(InputError, match="already running"):
        e.add_request("h", p, SamplingParams())
    with pytest.raises(InputError, match="temperature"):
        e.add_request("bad", p, SamplingParams(temperature=0.0))
    with pytest.raises(InputError, match="max_new_tokens"):
        EagerTalkerEngine(t, cfg, max_new_tokens_limit=10).add_request("big", p, SamplingParams(max_new_tokens=11))
