"""Reproductions: configs → runs → JSONL metrics, PNG plots and markdown tables.

Every reproduction is a function ``reproduce(out_dir, *, quick, seeds, data_dir, progress)``
registered in :data:`REPRODUCTIONS` by name (``partialfl reproduce NAME``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

#: name -> ("module", "function", one-line description)
REPRODUCTIONS: dict[str, tuple[str, str, str]] = {
    "ls-tau": ("partialfl.experiments.least_squares", "reproduce_tau",
               "Figure 1(a): FFGG with CG, tau in {1,5,10,20,30,40} on least squares"),
    "ls-compare": ("partialfl.experiments.least_squares", "reproduce_compare",
                   "Figure 1(b-d): FFGG (GD) vs Scaffold, Local GD, L2GD, tau in {100,200,500}"),
    "femnist-table": ("partialfl.experiments.femnist", "reproduce_table",
                      "Table 2 (FEMNIST): FedAvg vs FFGG splits, Local FFGG, FedAlt/FedSim"),
    "femnist-kfold": ("partialfl.experiments.femnist", "reproduce_kfold",
                      "FEMNIST new writers by k-fold over writers (--folds K): FedAvg vs FFGG"),
    "shakespeare-table": ("partialfl.experiments.shakespeare", "reproduce_table",
                          "Next-word prediction by role: FedAvg vs FFGG splits (transformer)"),
    "har-table": ("partialfl.experiments.har", "reproduce_table",
                  "Activity recognition by subject (HAPT): local, FedAvg(+FT), FFGG splits, "
                  "Ditto"),
    "async": ("partialfl.experiments.asynchronous", "reproduce_async",
              "Asynchronous FFGG vs sync FFGG, FedBuff, async SGD on least squares"),
    "byzantine": ("partialfl.experiments.byzantine", "reproduce_byzantine",
                  "Byzantine-robust FFGG: attacks x aggregators (+bucketing) on least squares"),
    "faults": ("partialfl.experiments.faults", "reproduce_faults",
               "Fault injection: FFGG with 0-30% of clients raising / NaN / dying workers"),
}


def get_reproduction(name: str) -> Callable:
    """The reproduce function for ``name``; a clear error for unknown or unavailable names."""
    if name not in REPRODUCTIONS:
        raise ValueError(
            f"unknown reproduction {name!r}; allowed: {', '.join(sorted(REPRODUCTIONS))}"
        )
    module, fn, _ = REPRODUCTIONS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise NotImplementedError(f"reproduction {name!r} is not implemented yet") from e
        raise
    return getattr(mod, fn)
