"""The registry of ``OMNILAB_*`` variables (omnilab/settings.py): it declares every variable the package, the
notebooks and the scripts name, docs/settings.md is generated from it, and ``omnilab settings`` prints each with
its value and source."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from omnilab import settings
from omnilab.cli.main import main

REPO = Path(__file__).resolve().parents[1]
NOT_VARIABLES = {"OMNILAB_CPU_"}  # a prefix quoted in text ("OMNILAB_CPU_* override"), not a variable


def _named_in(paths: list[str]) -> set[str]:
    files = subprocess.run(["git", "ls-files", "-z", *paths], cwd=REPO, capture_output=True, check=True)
    names = set()
    for p in files.stdout.decode().split("\0"):
        if p and (REPO / p).is_file():
            names |= set(re.findall(r"\bOMNILAB_[A-Z0-9_]+", (REPO / p).read_text(errors="replace")))
    return names - NOT_VARIABLES


def test_every_variable_the_code_names_is_declared_once():
    names = [s.name for s in settings.settings()]
    assert len(names) == len(set(names)), "a variable is declared twice"
    missing = _named_in(["omnilab", "notebooks", "scripts"]) - set(names)
    assert not missing, f"declare these in omnilab/settings.py: {sorted(missing)}"
    for s in settings.settings():
        assert s.kind and s.default and s.accepted and s.means and s.layer, s
        assert (REPO / s.layer).exists(), f"{s.name}: reader {s.layer} does not exist"


def test_docs_settings_is_generated_from_the_registry():
    assert (REPO / "docs/settings.md").read_text() == settings.markdown(), (
        "regenerate: python -c \"from omnilab.settings import markdown; open('docs/settings.md','w').write(markdown())\"")


def test_settings_command_prints_value_and_source(monkeypatch, capsys):
    monkeypatch.setenv("OMNILAB_HUGEPAGES", "on")
    monkeypatch.delenv("OMNILAB_OMP_RELEASE", raising=False)
    assert main(["settings", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == settings.declared()
    assert (rows["OMNILAB_HUGEPAGES"]["value"], rows["OMNILAB_HUGEPAGES"]["source"]) == ("on", "env")
    assert (rows["OMNILAB_OMP_RELEASE"]["value"], rows["OMNILAB_OMP_RELEASE"]["source"]) == ("auto", "default")
    assert main(["settings"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("OMNILAB_HUGEPAGES "))
    assert line.split()[1:3] == ["on", "env"]


def test_the_registry_is_light():
    code = "import sys, omnilab.settings as s; s.markdown(); print(sorted(m for m in ('torch', 'vllm', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
