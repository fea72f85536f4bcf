"""The tracked text speaks of the project only, and the user documents' links and paths resolve.

- Words about how the work was organised (ordinal labels of sessions, tracker issue numbers, who did what) are
  refused in every tracked text file; a code identifier that legitimately uses such a word passes through the
  narrow ``ALLOWED`` list (path, the exact text).
- Every relative link in README.md and docs/*.md names a file of the repository (and, for a Markdown target with
  ``#anchor``, one of its headings); every backquoted path that looks like a repository file exists.
- No tracked document, data file or fixture names one machine's directories.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-[a-z]+|thirtieth")
FORBIDDEN = {
    "ordinal session": rf"\b(?:{_ORDINALS})\s+sessions?\b",
    "session as a story": r"\b(?:this|that|same|one|earlier|later|previous|next|a|each|every)\s+session\b",
    "tracker issue number": r"\bissues?[-_ ]?#?\d+",
    "the tracker's issue": r"\bthe issue(?:'s)?\b",
    "work organisation": r"\b(?:engineers?|the lead|sub-?agents?|helper (?:session|agent)s?|project brief|tracker)\b",
}
# (path, exact text of the match's line that may contain the word): identifiers, not stories
ALLOWED: set[tuple[str, str]] = set()
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".sh", ".json", ".csv", ".cpp",
                 ".h", ""}
SKIP = {"LICENSE", "tests/test_project_text.py"}  # the licence's own words; this file names the words it refuses


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _text_files() -> list[str]:
    files = [p for p in _tracked() if p not in SKIP and Path(p).suffix in TEXT_SUFFIXES and (REPO / p).is_file()]
    assert files, "git ls-files listed no text files"
    return files


def _read(path: str) -> str | None:
    try:
        return (REPO / path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def test_no_words_about_how_the_work_was_organised():
    hits = []
    patterns = {name: re.compile(rx, re.IGNORECASE) for name, rx in FORBIDDEN.items()}
    for path in _text_files():
        text = _read(path)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            for name, rx in patterns.items():
                m = rx.search(line)
                if m and not any(path == p and allowed in line for p, allowed in ALLOWED):
                    hits.append(f"{path}:{no}: {name}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not hits, "words about how the work was organised:\n" + "\n".join(hits)


def test_forbidden_words_are_caught():
    s, i = "session", "issue"  # spelled apart, so this file's own text does not read as a story
    samples = {f"the eighteenth {s}'s grid": "ordinal session", f"{i.title()}-14 grid": "tracker issue number",
               f"{i} 15": "tracker issue number", f"in one {s}": "session as a story",
               f"the {i}'s grid": "the tracker's issue", "other engineers' jobs": "work organisation"}
    for text, name in samples.items():
        assert re.search(FORBIDDEN[name], text, re.IGNORECASE), (text, name)
    for text in ('@pytest.fixture(scope="session")', "pipe.code2wav.open_session(rid)", "sessions: []",
                 "the first round"):
        assert not any(re.search(rx, text, re.IGNORECASE) for rx in FORBIDDEN.values()), text


# ---------------------------------------------------------------- links and paths in the user documents
# Documents other changes add; their links are checked once they exist.
PENDING_DOCS = {"docs/serving.md", "docs/testing.md"}


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "data/README.md"]


def _anchors(md: Path) -> set[str]:
    """GitHub-style anchors of the headings: lower case, punctuation dropped, spaces to '-'."""
    out = set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            title = re.sub(r"[`*_]", "", m.group(1).strip()).lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\s]+)`")
_PATHLIKE = re.compile(r"^(?:omnilab|tests|scripts|notebooks|data|docs)/[\w./\-]*\w$|^[\w\-]+\.md(?:#[\w\-]+)?$")


def _strip_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _check_target(doc: Path, target: str, problems: list[str], base: Path):
    path, _, anchor = target.partition("#")
    dest = (base / path).resolve() if path else doc
    rel = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else str(dest)
    if rel in PENDING_DOCS and not dest.exists():
        return
    if not dest.exists():
        problems.append(f"{doc.relative_to(REPO)}: {target} -> {rel} does not exist")
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        problems.append(f"{doc.relative_to(REPO)}: {target}: no heading #{anchor} in {rel}")


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_document_links_resolve(doc):
    problems: list[str] = []
    for target in _LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        _check_target(doc, target, problems, doc.parent)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_document_code_paths_exist(doc):
    """A backquoted repository path (``omnilab/...``, ``docs/x.md#anchor``, ...) names a file or folder that exists;
    a bare ``x.md`` is a sibling document. Paths with wildcards or placeholders are not paths."""
    problems: list[str] = []
    for code in _CODE.findall(_strip_code_blocks(doc.read_text(encoding="utf-8"))):
        code = code.rstrip(".,;:)")
        if not _PATHLIKE.match(code) or any(c in code for c in "*{}<>$"):
            continue
        path = code.partition("#")[0]
        if "/" not in path:  # a sibling document
            _check_target(doc, code, problems, doc.parent)
        else:
            _check_target(doc, code, problems, REPO)
    assert not problems, "\n".join(problems)


def test_no_machine_paths_in_documents_data_and_fixtures():
    rx = re.compile(r"/(?:work|root|tmp)/")
    hits = []
    for path in _tracked():
        if (path == "README.md" or path.startswith(("docs/", "data/", "tests/fixtures/"))
                or path == "tests/_reference.py"):
            text = _read(path)
            for no, line in enumerate((text or "").splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{path}:{no}: {line.strip()[:120]}")
    assert not hits, "one machine's paths:\n" + "\n".join(hits)
