"""The aggregator interface and the (weighted) mean.

Non-finite inputs are never averaged: :class:`Mean` skips every row that contains NaN or
±inf (and, when weighted, every row whose weight is not a finite number ≥ 0), warns with the
number skipped, and raises :class:`~partialfl.aggregation.common.NonFiniteInputError` when no
row is left. Runtimes drop such rows where they enter and count them
(:func:`~partialfl.aggregation.common.drop_nonfinite`); this guard is the last line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from partialfl import arrays
from partialfl.aggregation.common import (
    NonFiniteInputError,
    finite_rows,
    positive_total,
    to_numpy,
    warn_skipped,
)
from partialfl.aggregation.compose import AggregatorOptions, register_rule
from partialfl.registry import option
from partialfl.tree import flatten_stacked
from partialfl.types import Params


@runtime_checkable
class Aggregator(Protocol):
    """``agg(vectors [k, d], weights [k]) -> [d]``."""

    def __call__(self, vectors, weights): ...


@dataclass(frozen=True)
class Mean:
    """(Weighted) mean Σ_i a_i x_i / Σ_i a_i over the finite rows; ``weighted=False`` uses
    a_i = 1. Rows with NaN/inf (or a bad weight) are skipped with a warning, never averaged."""

    weighted: bool = False

    def usable(self, vectors, weights) -> np.ndarray:
        """``[k]`` bool: rows that are finite (and, weighted, have a finite weight ≥ 0)."""
        ok = finite_rows(vectors)
        if self.weighted:
            w = np.asarray(to_numpy(weights)[0], dtype=np.float64).reshape(-1)
            if len(w) != len(ok):
                raise ValueError(f"mean: {len(w)} weights for {len(ok)} input vectors")
            ok &= np.isfinite(w) & (w >= 0)
        return ok

    def __call__(self, vectors, weights=None):
        ok = self.usable(vectors, weights)
        if not ok.all():
            vectors, weights = _keep(vectors, weights, ok, "mean")
        return self._mean(vectors, weights)

    def _mean(self, vectors, weights):
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
            if not self.weighted:
                out = vectors.mean(0)
            else:
                positive_total(np.asarray(to_numpy(weights)[0], dtype=np.float64), "mean")
                a = _as_like(weights, vectors)
                out = (a.reshape((-1,) + (1,) * (vectors.ndim - 1)) * vectors).sum(0) / a.sum()
        if _all_finite(out):
            return out
        return self._scaled_mean(vectors, weights)

    def _scaled_mean(self, vectors, weights):
        """Σ_i p_i x_i with p = a / Σa formed in float64 from a / max a: finite inputs and
        weights give a finite mean (it lies between the inputs) even where a·x, Σa or Σx
        overflow (e.g. a weight of 1e39 in float32, entries near 1e308)."""
        arr, restore = to_numpy(vectors)
        X = arr.astype(np.float64).reshape(len(arr), -1)
        if self.weighted:
            a = np.asarray(to_numpy(weights)[0], dtype=np.float64).reshape(-1)
            a = a / a.max()
        else:
            a = np.ones(len(X))
        p = a / a.sum()
        with np.errstate(over="ignore"):
            out = p @ X
        if not np.isfinite(out).all():  # a partial sum overflowed: add the terms scaled
            out = (p[:, None] * (X / 2)).sum(0) * 2
        return restore(out.reshape(arr.shape[1:]))


def _all_finite(x) -> bool:
    return bool(arrays.rows_finite(x.reshape(1, -1)).all())


def _check_some_left(ok: np.ndarray, name: str) -> None:
    """Warn about the skipped rows; refuse when none is left."""
    k = len(ok)
    if not ok.any():
        raise NonFiniteInputError(f"{name}: all {k} input rows contain NaN/inf (or a bad "
                                  "weight); nothing to aggregate")
    warn_skipped(name, int(k - ok.sum()), k)


def _keep(vectors, weights, ok: np.ndarray, name: str):
    """The rows ``ok`` of vectors (and weights); warns, and refuses when none is left."""
    _check_some_left(ok, name)
    weights = None if weights is None else np.asarray(to_numpy(weights)[0])[ok]
    return _rows(vectors, ok), weights


def _as_like(weights, vectors):
    return arrays.as_like(weights, vectors)


def aggregate_tree(agg, vectors: Params, weights) -> Params:
    """Aggregate a stacked tree. ``Mean`` runs leafwise (after skipping, in every leaf, the
    clients with a non-finite value in any leaf); any other rule sees the whole flattened
    vector per client (robust rules need the full geometry)."""
    if isinstance(agg, Mean):
        ok = np.logical_and.reduce([agg.usable(v, weights) for v in vectors.values()])
        if not ok.all():
            _check_some_left(ok, "mean")
            vectors = {n: _rows(v, ok) for n, v in vectors.items()}
            weights = None if weights is None else np.asarray(to_numpy(weights)[0])[ok]
        return {n: agg._mean(v, weights) for n, v in vectors.items()}
    mat, unflatten = flatten_stacked(vectors)
    return unflatten(agg(mat, weights))


def _rows(v, ok: np.ndarray):
    return arrays.take_rows(v, np.flatnonzero(ok))


@dataclass(frozen=True)
class MeanOptions(AggregatorOptions):
    """The mean's weighting."""

    weighted: bool = option(False, "weight each client by the weight it sent (e.g. its "
                            "number of examples)")


register_rule("mean", Mean, MeanOptions, doc="The (optionally weighted) mean of the finite "
              "rows: FedAvg's and FFGG's default.")
