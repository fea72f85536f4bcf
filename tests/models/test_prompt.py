"""Prompt construction: layout per variant/mode, exact prompt_length, dialect override, validation."""
import itertools
import warnings

import pytest
import torch

from omnilab.errors import InputError
from omnilab.models import tiny
from omnilab.models.prompt import (NEWLINE_ID, PromptRequest, build_prompt, codec_prefix_ids, prompt_length,
                                   split_chat_ids, split_ref_ids, trailing_length)
from omnilab.models.talker import Talker, init_random_

TEXT = [9707, 11, 1879, 0, 1096]
INSTRUCT = [151644, 872, 198, 40, 41, 151645, 198]


@pytest.fixture(scope="module")
def models():
    out = {}
    for variant, size in (("custom_voice", "0b6"), ("custom_voice", "1b7"), ("voice_design", "1b7"), ("base", "0b6")):
        cfg = tiny.config(variant, size)
        t = Talker(cfg)
        init_random_(t, torch.Generator().manual_seed(0))
        out[variant, size] = (cfg, t.eval())
    return out


def test_custom_voice_non_streaming_layout(models):
    cfg, t = models["custom_voice", "1b7"]
    req = PromptRequest(TEXT, speaker="Vivian", language="English")
    p = build_prompt(t, cfg, req)
    T, C = t.embed_text, t.embed_codec
    tpad, tbos, teos = T([151671])[0], T([151672])[0], T([151673])[0]
    k = [2154, 2156, 2050, 2157, 3065, 2148, 2149]
    assert codec_prefix_ids(cfg, req) == k
    n = len(TEXT)
    assert p.embeds.shape == (n + 11, cfg.talker.hidden_size)  # docs/model.md#prompt-layout: N + 11
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731
    close(p.embeds[:3], T([151644, 77091, NEWLINE_ID]))
    for i in range(5):  # tts_pad x (n-2) + codec tags and speaker
        close(p.embeds[3 + i], tpad + C([k[i]])[0])
    close(p.embeds[8], tbos + C([2148])[0])
    close(p.embeds[9:9 + n], T(TEXT) + C([2148])[0])
    close(p.embeds[9 + n], teos + C([2148])[0])
    close(p.embeds[-1], tpad + C([2149])[0])
    close(p.trailing, tpad[None])
    close(p.tts_pad, tpad)


def test_streaming_mode_moves_text_to_trailing_queue(models):
    cfg, t = models["custom_voice", "1b7"]
    p = build_prompt(t, cfg, PromptRequest(TEXT, speaker="ryan", language="auto", non_streaming_mode=False))
    assert len(p) == 3 + 5 + 1  # nothink tags (3) + speaker + pad/bos -> 5 prefix rows, then text_0 + bos
    torch.testing.assert_close(p.embeds[-1], t.embed_text(TEXT[:1])[0] + t.embed_codec([2149])[0])
    torch.testing.assert_close(p.trailing, torch.cat([t.embed_text(TEXT[1:]), t.embed_text([151673])]))


def test_prompt_length_equals_built_length(models):
    g = torch.Generator().manual_seed(0)
    checked = 0
    for (variant, size), (cfg, t) in models.items():
        langs = ["auto", "english", "chinese"]
        speakers = ["vivian", "eric", "dylan"] if variant == "custom_voice" else [None]
        for lang, spk, nsm, n_text, instr in itertools.product(langs, speakers, [None, True, False], [1, 2, 7],
                                                               [None, INSTRUCT]):
            extra = []
            if variant == "base":
                xv = torch.randn(cfg.talker.hidden_size, generator=g)
                extra = [dict(x_vector=xv)] + [
                    dict(x_vector=xv, ref_codes=torch.randint(0, 2048, (f, 16), generator=g), ref_text_ids=[5] * r)
                    for f, r in ((2, 1), (12, 3))]  # text track longer / shorter than the codec track
            for kw in extra or [{}]:
                req = PromptRequest(TEXT[:n_text] * 1, speaker=spk, language=lang, instruct_ids=instr,
                                    non_streaming_mode=nsm, **kw)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    p = build_prompt(t, cfg, req)
                assert prompt_length(cfg, req) == len(p), (variant, size, lang, spk, nsm, n_text, kw.keys())
                assert trailing_length(cfg, req) == p.trailing.shape[0]
                checked += 1
    assert checked > 100


def test_base_icl_modes(models):
    cfg, t = models["base", "0b6"]
    xv = torch.randn(cfg.talker.hidden_size)
    ref = torch.randint(0, 2048, (4, 16))
    base = dict(x_vector=xv, ref_codes=ref, ref_text_ids=[5, 6])
    # streaming, text track (2+5+1 = 8) longer than codec track (1+4 = 5): 3 text rows trail
    p = build_prompt(t, cfg, PromptRequest(TEXT, language="english", **base))
    assert p.trailing.shape[0] == 3
    head = 3 + 6  # role + (think tags 4 + x-vector + pad) prefix rows
    assert len(p) == head + 5
    torch.testing.assert_close(p.embeds[head], t.embed_text([5, 6] + TEXT)[0] + t.embed_codec([2149])[0])
    frame0 = t.embed_frame(ref[:1])[0]
    torch.testing.assert_close(p.embeds[head + 1], t.embed_text([5, 6] + TEXT)[1] + frame0)
    # the x-vector occupies the speaker slot
    torch.testing.assert_close(p.embeds[3 + 4], t.embed_text([151671])[0] + xv)
    # non-streaming: all text (+pad codec) then all codec (+tts_pad)
    p2 = build_prompt(t, cfg, PromptRequest(TEXT, language="english", non_streaming_mode=True, **base))
    assert len(p2) == head + 8 + 5 and p2.trailing.shape[0] == 1


@pytest.mark.parametrize("speaker,language,expected", [
    ("eric", "chinese", 2062), ("eric", "auto", 2062), ("dylan", "auto", 2074), ("Dylan", "Chinese", 2074),
    ("eric", "english", 2050), ("vivian", "chinese", 2055), ("vivian", "auto", None)])
def test_dialect_override(models, speaker, language, expected):
    cfg, _ = models["custom_voice", "0b6"]
    ids = codec_prefix_ids(cfg, PromptRequest(TEXT, speaker=speaker, language=language))
    if expected is None:
        assert ids[:3] == [2155, 2156, 2157]
    else:
        assert ids[:4] == [2154, 2156, expected, 2157]


def test_instruct_dropped_with_warning_where_ignored(models):
    cfg, t = models["custom_voice", "0b6"]
    req = PromptRequest(TEXT, speaker="vivian", instruct_ids=INSTRUCT)
    with pytest.warns(UserWarning, match="instruct"):
        p = build_prompt(t, cfg, req)
    assert len(p) == prompt_length(cfg, PromptRequest(TEXT, speaker="vivian"))
    cfg17, t17 = models["custom_voice", "1b7"]
    p17 = build_prompt(t17, cfg17, req)
    assert len(p17) == len(p) + len(INSTRUCT)
    torch.testing.assert_close(p17.embeds[:len(INSTRUCT)], t17.embed_text(INSTRUCT))


@pytest.mark.parametrize("variant,size,kw,field", [
    ("custom_voice", "0b6", dict(speaker="nobody"), "vivian"),          # lists accepted speakers
    ("custom_voice", "0b6", dict(), "speaker is required"),
    ("custom_voice", "0b6", dict(speaker="vivian", language="klingon"), "english"),
    ("custom_voice", "0b6", dict(speaker="vivian", language="sichuan_dialect"), "language"),
    ("voice_design", "1b7", dict(speaker="vivian"), "speaker"),
    ("base", "0b6", dict(), "x_vector is required"),
    ("base", "0b6", dict(x_vector=torch.zeros(3)), "x_vector must be"),
    ("base", "0b6", dict(x_vector=torch.zeros(64), ref_codes=torch.zeros(2, 16, dtype=torch.long)), "ref_text_ids"),
    ("base", "0b6", dict(x_vector=torch.zeros(64), ref_codes=torch.full((2, 16), 2048)), "ref_codes"),
    ("custom_voice", "0b6", dict(speaker="vivian", x_vector=torch.zeros(64)), "x_vector"),
])
def test_validation_errors_name_the_field(models, variant, size, kw, field):
    cfg, t = models[variant, size]
    with pytest.raises(InputError, match=field):
        build_prompt(t, cfg, PromptRequest(TEXT, **kw))
    with pytest.raises(InputError, match=field):
        prompt_length(cfg, PromptRequest(TEXT, **kw))


def test_empty_text_rejected(models):
    cfg, t = models["voice_design", "1b7"]
    with pytest.raises(InputError, match="text_ids"):
        build_prompt(t, cfg, PromptRequest([]))


def test_split_chat_ids(models):
    cfg, _ = models["voice_design", "1b7"]
    wrapped = [151644, 77091, 198] + TEXT + [151645, 198, 151644, 77091, 198]
    assert split_chat_ids(wrapped, cfg) == TEXT
    assert split_chat_ids(torch.tensor([wrapped]), cfg) == TEXT
    with pytest.raises(InputError, match="input_ids"):
        split_chat_ids([151644, 77091, 271] + TEXT + [151645, 198, 151644, 77091, 198], cfg)  # merged "\n\n"
    with pytest.raises(InputError, match="input_ids"):
        split_chat_ids([151644, 77091, 198, 151645, 198, 151644, 77091, 198], cfg)  # no text token
    assert split_ref_ids([151644, 77091, 198, 5, 6, 151645, 198], cfg) == [5, 6]
    with pytest.raises(InputError, match="ref_ids"):
        split_ref_ids([151644, 77091, 198, 5, 6, 151645], cfg)
