"""Static checks of the architecture (docs/architecture.md): layers only point down, no
import cycle between packages, no module over 500 lines, importing the spec loads no array
library beyond numpy. Imports inside functions count too: a lazy import up a layer is still
an arrow up."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "partialfl"
MAX_LINES = 500

#: bottom to top; a module may import its own layer and the layers below (the map in
#: docs/architecture.md)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("types", "arrays", "rng", "tree", "io", "config", "registry", "spec", "devices",
              "batching", "stats", "sampling", "dp_accounting")),
    ("components", ("problems", "split", "local", "models", "data", "aggregation", "attacks",
                    "server", "lm", "metrics")),
    ("algorithms", ("algorithms", "privacy")),
    ("runtime", ("runtime",)),
    ("building", ("build", "advisor", "reference")),
    ("pipeline", ("pipeline",)),
    ("flower", ("flower",)),
    ("reproductions", ("reproductions",)),
    ("interface", ("cli", "__main__", "__init__")),
]


def _unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: ``partialfl.x.y`` → ``x``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer_of(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"partialfl.{unit} is in no layer of test_architecture.LAYERS (and "
                         "of docs/architecture.md): add it")


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("partialfl")}
        elif isinstance(node, ast.ImportFrom):
            if node.module == "partialfl":  # from partialfl import arrays (or __version__)
                out |= {f"partialfl.{a.name}" if (SRC / f"{a.name}.py").exists()
                        or (SRC / a.name).is_dir() else "partialfl" for a in node.names}
            elif node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                out.add(f"{base}.{node.module}" if node.module else base)
            elif node.module and node.module.startswith("partialfl"):
                out.add(node.module)
    return out


def test_every_package_is_in_a_layer():
    for m in _modules():
        _layer_of(_unit(m))


def test_no_arrow_runs_up_a_layer():
    up = []
    for m, path in sorted(_modules().items()):
        lm = _layer_of(_unit(m))
        for imp in sorted(_imports(path, m)):
            li = _layer_of(_unit(imp))
            if li > lm:
                up.append(f"{m} ({LAYERS[lm][0]}) imports {imp} ({LAYERS[li][0]})")
    assert not up, "imports up a layer:\n" + "\n".join(up)


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for m, path in _modules().items():
        u = _unit(m)
        graph.setdefault(u, set()).update(_unit(i) for i in _imports(path, m) if _unit(i) != u)
    cycles = []
    for a in graph:
        seen, stack = set(), [(a, [a])]
        while stack:
            node, trail = stack.pop()
            for b in graph.get(node, ()):
                if b == a:
                    cycles.append(" → ".join([*trail, a]))
                elif b not in seen:
                    seen.add(b)
                    stack.append((b, [*trail, b]))
    assert not cycles, "package cycles:\n" + "\n".join(sorted(set(cycles)))


def test_no_module_over_500_lines():
    long = [f"{p.relative_to(SRC)}: {n}" for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "modules over 500 lines:\n" + "\n".join(long)


def test_importing_the_spec_loads_no_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import partialfl.spec"],
                         capture_output=True, text=True, check=True)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "torch" not in loaded and "partialfl.spec" in loaded


def test_the_architecture_doc_lists_the_layers():
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    for _, units in LAYERS:
        for u in units:
            if u not in ("__init__", "__main__"):
                assert f"`partialfl.{u}`" in text, f"docs/architecture.md does not name {u}"


def test_the_layer_table_is_the_checked_layers_in_order():
    """The doc's "Layers" table lists exactly the layers checked here, bottom to top, each
    with exactly its packages."""
    import re

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| layer")
            and not r.startswith("| ---")]
    doc = [(r.split("|")[1].strip().lower(), set(re.findall(r"`partialfl\.(\w+)`",
                                                            r.split("|")[2]))) for r in rows]
    want = [(name, {u for u in units if u not in ("__init__", "__main__")})
            for name, units in LAYERS]
    assert doc == want
