"""Reproductions (``partialfl reproduce NAME``): the paper's figures and our tables, each a
registered entry of kind ``reproduction`` whose build is ``reproduce(out_dir, *, quick,
seeds, data_dir, progress, …) -> summary path``. Importing this package registers them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from partialfl import io as pio
from partialfl.reproductions import (
    asynchronous,
    byzantine,
    faults,
    femnist,
    har,
    least_squares,
    shakespeare,
)


def new_client_evaluator(run: Path) -> Callable[..., dict]:
    """The new-client evaluation of the table ``run`` belongs to, told by its ``data.json``:
    HAR (held-out subjects) or FEMNIST (held-out writers, and the default, which names what is
    missing)."""
    info = next((p / "data.json" for p in (run, *run.parents) if (p / "data.json").exists()),
                None)
    if info is not None and "new_subjects" in pio.read_json(info):
        return har.evaluate_new_subjects
    return femnist.evaluate_new_writers


__all__ = ["asynchronous", "byzantine", "faults", "femnist", "har", "least_squares",
           "new_client_evaluator", "shakespeare"]
