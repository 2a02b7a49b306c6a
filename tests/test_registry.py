"""One registry: :data:`partialfl.build.REGISTRY` is the only table that maps names to classes
or functions. A scan of ``src/`` finds every name table (a dict of names to classes,
functions, factories or ``"module"`` paths, or an if-chain ``if name == "x": return X(...)``);
it must find them in ``build.py`` only. The scanner is checked on the kinds of tables the
package used to have."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from partialfl.build import (
    REGISTRY,
    make_aggregator,
    make_attack,
    make_backend,
    make_model,
    make_optimizer,
    make_solver,
    names,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "partialfl"
NAME = re.compile(r"[a-z0-9][a-z0-9_.:-]*")


def _module_defs(tree: ast.Module) -> set[str]:
    """Names bound at module level to a function or class: defined or imported."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.asname or a.name for a in node.names)
    return out


def _is_class_name(name: str) -> bool:
    return name[:1].isupper() and not name.isupper()


def _callable_ref(v: ast.expr, defs: set[str]) -> bool:
    if isinstance(v, ast.Lambda):
        return True
    if isinstance(v, ast.Name):
        return v.id in defs or _is_class_name(v.id)
    if isinstance(v, ast.Attribute):
        return _is_class_name(v.attr)
    if isinstance(v, ast.Call):  # a factory of constants: _lazy("module", "attr")
        args = [*v.args, *(k.value for k in v.keywords)]
        return (isinstance(v.func, ast.Name) and v.func.id in defs and bool(args)
                and all(isinstance(a, ast.Constant) for a in args))
    if isinstance(v, ast.Tuple) and v.elts:
        first = v.elts[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.startswith("partialfl.")  # ("module", "function", ...)
        return _callable_ref(first, defs)
    return False


def _enclosing(tree: ast.Module) -> dict[ast.AST, str]:
    out: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                out.setdefault(node, fn.name)
    return out


def name_tables(source: str) -> list[tuple[int, str]]:
    """``(line, where)`` of every name table in a module's source."""
    tree = ast.parse(source)
    defs = _module_defs(tree)
    where = _enclosing(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and len(node.keys) >= 2 and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str)
                and NAME.fullmatch(k.value) for k in node.keys) and all(
                _callable_ref(v, defs) for v in node.values):
            found.append((node.lineno, where.get(node, "<module>")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            dispatch = [
                n for n in ast.walk(node) if isinstance(n, ast.If)
                and isinstance(n.test, ast.Compare) and len(n.test.ops) == 1
                and isinstance(n.test.ops[0], ast.Eq)
                and isinstance(n.test.comparators[0], ast.Constant)
                and isinstance(n.test.comparators[0].value, str)
                and len(n.body) == 1 and isinstance(n.body[0], ast.Return)
                and isinstance(n.body[0].value, ast.Call)
                and isinstance(n.body[0].value.func, ast.Name)
                and n.body[0].value.func.id[:1].isupper()]
            if len(dispatch) >= 2:
                found.append((node.lineno, node.name))
    return found


# -- the scanner finds what it should -----------------------------------------------------
PLANTED = {
    "if-chain": '''
from x import SGD, Adam
def make_optimizer(name, lr):
    if name == "sgd":
        return SGD(lr=lr)
    if name == "adam":
        return Adam(lr=lr)
    raise ValueError(name)
''',
    "classes": '''
from partialfl.runtime.cohort_pool import ProcessBackend
class BatchedBackend: ...
BACKENDS = {"batched": BatchedBackend, "processes": ProcessBackend}
''',
    "class-and-options": '''
from partialfl.aggregation.rules import Krum, TrimmedMean
_RULES = {"krum": (Krum, ("cap",)), "tm": (TrimmedMean, ())}
''',
    "functions": '''
def _a(p): ...
def _b(p): ...
FORMATS = {"a-npz": _a, "b-json": _b}
''',
    "module-paths": '''
REPRODUCTIONS = {"ls-tau": ("partialfl.experiments.ls", "reproduce_tau", "Figure 1"),
                 "async": ("partialfl.experiments.asyn", "reproduce_async", "async")}
''',
    "factories": '''
def _lazy(m, a): ...
TABLE = {"sequential": _lazy("m", "A"), "vmap": _lazy("m", "B")}
''',
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_scanner_finds_a_planted_name_table(kind):
    assert len(name_tables(PLANTED[kind])) == 1


def test_scanner_ignores_data_dicts_and_behaviour_switches():
    src = '''
from collections import Counter
def _split(x, key): ...
def f(server, history, x, kind):
    kw = {"momentum": server.momentum, "lr": server.lr}
    out = {"history": history, "seconds": float(x), "theta": _split(x, "theta")}
    counts = {"train": Counter(), "test": Counter()}
    if kind == "constant":
        return x.ones_like()
    if kind == "hinge":
        return x.where(1.0)
    return {"async FFGG": lambda c: c, "buffered FFGG": lambda c: c}
'''
    assert name_tables(src) == []


def test_the_registry_is_the_only_name_table():
    tables = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for line, where in name_tables(path.read_text()):
            tables.setdefault(rel, []).append(f"{rel}:{line} ({where})")
    assert "build.py" in tables, "the scanner does not see the registry itself"
    others = [t for rel, ts in tables.items() if rel != "build.py" for t in ts]
    assert not others, "name tables outside partialfl/build.py:\n" + "\n".join(others)


# -- what the registry builds, with the old errors --------------------------------------
def test_registry_kinds_cover_every_named_thing():
    for kind in ("problem", "closed-form-algorithm", "solver", "algorithm", "split", "model",
                 "dataset", "data-format", "partitioner", "backend", "optimizer", "schedule",
                 "aggregator", "attack", "loss", "metric", "reproduction"):
        assert names(kind), kind


@pytest.mark.parametrize("make, bad, message", [
    (lambda n: make_optimizer(n, 1.0), "lion", "unknown server optimizer 'lion'; allowed: sgd"),
    (make_solver, "newton", "unknown local solver 'newton'; allowed: gd, cg, exact"),
    (make_backend, "threads", "unknown backend 'threads'; allowed: sequential"),
    (make_aggregator, "avg", "unknown aggregator 'avg'; allowed: mean, cm"),
    (make_attack, "lie", "unknown attack 'lie'; allowed: none, alie"),
    (lambda n: make_model(n, 10), "vgg", "unknown model 'vgg'; available: emnist_cnn"),
])
def test_unknown_names_list_the_allowed_ones(make, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(bad)


def test_registry_entries_build_the_modules_classes():
    from partialfl.aggregation import Bucketing, GeometricMedian, Krum
    from partialfl.attacks import IPM
    from partialfl.local import ConjugateGradient, ExactSolver, GradientDescent
    from partialfl.models import EmnistCNN
    from partialfl.runtime.backends import BatchedBackend, SequentialBackend
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.server import SGD, Adam, Schedule

    s = Schedule("exponential", halve_every=2)
    assert make_optimizer("sgd", 0.5, s, momentum=0.9) == SGD(0.5, 0.9, s)
    assert make_optimizer("adam", 0.1) == Adam(0.1)
    assert make_solver("gd", 3, 0.1, "random") == GradientDescent(3, 0.1, "random")
    assert make_solver("cg", 4) == ConjugateGradient(4)
    assert make_solver("exact", 9) == ExactSolver()
    assert isinstance(make_backend("vmap"), BatchedBackend)
    assert isinstance(make_backend("sequential"), SequentialBackend)
    assert isinstance(make_backend("processes"), ProcessBackend)
    assert isinstance(make_aggregator("rfa"), GeometricMedian)  # an alias
    assert make_aggregator("multi-krum").m is None and make_aggregator("krum").m == 1
    b = make_aggregator("krum", delta=0.1, bucketing=2)
    assert isinstance(b, Bucketing) and isinstance(b.inner, Krum)
    assert make_attack("ipm", epsilon=2.0) == IPM(epsilon=2.0)
    m1, m2 = make_model("emnist-cnn", 7, seed=3), make_model("emnist_cnn", 7, seed=3)
    assert isinstance(m1, EmnistCNN)
    assert all(a.equal(b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert set(REGISTRY["aggregator-alias"].values()) <= set(names("aggregator"))
