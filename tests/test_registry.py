"""One registry: :mod:`partialfl.registry` is the only table that maps names to components.

A scan of ``src/`` finds every name table: a dict of names to classes, functions, factories
or ``"module"`` paths (literal or a comprehension keyed by ``.name``), an if-chain ``if name ==
"x": return X(...)``, or a tuple of names that are registered names of one kind (or the
package's class names); it must find the registry's own table only. The scanner is checked on
the kinds of tables the package used to have (planted below). Then: every kind has entries,
unknown names list the allowed ones, and a user's module registers components without editing
the package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from partialfl import registry
from partialfl.build import (
    make_aggregator,
    make_attack,
    make_backend,
    make_model,
    make_optimizer,
    make_solver,
)
from partialfl.config import ConfigError
from partialfl.registry import KINDS, Component, component, entries

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


def _registered() -> tuple[dict[str, str], set[str]]:
    """Every registered name (and alias) → its kind; the package's class names."""
    out: dict[str, str] = {}
    for kind in KINDS:
        for e in entries(kind):
            for n in (e.name, *e.aliases):
                out.setdefault(n, kind)
    classes = set()
    for path in SRC.rglob("*.py"):
        classes |= {n.name for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.ClassDef)}
    return out, classes


REGISTERED, CLASSES = _registered()


def _name_tuple(node: ast.AST) -> bool:
    """A tuple/list/set of string constants, two or more of them registered names of one
    kind or class names of the package."""
    if not isinstance(node, ast.Tuple | ast.List | ast.Set) or len(node.elts) < 2:
        return False
    vals = [e.value for e in node.elts if isinstance(e, ast.Constant)
            and isinstance(e.value, str)]
    if len(vals) != len(node.elts):
        return False
    kinds = [REGISTERED[v] for v in vals if v in REGISTERED]
    if any(kinds.count(k) >= 2 for k in set(kinds)):
        return True
    return all(v in CLASSES for v in vals)


def _is_all(node: ast.Assign | ast.AnnAssign) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def name_tables(source: str) -> list[tuple[int, str]]:
    """``(line, where)`` of every name table in a module's source."""
    tree = ast.parse(source)
    defs = _module_defs(tree)
    where = _enclosing(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and \
                _name_tuple(node.value) and not _is_all(node):
            found.append((node.lineno, where.get(node, "<module>")))
        if isinstance(node, ast.DictComp) and isinstance(node.key, ast.Attribute) and \
                node.key.attr == "name" and isinstance(node.generators[0].iter,
                                                        ast.Tuple | ast.List) and \
                all(isinstance(e, ast.Call) for e in node.generators[0].iter.elts):
            found.append((node.lineno, where.get(node, "<module>")))
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
    "string-tuple": '''
SPLIT_KINDS = ("none", "input", "output", "adapter", "norm", "pattern")
''',
    "class-attribute": '''
class Schedule:
    KINDS = ("constant", "warmup-linear", "exponential")
''',
    "partial-names": '''
ALGORITHMS = ("ffgg", "br-ffgg", "local-ffgg", "fedavg")
''',
    "class-names": '''
STATE_CLASSES = ("ServerState", "ClientUpdates")
''',
    "comprehension": '''
class Preset: ...
PRESETS = {p.name: p for p in (Preset("fedper"), Preset("fedrep"))}
''',
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
MODES = ("max", "min")
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


#: where a study lists which registered components it compares (a grid of names is its
#: experiment, not a name table): the string-tuple rule does not apply there
STUDIES = ("reproductions/", "experiments/")


def test_the_registry_is_the_only_name_table():
    tables = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        source = path.read_text()
        found = name_tables(source)
        if rel.startswith(STUDIES):
            tuples = {n.lineno for n in ast.walk(ast.parse(source))
                      if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None
                      and _name_tuple(n.value)}
            found = [(line, w) for line, w in found if line not in tuples]
        for line, where in found:
            tables.setdefault(rel, []).append(f"{rel}:{line} ({where})")
    assert list(tables) == ["registry.py"] and len(tables["registry.py"]) == 1, \
        "name tables outside the registry:\n" + "\n".join(
            t for rel, ts in tables.items() for t in ts)


# -- what the registry holds ------------------------------------------------------------
def test_every_kind_has_entries_with_documented_options():
    for kind in KINDS:
        es = entries(kind)
        assert es, kind
        for e in es:
            assert e.doc, f"{kind} {e.name} has no description"
            for opt in registry.describe_options(e.options):
                assert opt["doc"], f"{kind} {e.name}: option {opt['name']} has no description"


@pytest.mark.parametrize("make, bad, message", [
    (lambda n: make_optimizer(n, 1.0), "lion", "'lion' is not allowed; allowed: adam, sgd"),
    (make_solver, "newton", "'newton' is not allowed; allowed: cg, exact, gd, sgd"),
    (make_backend, "threadz", "'threadz' is not allowed"),
    (make_aggregator, "avg", "'avg' is not allowed"),
    (make_attack, "lie", "'lie' is not allowed"),
    (lambda n: make_model(n, 10), "vgg", "'vgg' is not allowed; allowed: emnist_cnn"),
])
def test_unknown_names_list_the_allowed_ones(make, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(bad)


def test_registry_entries_build_the_modules_classes():
    from partialfl.local import ConjugateGradient, ExactSolver, GradientDescent
    from partialfl.models import EmnistCNN
    from partialfl.runtime.backends import BatchedBackend, SequentialBackend
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.server import SGD, Adam, Exponential

    s = Exponential(halve_every=2)
    assert make_optimizer("sgd", 0.5, s, momentum=0.9) == SGD(0.5, 0.9, s)
    assert make_optimizer("adam", 0.1) == Adam(0.1)
    assert make_solver("gd", 3, 0.1, "random") == GradientDescent(3, 0.1, "random")
    assert make_solver("cg", 4) == ConjugateGradient(4)
    assert make_solver("exact", 9) == ExactSolver()
    assert isinstance(make_backend("vmap"), BatchedBackend)
    assert isinstance(make_backend("batched"), BatchedBackend)  # an alias
    assert isinstance(make_backend("sequential"), SequentialBackend)
    assert isinstance(make_backend("processes", workers=2), ProcessBackend)
    m1, m2 = make_model("emnist-cnn", 7, seed=3), make_model("emnist_cnn", 7, seed=3)
    assert isinstance(m1, EmnistCNN)
    assert all(a.equal(b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))


def test_components_round_trip_through_their_toml_form():
    c = component("local", {"name": "gd", "tau": 3})
    assert c == Component("local", "gd", c.options) and component("local", c.to_dict()) == c
    assert component("executor", "batched").name == "vmap"  # aliases resolve to the entry
    with pytest.raises(ConfigError, match=r"client: .*tau must be an integer >= 1"):
        component("local", {"name": "gd", "tau": 0}, "client")


def test_a_second_registration_of_a_name_from_another_module_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("algorithm", "ffgg")(lambda opts, ctx: None)


# -- a user's own module registers the same way ----------------------------------------
PLUGIN = '''
from dataclasses import dataclass
from partialfl.registry import option, register


@dataclass(frozen=True)
class ScaledOptions:
    """How much to scale FFGG's server step."""
    scale: float = option(1.0, "factor on the server's stepsize")


@register("algorithm", "scaled-ffgg", options=ScaledOptions, split="personal")
def scaled(opts, ctx):
    """FFGG with its stepsize scaled."""
    import dataclasses
    from partialfl.algorithms.ffgg import FFGG
    opt = dataclasses.replace(ctx.server_opt, lr=ctx.server_opt.lr * opts.scale)
    return FFGG(ctx.finetuner(), opt, ctx.aggregator, ctx.weighting)
'''


def test_a_plugin_module_registers_and_runs_from_a_config(tmp_path):
    (tmp_path / "myplugin.py").write_text(PLUGIN)
    cfg = tmp_path / "run.toml"
    cfg.write_text('plugins = ["myplugin"]\n[problem]\nname = "least-squares"\n'
                   'num_clients = 4\nn = 30\nd_theta = 4\nd_w = 2\n'
                   '[method]\nalgorithm = "scaled-ffgg"\nscale = 0.5\n'
                   '[personalize]\nrounds = 3\nclient = { name = "cg", tau = 2 }\n')
    code = ("import sys; from partialfl.cli import main; "
            f"sys.exit(main(['run', {str(cfg)!r}, '--allow-code', '--no-progress', "
            f"'--out', {str(tmp_path / 'o')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path.parent)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "run.jsonl").exists()
    r = subprocess.run([sys.executable, "-c", code.replace("'--allow-code', ", "")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path.parent)
    assert r.returncode == 2 and "--allow-code" in r.stderr
