"""Bucketing (Karimireddy, He & Jaggi, 2022, Algorithm 1): robust rules → agnostic robust.

Given k inputs, draw a random permutation π, split it into ⌈k/s⌉ buckets of s consecutive
entries (the last one may be smaller) and average each bucket,
    y_b = (1/|B_b|) Σ_{i ∈ B_b} x_{π(i)},
then aggregate the bucket means with an inner rule. Averaging shrinks the spread of the good
inputs by s while at most s·δ of the buckets contain a Byzantine input, which makes CM, GM,
Krum, … (δ, c)-robust on heterogeneous data for δ ≤ δ_max / s.

The permutation comes from ``partialfl.rng.generator(seed, "bucketing", round)``: the server
binds the round with :meth:`Bucketing.bind` (see :func:`partialfl.aggregation.robust.bind`),
so runs are reproducible and independent of the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from partialfl import rng as prng
from partialfl.aggregation.robust import _prepare, _safe_mean, bind


@dataclass(frozen=True)
class Bucketing:
    """``inner`` applied to the means of random buckets of size ``s``."""

    inner: Any
    s: int = 2
    seed: int = 0
    round: int = 0
    name = "bucketing"

    def __post_init__(self) -> None:
        if not (isinstance(self.s, int | np.integer) and self.s >= 1):
            raise ValueError(f"bucketing: bucket size s must be an integer >= 1, got {self.s!r}")
        if not callable(self.inner):
            raise TypeError(f"bucketing: inner aggregator must be callable, got {self.inner!r}")

    def buckets(self, k: int) -> list[np.ndarray]:
        """The index sets B_1, …, B_⌈k/s⌉ for k inputs (this seed and round)."""
        perm = prng.generator(self.seed, "bucketing", self.round).permutation(k)
        return [perm[i : i + self.s] for i in range(0, k, self.s)]

    def bucket_means(self, X: np.ndarray) -> np.ndarray:
        """The mean of every bucket of the rows of ``X`` ``[⌈k/s⌉, d]`` (overflow-safe)."""
        # Divide before summing: huge finite inputs (e.g. 1e308) must not overflow to inf.
        return np.stack([_safe_mean(X[b]) for b in self.buckets(len(X))])

    def __call__(self, vectors, weights=None):
        X, _, restore = _prepare(vectors, weights, "bucketing")
        Y = self.bucket_means(X)
        return restore(np.asarray(self.inner(Y, np.ones(len(Y)))))

    def bind(self, seed: int, round_: int) -> Bucketing:
        """This wrapper (and its inner rule) with the buckets' randomness bound to (seed, round)."""
        return replace(self, seed=int(seed), round=int(round_),
                       inner=bind(self.inner, seed, round_))
