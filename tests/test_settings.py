"""The registry of ``OMNILAB_*`` variables (omnilab/settings.py): it declares every variable the package, the
notebooks and the scripts name, docs/settings.md is generated from it, and ``omnilab settings`` prints each with
its value and source."""
from __future__ import annotations

import ast
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


# ---- every module reads its OMNILAB_* variables through settings.raw / settings.flag ---------------------------
def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to an ``OMNILAB_*`` string (``ENV = "OMNILAB_X"``, ``A, B = "OMNILAB_A", ...``)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                pairs = (zip(t.elts, node.value.elts) if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                         else [(t, node.value)])
                for name, value in pairs:
                    if (isinstance(name, ast.Name) and isinstance(value, ast.Constant)
                            and isinstance(value.value, str) and value.value.startswith("OMNILAB_")):
                        out[name.id] = value.value
    return out


def _module_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def direct_reads(sources: dict[str, str]) -> list[str]:
    """``file:line NAME`` for each read of an ``OMNILAB_*`` variable that bypasses the registry in ``sources``
    (module name -> text): ``os.environ[...]``, ``os.getenv(...)``, ``<mapping>.get(...)`` or ``<mapping>[...]``
    whose key is an ``OMNILAB_*`` literal or a constant naming one (this module's, imported, or ``module.NAME``)."""
    trees = {m: ast.parse(text) for m, text in sources.items()}
    consts = {m: _constants(t) for m, t in trees.items()}
    found = []
    for mod, tree in trees.items():
        names, modules = dict(consts[mod]), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if a.name in consts.get(node.module, {}):
                        names[a.asname or a.name] = consts[node.module][a.name]
                    elif f"{node.module}.{a.name}" in consts:
                        modules[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in consts:
                        modules[a.asname] = a.name

        def key(expr):
            if isinstance(expr, ast.Constant) and isinstance(expr.value, str) and expr.value.startswith("OMNILAB_"):
                return expr.value
            if isinstance(expr, ast.Name):
                return names.get(expr.id)
            if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in modules:
                return consts[modules[expr.value.id]].get(expr.attr)
            return None

        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Call) and node.args:
                f = node.func
                if ((isinstance(f, ast.Attribute) and f.attr in ("get", "getenv"))
                        or (isinstance(f, ast.Name) and f.id == "getenv")):
                    name = key(node.args[0])
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                name = key(node.slice)
            if name:
                found.append((mod.replace(".", "/") + ".py", node.lineno, name))
    return [f"{f}:{line} {name}" for f, line, name in sorted(set(found))]


def test_the_scanner_finds_direct_reads():
    snippet = {
        "pkg.a": 'import os\nENV = "OMNILAB_X"\nA, B = "OMNILAB_A", "OMNILAB_B"\n'
                 'def f(env=None):\n'
                 '    os.environ.get(ENV)\n'           # 5
                 '    os.getenv("OMNILAB_Y")\n'        # 6
                 '    os.environ["OMNILAB_Z"]\n'       # 7
                 '    (env or os.environ).get(B, "")\n'  # 8
                 '    os.environ["OMNILAB_W"] = "1"\n'   # a write: fine
                 '    os.environ.get("VLLM_CPU_X")\n',   # vLLM's own: fine
        "pkg.b": 'from pkg.a import ENV as E\nfrom pkg import a\ndef g(cfg):\n'
                 '    cfg.env.get(E)\n'                # 4
                 '    return a.A, {}.get(a.A)\n',      # 5
    }
    assert direct_reads(snippet) == ["pkg/a.py:5 OMNILAB_X", "pkg/a.py:6 OMNILAB_Y", "pkg/a.py:7 OMNILAB_Z",
                                     "pkg/a.py:8 OMNILAB_B", "pkg/b.py:4 OMNILAB_X", "pkg/b.py:5 OMNILAB_A"]


def test_no_module_reads_an_omnilab_variable_directly():
    sources = {_module_of(p, REPO): p.read_text() for p in sorted((REPO / "omnilab").rglob("*.py"))
               if p != REPO / "omnilab" / "settings.py"}
    found = direct_reads(sources)
    assert not found, ("read these through omnilab.settings.raw / flag (the registry), not the environment "
                       "directly:\n" + "\n".join(found))


def test_raw_refuses_an_undeclared_name_and_reads_a_mapping(monkeypatch):
    import pytest
    from omnilab.errors import ConfigError

    with pytest.raises(ConfigError, match="OMNILAB_NOT_A_SETTING.*accepted: a name declared in omnilab/settings.py"):
        settings.raw("OMNILAB_NOT_A_SETTING")
    monkeypatch.setenv("OMNILAB_HUGEPAGES", "on")
    assert settings.raw("OMNILAB_HUGEPAGES") == "on"
    assert settings.raw("OMNILAB_HUGEPAGES", {}) is None
    assert settings.flag("OMNILAB_CPU_INDUCTOR", {"OMNILAB_CPU_INDUCTOR": " Yes"}) is True
    assert settings.flag("OMNILAB_CPU_INDUCTOR", {"OMNILAB_CPU_INDUCTOR": ""}) is None
    with pytest.raises(ConfigError, match="OMNILAB_CPU_INDUCTOR='maybe'.*accepted values are 1 / true"):
        settings.flag("OMNILAB_CPU_INDUCTOR", {"OMNILAB_CPU_INDUCTOR": "maybe"})


def test_omnilab_dtype_has_one_reading():
    import pytest
    from omnilab.errors import ConfigError

    assert [settings.env_dtype({"OMNILAB_DTYPE": v}) for v in ("fp32", " BF16", "torch.float32", "auto", "")] == [
        "float32", "bfloat16", "float32", None, None]
    assert settings.env_dtype({}) is None
    with pytest.raises(ConfigError, match="OMNILAB_DTYPE='fp16': float16 is not supported"):
        settings.env_dtype({"OMNILAB_DTYPE": "fp16"})
    with pytest.raises(ConfigError, match="OMNILAB_DTYPE='f64': accepted dtypes are float32"):
        settings.env_dtype({"OMNILAB_DTYPE": "f64"})
