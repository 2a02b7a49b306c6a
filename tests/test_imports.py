"""The package's import structure: every module imports on its own, the import graph has no
cycle (function-level imports included: they must not hide one), and importing the package
has no side effects on the process environment."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "partialfl"


def module_names() -> list[str]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def _file(mod: str) -> Path:
    p = SRC / Path(*mod.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def import_graph() -> dict[str, set[str]]:
    """Edges module → partialfl module it imports (anywhere in the file). ``from a.b import
    c`` points at ``a.b.c`` when c is a submodule, else at ``a.b`` (its ``__init__``)."""
    mods = set(module_names())
    graph: dict[str, set[str]] = {}
    for mod in mods:
        f = _file(mod)
        is_pkg = f.name == "__init__.py"
        tree = ast.parse(f.read_text(), str(f))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "partialfl" and a.name in mods:
                        edges.add(a.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "partialfl":
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    edges.add(sub if sub in mods else target)
        edges.discard(mod)
        graph[mod] = {e for e in edges if e in mods}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(g) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_has_no_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (module-level or inside functions):\n" + "\n".join(
        " ↔ ".join(c) for c in cycles)


OPTIONAL = {"flwr": "partialfl.flower"}


def test_every_module_imports_in_isolation():
    """Each module in a fresh interpreter (no other partialfl module imported first)."""
    mods = [m for m in module_names() if not m.endswith("__main__")  # it runs the CLI
            and not any(m.startswith(p) for dep, p in OPTIONAL.items()
                       if not _has(dep))]
    code = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n"
            "    for k in [k for k in sys.modules if k.startswith('partialfl')]:\n"
            "        del sys.modules[k]\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(bad))\nsys.exit(1 if bad else 0)\n")
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def _has(dep: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(dep) is not None


def test_importing_the_package_leaves_the_environment_alone():
    code = ("import os, json; before = dict(os.environ)\n"
            "import partialfl, partialfl.cli, partialfl.pipeline, partialfl.reproductions\n"
            "try:\n    import partialfl.flower\nexcept ImportError:\n    pass\n"
            "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))")
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"import changed os.environ: {r.stdout}"


@pytest.mark.parametrize("mod", ["partialfl", "partialfl.cli"])
def test_module_list_is_complete(mod):
    assert mod in module_names()
