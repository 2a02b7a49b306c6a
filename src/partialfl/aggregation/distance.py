"""Distance-based robust rules: they select or weight whole input vectors by their pairwise
(or to-a-centre) Euclidean distances.

* :class:`Krum`              Krum / multi-Krum (Blanchard et al., 2017).
* :class:`CenteredClipping`  (Karimireddy et al., 2021).
* :class:`MDA`               minimum-diameter averaging (El Mhamdi et al., 2018).
* :class:`MoNNA`             mean of the k − f nearest neighbours of a trusted input
  (Farhadkhani et al., 2023).

The geometric median is in :mod:`~partialfl.aggregation.geometric_median`; conventions shared
by every rule in :mod:`partialfl.aggregation.rules`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partialfl.aggregation.common import (
    check_delta,
    check_int,
    check_limit,
    count,
    f_below_half,
    gram,
    norms,
    prepare,
    safe_mean,
    sq_dists,
    subsets,
)


@dataclass(frozen=True)
class Krum:
    """Multi-Krum: average the ``m`` inputs with the lowest Krum score (m = 1: Krum).

    score_i = Σ_{j ∈ N_i} ‖x_i − x_j‖², N_i the k − f − 2 nearest other inputs, f = ⌊δk⌋.
    ``m=None`` selects k − f inputs (the usual multi-Krum). Ties go to the lower index.
    Krum's guarantee needs k ≥ 2f + 3; with fewer inputs (e.g. after bucketing, or when
    non-finite updates were dropped) the call raises, unless ``cap=True`` — the explicit choice
    to tolerate only f = ⌊(k − 3)/2⌋ then.
    """

    delta: float = 0.1
    m: int | None = 1
    cap: bool = False
    name = "krum"

    def __post_init__(self) -> None:
        check_delta(self.delta, "krum")
        if self.m is not None:
            check_int(self.m, "krum: m (inputs to average)", 1)
        if not isinstance(self.cap, bool):
            raise ValueError(f"krum: cap must be True or False, got {self.cap!r}")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋; Krum's guarantee needs k ≥ 2f + 3 (f = 0 needs nothing)."""
        f = count(self.delta, k)
        if f == 0 or k >= 2 * f + 3:
            return f
        if self.cap:
            return max(0, (k - 3) // 2)
        raise ValueError(
            f"krum: f = ⌊δk⌋ = {f} Byzantine inputs among k = {k} needs k ≥ 2f + 3 = "
            f"{2 * f + 3}; lower delta (or the bucket size), or pass cap=True to tolerate only "
            f"f = {max(0, (k - 3) // 2)} explicitly"
        )

    def scores(self, X: np.ndarray) -> np.ndarray:
        """score_i for every input (k ≥ 2), in the units s² of :func:`gram` (s = 1 unless
        the inputs exceed 1e100 or are all below 1e-100)."""
        k = len(X)
        f = self.tolerated(k)
        nb = max(1, k - f - 2)
        D = sq_dists(gram(X)[0])
        np.fill_diagonal(D, np.inf)
        return np.sort(D, axis=1)[:, :nb].sum(1)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "krum")
        k = len(X)
        m = k - self.tolerated(k) if self.m is None else self.m
        if m > k:
            raise ValueError(f"krum: cannot average m={m} of only k={k} inputs")
        if k == 1:
            return restore(X[0].copy())
        sel = np.sort(np.argsort(self.scores(X), kind="stable")[:m])
        return restore(X[sel[0]].copy() if m == 1 else safe_mean(X[sel]))


@dataclass(frozen=True)
class CenteredClipping:
    """Centered clipping: v ← v + (1/k) Σ_i (x_i − v)·min(1, τ/‖x_i − v‖), ``iters`` times.

    v⁰ is the coordinate-wise median (``init="median"``) or 0 (``init="zero"``). The radius is
    ``tau`` if given, else ``tau_scale`` · median_i ‖x_i − v⁰‖ (scale-equivariant).
    """

    tau: float | None = None
    tau_scale: float = 1.0
    iters: int = 3
    init: str = "median"
    name = "cc"

    def __post_init__(self) -> None:
        if self.tau is not None and not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"centered clipping: radius tau must be positive, got {self.tau!r}")
        if not (self.tau_scale > 0 and math.isfinite(self.tau_scale)):
            raise ValueError(f"centered clipping: tau_scale must be positive, "
                             f"got {self.tau_scale!r}")
        check_int(self.iters, "centered clipping: iters", 1)
        if self.init not in ("median", "zero"):
            raise ValueError(f"centered clipping: unknown init {self.init!r}; allowed: "
                             "'median', 'zero'")

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "centered clipping")
        v = np.median(X, axis=0) if self.init == "median" else np.zeros(X.shape[1])
        tau = self.tau
        if tau is None:
            tau = self.tau_scale * float(np.median(norms(X - v)))
            if tau == 0.0:
                return restore(v)
        for _ in range(self.iters):
            D = X - v
            r = norms(D)
            far = r > tau  # only these are clipped: τ/r < 1 there, never a division by ~0
            s = np.ones_like(r)
            s[far] = tau / r[far]
            v = v + (s / len(X)) @ D  # terms ≤ ‖D‖∞/k: no overflow
        return restore(v)

@dataclass(frozen=True)
class MDA:
    """Minimum-diameter averaging: the mean of the k − f inputs S minimising
    max_{i,j ∈ S} ‖x_i − x_j‖ (exhaustive over C(k, f) subsets; the first minimiser in
    lexicographic order of S, as byzfl). f = ⌊δk⌋."""

    delta: float = 0.1
    max_subsets: int = 200_000
    name = "mda"

    def __post_init__(self) -> None:
        check_delta(self.delta, "mda")
        check_limit(self.max_subsets, "mda")

    def select(self, X: np.ndarray) -> np.ndarray:
        """The indices of the minimum-diameter subset S (sorted)."""
        k = len(X)
        m = k - f_below_half(self.delta, k, "mda")
        if m == k:
            return np.arange(k)
        D = sq_dists(gram(X)[0])
        best, best_val = None, np.inf
        for S in subsets(k, m, self.max_subsets, "mda"):
            diam = D[S[:, :, None], S[:, None, :]].max((1, 2))
            i = int(np.argmin(diam))
            if diam[i] < best_val:
                best, best_val = S[i], diam[i]
        return best

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "mda")
        return restore(safe_mean(X[self.select(X)]))


@dataclass(frozen=True)
class MoNNA:
    """Mean of the k − f inputs nearest to the input at position ``index`` (itself included):
    the server's trusted vector, e.g. its own update (byzfl's ``idx``). f = ⌊δk⌋. Its
    guarantee needs that input to be honest: under bucketing it is a bucket mean, which may
    contain a Byzantine input (the Byzantine table shows bucketed MoNNA failing)."""

    delta: float = 0.1
    index: int = 0
    name = "monna"

    def __post_init__(self) -> None:
        check_delta(self.delta, "monna")
        check_int(self.index, "monna: index", 0)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "monna")
        k = len(X)
        if self.index >= k:
            raise ValueError(f"monna: trusted index {self.index} but only {k} inputs")
        d2 = norms(X - X[self.index])
        d2[self.index] = -1.0  # itself first among its ties
        nn = np.sort(np.argsort(d2, kind="stable")[: k - count(self.delta, k)])
        return restore(safe_mean(X[nn]))
