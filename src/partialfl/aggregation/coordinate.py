"""Coordinate-wise robust rules: each coordinate j is aggregated from the k values x_{1,j}, …,
x_{k,j} alone.

* :class:`CoordinateMedian`  CM(x)_j = median_i x_{i,j}.
* :class:`TrimmedMean`       drop the f largest and f smallest values, average the k − 2f left.
* :class:`Meamed`            the mean of the k − f values closest to the median (Xie et al., 2018).

f = ⌊δk⌋ (see :mod:`partialfl.aggregation.rules` for the conventions shared by every rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialfl.aggregation.common import check_delta, count, prepare, safe_mean


@dataclass(frozen=True)
class CoordinateMedian:
    """CM(x_1, …, x_k)_j = median_i x_{i,j} (mean of the two middle values for even k)."""

    name = "cm"

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "coordinate-wise median")
        return restore(np.median(X, axis=0))


@dataclass(frozen=True)
class TrimmedMean:
    """Per coordinate: sort, drop the f = ⌊δk⌋ smallest and f largest, average the rest."""

    delta: float = 0.1
    name = "tm"

    def __post_init__(self) -> None:
        check_delta(self.delta, "trimmed mean")

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "trimmed mean")
        k = len(X)
        b = count(self.delta, k)  # δ < 1/2 leaves k − 2b >= 1 values
        S = np.sort(X, axis=0)
        return restore(safe_mean(S[b : k - b]))

@dataclass(frozen=True)
class Meamed:
    """Mean around the median: per coordinate j, the mean of the k − f values x_{i,j}
    closest to median_i x_{i,j} (ties to the lower index). f = ⌊δk⌋."""

    delta: float = 0.1
    name = "meamed"

    def __post_init__(self) -> None:
        check_delta(self.delta, "meamed")

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "meamed")
        k = len(X)
        m = k - count(self.delta, k)
        med = np.median(X, axis=0)
        idx = np.argsort(np.abs(X - med), axis=0, kind="stable")[:m]
        return restore(safe_mean(np.take_along_axis(X, idx, axis=0)))
