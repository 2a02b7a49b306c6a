"""The library below the reproductions: ``partialfl.pipeline`` imports nothing above it
(reproductions, Flower, the CLI), and its modules and the reproductions' stay small."""

from __future__ import annotations

from test_imports import PKG, SRC, import_graph

ABOVE_PIPELINE = ("partialfl.reproductions", "partialfl.flower", "partialfl.cli")


def test_pipeline_imports_nothing_above_it():
    graph = import_graph()
    up = sorted(f"{mod} → {dep}" for mod, deps in graph.items()
                if mod.startswith("partialfl.pipeline") for dep in deps
                if dep.startswith(ABOVE_PIPELINE))
    assert not up, up


def test_pipeline_and_reproductions_modules_stay_under_500_lines():
    big = {p.relative_to(SRC).as_posix(): n for sub in ("pipeline", "reproductions")
           for p in (PKG / sub).glob("*.py")
           if (n := len(p.read_text().splitlines())) > 500}
    assert not big, big

