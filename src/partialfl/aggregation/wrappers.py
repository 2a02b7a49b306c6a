"""Wrappers around a rule: pre-aggregations that transform the inputs, then ``inner`` runs.

* :class:`Bucketing` (Karimireddy, He & Jaggi, 2022, Algorithm 1): draw a random permutation
  π, split it into ⌈k/s⌉ buckets of s consecutive entries (the last may be smaller), average
  each bucket, y_b = (1/|B_b|) Σ_{i ∈ B_b} x_{π(i)}, and aggregate the bucket means. Averaging
  shrinks the spread of the good inputs by s while at most s·δ of the buckets contain a
  Byzantine input, which makes CM, GM, Krum, … (δ, c)-robust on heterogeneous data for
  δ ≤ δ_max / s. The permutation comes from ``partialfl.rng.generator(seed, "bucketing",
  round)``, bound per round with :meth:`Bucketing.bind`. The inner rule's δ is the fraction
  of Byzantine *bucket means* (:func:`~partialfl.build.make_aggregator` gives
  it s·δ for a fraction δ of Byzantine clients).
* :class:`NearestNeighborMixing` (Allouah et al., 2023): every x_i is replaced by the average
  of its k − f nearest inputs (itself included), f = ⌊δk⌋.
* :class:`ARC` — adaptive robust clipping (Allouah et al., 2024): the ⌊2(f/k)(k − f)⌋ inputs
  of largest norm are clipped to the norm of the largest remaining one.
* :class:`StaticClipping` — x_i ← x_i · min(1, c/‖x_i‖).

NNM and ARC take the Byzantine fraction δ of the rule they wrap when none is given
(``delta=None``), so a robust rule keeps its robustness when wrapped; NNM refuses δ = 0 (it
would mix every input with all k inputs, one huge input then moves every mixed vector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from partialfl import rng as prng
from partialfl.aggregation.common import (
    bind,
    check_delta,
    count,
    norms,
    prepare,
    safe_mean,
    sq_dists_of,
)


def inner_delta(inner) -> float | None:
    """The Byzantine fraction δ a rule (or a chain of wrappers) was built with, else None."""
    while inner is not None:
        d = getattr(inner, "delta", None)
        if d is not None:
            return float(d)
        inner = getattr(inner, "inner", None)
    return None


def _wrapper_delta(obj, name: str, zero_ok: bool) -> None:
    if not callable(obj.inner):
        raise TypeError(f"{name}: inner aggregator must be callable, got {obj.inner!r}")
    delta = obj.delta
    if delta is None:
        delta = inner_delta(obj.inner)
        if delta is None:
            raise ValueError(
                f"{name}: needs the Byzantine fraction delta and the inner rule "
                f"{type(obj.inner).__name__} has none: pass delta > 0"
            )
        object.__setattr__(obj, "delta", delta)
    check_delta(delta, name)
    if delta == 0 and not zero_ok:
        raise ValueError(
            f"{name}: delta = 0 would mix every input with all k inputs (no robustness: one "
            "huge input moves every mixed vector); pass the Byzantine fraction delta > 0"
        )


@dataclass(frozen=True)
class Bucketing:
    """``inner`` applied to the means of random buckets of size ``s``."""

    inner: Any
    s: int = 2
    seed: int = 0
    round: int = 0
    name = "bucketing"

    def __post_init__(self) -> None:
        if isinstance(self.s, bool) or not (isinstance(self.s, int | np.integer) and self.s >= 1):
            raise ValueError(f"bucketing: bucket size s must be an integer >= 1, got {self.s!r}")
        if not callable(self.inner):
            raise TypeError(f"bucketing: inner aggregator must be callable, got {self.inner!r}")

    @property
    def delta(self) -> float | None:
        """The client-level fraction: the inner rule's δ (over bucket means) divided by s."""
        d = inner_delta(self.inner)
        return None if d is None else d / self.s

    def buckets(self, k: int) -> list[np.ndarray]:
        """The index sets B_1, …, B_⌈k/s⌉ for k inputs (this seed and round)."""
        perm = prng.generator(self.seed, "bucketing", self.round).permutation(k)
        return [perm[i : i + self.s] for i in range(0, k, self.s)]

    def bucket_means(self, X: np.ndarray) -> np.ndarray:
        """The mean of every bucket of the rows of ``X`` ``[⌈k/s⌉, d]`` (overflow-safe)."""
        # Divide before summing: huge finite inputs (e.g. 1e308) must not overflow to inf.
        return np.stack([safe_mean(X[b]) for b in self.buckets(len(X))])

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "bucketing")
        Y = self.bucket_means(X)
        return restore(np.asarray(self.inner(Y, np.ones(len(Y)))))

    def bind(self, seed: int, round_: int) -> Bucketing:
        """This wrapper (and its inner rule) with the buckets' randomness bound to (seed, round)."""
        return replace(self, seed=int(seed), round=int(round_),
                       inner=bind(self.inner, seed, round_))


@dataclass(frozen=True)
class _Pre:
    """A pre-aggregation: ``inner(transform(X))``; randomness of ``inner`` bound per round."""

    def transform(self, X: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        """The transformed inputs the inner rule aggregates."""
        raise NotImplementedError

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, self.name)
        return restore(np.asarray(self.inner(self.transform(X), weights)))

    def bind(self, seed: int, round_: int):
        """This wrapper with its inner rule bound to (seed, round)."""
        return replace(self, inner=bind(self.inner, seed, round_))


@dataclass(frozen=True)
class NearestNeighborMixing(_Pre):
    """NNM pre-aggregation: y_i = mean of the k − f nearest inputs to x_i (x_i included),
    f = ⌊δk⌋ with δ > 0 (``None``: the inner rule's δ); returns ``inner(y, weights)``."""

    inner: Any
    delta: float | None = None
    name = "nearest-neighbour mixing"

    def __post_init__(self) -> None:
        _wrapper_delta(self, "nearest-neighbour mixing", zero_ok=False)

    def mixing_matrix(self, X: np.ndarray) -> np.ndarray:
        """``[k, k]`` W with y = W X: row i has 1/(k − f) on the k − f nearest inputs."""
        k = len(X)
        keep = k - count(self.delta, k)
        D = sq_dists_of(X)
        D[np.arange(k), np.arange(k)] = -1.0  # i itself comes first among its ties
        nn = np.argsort(D, axis=1, kind="stable")[:, :keep]
        W = np.zeros((k, k))
        np.put_along_axis(W, nn, 1.0 / keep, axis=1)
        return W

    def transform(self, X: np.ndarray) -> np.ndarray:
        """Every row replaced by the mean of its k − ⌊δk⌋ nearest rows (itself included)."""
        # W has entries 1/(k − f) ≤ 1 summing to 1 per row: no overflow for finite X.
        return self.mixing_matrix(X) @ X

    mix = transform


@dataclass(frozen=True)
class ARC(_Pre):
    """Adaptive robust clipping: with f = ⌊δk⌋ and n = ⌊2(f/k)(k − f)⌋, the n inputs of
    largest norm are scaled to the norm of the (k − n)-th smallest (ties to the lower index);
    δ = None: the inner rule's δ. δ = 0 clips nothing."""

    inner: Any
    delta: float | None = None
    name = "arc"

    def __post_init__(self) -> None:
        _wrapper_delta(self, "arc", zero_ok=True)

    def clipped(self, k: int) -> int:
        """How many of k inputs are clipped: ⌊2(f/k)(k − f)⌋."""
        f = count(self.delta, k)
        return int(math.floor(2 * f / k * (k - f) + 1e-9))

    def transform(self, X: np.ndarray) -> np.ndarray:
        """The inputs with the n largest clipped to the (k − n)-th smallest norm."""
        k = len(X)
        n = self.clipped(k)
        if n == 0:
            return X
        r = norms(X)
        order = np.argsort(r, kind="stable")
        thr = r[order[k - n - 1]]
        big = order[k - n:]
        far = big[r[big] > thr]  # r > thr ≥ 0: a safe division
        factor = np.ones(k)
        factor[far] = thr / r[far]
        return X * factor[:, None]


@dataclass(frozen=True)
class StaticClipping(_Pre):
    """x_i ← x_i · min(1, c/‖x_i‖) for a fixed radius c > 0."""

    inner: Any
    c: float = 1.0
    name = "static clipping"

    def __post_init__(self) -> None:
        if not callable(self.inner):
            raise TypeError(f"static clipping: inner aggregator must be callable, "
                            f"got {self.inner!r}")
        if isinstance(self.c, bool) or not (isinstance(self.c, int | float) and self.c > 0
                                            and math.isfinite(self.c)):
            raise ValueError(f"static clipping: radius c must be a positive number, "
                             f"got {self.c!r}")

    def transform(self, X: np.ndarray) -> np.ndarray:
        """The inputs clipped to norm c."""
        r = norms(X)
        far = r > self.c
        if not far.any():
            return X
        factor = np.ones(len(X))
        factor[far] = self.c / r[far]
        return X * factor[:, None]
