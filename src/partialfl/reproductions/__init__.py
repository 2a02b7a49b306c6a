"""Reproductions (``partialfl reproduce NAME``): the paper's figures and our tables, each a
registered entry of kind ``reproduction`` whose build is ``reproduce(out_dir, *, quick,
seeds, data_dir, progress, …) -> summary path``. Importing this package registers them. The
tables (FEMNIST, HAR, Shakespeare) share one driver, :mod:`partialfl.reproductions.tables`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from partialfl import io as pio
from partialfl.reproductions import (
    asynchronous,
    byzantine,
    dp,
    faults,
    femnist,
    har,
    heterogeneity,
    least_squares,
    shakespeare,
)

#: the tables whose runs hold out new clients (``partialfl evaluate``)
TABLES = (femnist.FEMNIST, har.HAR)


def new_client_evaluator(run: Path) -> Callable[..., dict]:
    """The new-client evaluation of the table ``run`` belongs to, told by the key its
    ``data.json`` lists the held-out clients under (FEMNIST: writers, HAR: subjects;
    without one, FEMNIST's, which names what is missing)."""
    info = next((p / "data.json" for p in (run, *run.parents) if (p / "data.json").exists()),
                None)
    keys = set(pio.read_json(info)) if info is not None else set()
    return next((t.evaluate_new_clients for t in TABLES if t.new_key in keys),
                femnist.FEMNIST.evaluate_new_clients)


__all__ = ["TABLES", "asynchronous", "byzantine", "dp", "faults", "femnist", "har", "heterogeneity",
           "least_squares", "new_client_evaluator", "shakespeare"]
