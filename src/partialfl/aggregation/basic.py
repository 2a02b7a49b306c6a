"""The aggregator interface and the (weighted) mean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from partialfl.tree import flatten_stacked
from partialfl.types import Params


@runtime_checkable
class Aggregator(Protocol):
    """``agg(vectors [k, d], weights [k]) -> [d]``."""

    def __call__(self, vectors, weights): ...


@dataclass(frozen=True)
class Mean:
    """(Weighted) mean Σ_i a_i x_i / Σ_i a_i; ``weighted=False`` uses a_i = 1."""

    weighted: bool = False

    def __call__(self, vectors, weights):
        if not self.weighted:
            return vectors.mean(0)
        a = _as_like(weights, vectors)
        return (a.reshape((-1,) + (1,) * (vectors.ndim - 1)) * vectors).sum(0) / a.sum()


def _as_like(weights, vectors):
    if hasattr(vectors, "detach"):
        import torch

        return torch.as_tensor(np.asarray(weights), dtype=vectors.dtype, device=vectors.device)
    return np.asarray(weights, dtype=vectors.dtype)


def aggregate_tree(agg, vectors: Params, weights) -> Params:
    """Aggregate a stacked tree. ``Mean`` runs leafwise; any other rule sees the whole
    flattened vector per client (robust rules need the full geometry)."""
    if isinstance(agg, Mean):
        return {n: agg(v, weights) for n, v in vectors.items()}
    mat, unflatten = flatten_stacked(vectors)
    return unflatten(agg(mat, weights))
