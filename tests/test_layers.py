"""The package's import graph, function-level imports included: no circle, and no arrow from a lower layer up.

Every ``import omnilab.x`` / ``from omnilab.x import y`` / ``from omnilab import x`` anywhere in a module (module
level or inside functions) is an edge from that module to the module it names (``from omnilab.x import y`` to
``omnilab.x.y`` when that is a module). Imports under ``if TYPE_CHECKING:`` never run, so they are no edge. The layers and what each may import are stated in
``docs/architecture.md`` and in each package's ``__init__`` docstring.

An omnilab import inside a function carries its reason on its (first) line: ``# lazy: <package>`` (it keeps torch,
vLLM or another heavy or optional package out of importing the module) or ``# cycle: <module>`` (at module level it
would close an import cycle through that module or package); every other import sits at the top of the module.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "omnilab"

# lower layers must never import these (the random-checkpoint factory, the stages, the facade, display)
LOW = ("omnilab.kernels", "omnilab.tuning", "omnilab.models", "omnilab.profiles")
HIGH = ("omnilab.checkpoint.random", "omnilab.stages", "omnilab.pipeline", "omnilab.display", "omnilab.deployment",
        "omnilab.bench", "omnilab.cli", "omnilab.quality", "omnilab.batch")
# the edges (layer 7): nothing below them may import omnilab.quality (bench/ and cli/ may)
EDGES = ("omnilab.display", "omnilab.bench", "omnilab.cli", "omnilab.quality", "omnilab.batch")
# leaves: modules every layer may import, which import no other omnilab layer themselves
LEAVES = ("omnilab.errors", "omnilab.paths", "omnilab.config", "omnilab.settings")


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                if n.startswith("omnilab") and n in mods and n != mod and n != "omnilab":
                    graph[mod].add(n)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def graph():
    return _edges(_modules())


def test_the_graph_sees_function_level_imports(graph):
    assert "omnilab.kernels.gemv" in graph["omnilab.tuning.timing"]  # imported inside a function


def test_no_import_circle(graph):
    assert _cycles(graph) == []


def test_lower_layers_do_not_import_upward(graph):
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() if _under(a, LOW) for b in deps if _under(b, HIGH))
    assert bad == []


def test_only_edges_import_quality(graph):
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() if not _under(a, EDGES) for b in deps
                 if _under(b, ("omnilab.quality",)))
    assert bad == []


def test_leaves_import_no_other_layer(graph):
    bad = sorted(f"{a} -> {b}" for a in LEAVES for b in graph[a] if not _under(b, LEAVES))
    assert bad == []


def test_a_circle_and_an_upward_arrow_are_caught():
    g = {"omnilab.a": {"omnilab.b"}, "omnilab.b": {"omnilab.a"}, "omnilab.kernels.x": {"omnilab.stages.y"},
         "omnilab.stages.y": set()}
    assert _cycles(g) == [["omnilab.a", "omnilab.b"]]
    assert [f"{a} -> {b}" for a, d in g.items() if _under(a, LOW) for b in d if _under(b, HIGH)] == \
        ["omnilab.kernels.x -> omnilab.stages.y"]


def test_layout_size_and_package_docstrings():
    top = [p for p in PKG.glob("*.py")]
    assert len(top) <= 15, sorted(p.name for p in top)
    for d in (p for p in PKG.rglob("*") if p.is_dir() and any(p.glob("*.py"))):
        init = d / "__init__.py"
        assert init.exists(), f"{d} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc.lower(), f"{init}: the docstring must say the package's job and what it may import"


# ---- function-level imports say why ------------------------------------------------------------------
# An omnilab import inside a function is kept there only to keep a heavy or optional package out of importing
# the module (``# lazy: torch``), or because at module level it would close an import cycle (``# cycle: omnilab.x``,
# the module or package that imports this one back). Anything else belongs at the top of the module.
LAZY_PACKAGES = frozenset({"torch", "vllm", "matplotlib", "numpy", "pandas", "scipy", "ray", "fastapi", "uvicorn",
                           "playwright", "soundfile", "safetensors", "transformers"})
_REASON = re.compile(r"#\s*(lazy|cycle):\s*([\w.]+)")


def _function_imports(tree: ast.AST):
    """(import node, enclosing function) for every import inside a function or method."""
    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if inner is not None and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inner
            yield from walk(child, inner)
    yield from walk(tree, None)


def _top_level_packages(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.partition(".")[0])
    return out


def _unexplained_imports(mod: str, source: str, mods) -> list[str]:
    """``mod:line`` with what is wrong, for each function-level omnilab import without a valid reason."""
    tree = ast.parse(source)
    lines, top, bad = source.splitlines(), _top_level_packages(tree), []
    for node, func in _function_imports(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            names = [node.module or ""] if node.level == 0 else ["omnilab (relative)"]
        if not any(n == "omnilab" or n.startswith("omnilab.") or n == "omnilab (relative)" for n in names):
            continue
        where = f"{mod}:{node.lineno} ({func.name})"
        m = _REASON.search(lines[node.lineno - 1])
        if m is None:
            bad.append(f"{where}: no '# lazy: <package>' or '# cycle: <module>'")
        elif m[1] == "lazy" and m[2] not in LAZY_PACKAGES:
            bad.append(f"{where}: lazy: {m[2]} is not one of the heavy or optional packages {sorted(LAZY_PACKAGES)}")
        elif m[1] == "lazy" and m[2] in top:
            bad.append(f"{where}: lazy: {m[2]}, but the module imports {m[2]} at module level: move the import up")
        elif m[1] == "cycle" and m[2] not in mods:
            bad.append(f"{where}: cycle: {m[2]} names no omnilab module or package")
    return bad


def test_function_level_imports_say_why():
    mods = _modules()
    bad = [b for mod, path in sorted(mods.items()) for b in _unexplained_imports(mod, path.read_text(), mods)]
    assert bad == [], "\n".join(bad)


def test_an_unexplained_function_level_import_is_caught():
    mods = {"omnilab.a": None, "omnilab.b": None}
    src = ("import torch\n\n\ndef f():\n    from omnilab.a import x  # lazy: vllm\n"
           "    from omnilab.b import (y,  # cycle: omnilab.b\n                           z)\n"
           "    import json\n    return x, y, z, json\n\n\nclass C:\n    def g(self):\n"
           "        from omnilab.a import x\n        from omnilab.a import w  # lazy: torch\n"
           "        from omnilab.b import v  # lazy: yaml\n        from omnilab.a import u  # cycle: omnilab.c\n"
           "        return x, w, v, u\n")
    assert [b.partition(":")[2].partition(" ")[0] for b in _unexplained_imports("omnilab.t", src, mods)] == \
        ["14", "15", "16", "17"]
