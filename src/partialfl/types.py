"""The data types that cross layer boundaries.

θ and w are parameter trees: plain dicts ``name -> array`` (numpy for closed-form problems,
torch tensors for model problems). Client work is vectorised over a *cohort*: a batch of
client ids, so stacked trees carry a leading client axis of length k = len(cohort).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialfl.io import state_class

Array = Any  # numpy.ndarray or torch.Tensor
Params = dict[str, Array]


@state_class
@dataclass(frozen=True)
class ClientUpdates:
    """What a cohort of k clients sends to the server: the only thing that leaves a client.

    It has no field for personal parameters by construction.

    Attributes:
        vectors: stacked parameter tree, each leaf of shape ``[k, *theta_leaf_shape]``: a
            θ-gradient (FFGG) or a θ-delta (Local FFGG, FedAvg, ...).
        weights: ``[k]`` aggregation weights (e.g. number of examples, or ones).
        cohort: ``[k]`` the client ids, in the order of the leading axis.
        grad_evals: local gradient computations per client spent on this update.
        metrics: per-client scalars, each ``[k]`` (e.g. training loss after fine-tuning).
        extra: algorithm-specific payload that is still global (e.g. Scaffold's Δc).
    """

    vectors: Params
    weights: np.ndarray
    cohort: np.ndarray
    grad_evals: int = 0
    metrics: Mapping[str, np.ndarray] = field(default_factory=dict)
    extra: Mapping[str, Params] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = len(self.cohort)
        if len(self.weights) != k:
            raise ValueError(f"weights has {len(self.weights)} entries for a cohort of {k}")
        for name, v in self.vectors.items():
            if v.shape[0] != k:
                raise ValueError(
                    f"update vector {name!r} has leading size {v.shape[0]}, expected {k}"
                )

    def select(self, idx: np.ndarray) -> ClientUpdates:
        """The updates of a subset of the cohort (positions ``idx``)."""
        idx = np.asarray(idx)
        return ClientUpdates(
            vectors={n: v[idx] for n, v in self.vectors.items()},
            weights=np.asarray(self.weights)[idx],
            cohort=np.asarray(self.cohort)[idx],
            grad_evals=self.grad_evals,
            metrics={n: np.asarray(v)[idx] for n, v in self.metrics.items()},
            extra={n: {m: t[idx] for m, t in tree.items()} for n, tree in self.extra.items()},
        )
