"""Spectral robust rules: they filter or select inputs by the top eigenvalue of the inputs'
empirical covariance, computed exactly in k dimensions through the Gram matrix.

* :class:`CAF`   covariance-bound agnostic filter (Allouah et al., 2024).
* :class:`SMEA`  smallest-maximum-eigenvalue averaging (Allouah et al., 2023).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from partialfl.aggregation.common import (
    check_delta,
    check_limit,
    gram,
    mean_rows,
    prepare,
    subsets,
    tame,
)
from partialfl.aggregation.compose import AggregatorOptions, register_rule
from partialfl.aggregation.protection import check, check_flag
from partialfl.registry import option


def _top_eig(H: np.ndarray) -> tuple[float, np.ndarray]:
    lam, U = np.linalg.eigh(H)
    return float(lam[-1]), U[:, -1]


@dataclass(frozen=True)
class CAF:
    """Covariance-bound agnostic filter (Allouah et al., 2024), byzfl's iteration with the
    exact top eigenpair. Weights c = 1; while Σc > k − 2f: μ_c = Σc_i x_i / Σc, (λ, v) the top
    eigenpair of Σ_c = Σ_i c_i (x_i − μ_c)(x_i − μ_c)ᵀ / Σc, remember μ_c if λ is the smallest
    so far, then c_i ← c_i (1 − τ_i / max_j τ_j) with τ_i = ⟨x_i − μ_c, v⟩². When an input
    already filtered out (c_j = 0) dominates so much that the total weight would drop by less
    than 10⁻³, the max is taken over the inputs still weighted (byzfl never switches and can
    stall for ~forever on a 1e30 input; the switch zeroes at least one weight). Returns the
    remembered μ_c. All in k dimensions through the Gram matrix. f = ⌊δk⌋ (δ = 0: the mean).

    Bound: k ≥ 2f + 1 and, for δ > 0, f ≥ 1 (k ≥ ⌈1/δ⌉); refused below unless
    ``allow_unprotected=True``."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    allow_unprotected: bool = False
    name = "caf"

    def __post_init__(self) -> None:
        check_delta(self.delta, "caf")
        check_flag(self.allow_unprotected, "caf: allow_unprotected")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, refused where the rule protects nothing."""
        return check("caf", self.delta, k, self.allow_unprotected)

    def weights(self, G: np.ndarray, f: int) -> np.ndarray:
        """The weights c of the returned mean μ_c."""
        k = len(G)
        c = np.ones(k)
        best_c, best_lam = c.copy(), np.inf
        while c.sum() > k - 2 * f:
            p = c / c.sum()
            P = np.eye(k) - p[None, :]  # rows: x_i − μ_c
            H = P @ G @ P.T
            sq = np.sqrt(c)
            lam, u = _top_eig(sq[:, None] * H * sq[None, :] / c.sum())
            if lam < best_lam:
                best_c, best_lam = c.copy(), lam
            if lam <= 0:
                break
            proj = H @ (sq * u) / math.sqrt(lam * c.sum())
            tau = proj**2
            new = np.maximum(c * (1.0 - tau / tau.max()), 0.0)
            if c.sum() - new.sum() < 1e-3:  # a filtered-out input dominates: use the rest
                tau = np.where(c > 0, tau, 0.0)
                new = np.maximum(c * (1.0 - tau / tau.max()), 0.0)
            c = new
        return best_c

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "caf")
        X = tame(X)  # the weights are of the tamed rows: combine those
        c = self.weights(gram(X)[0], self.tolerated(len(X)))
        return restore((c / c.sum()) @ X)


@dataclass(frozen=True)
class SMEA:
    """Smallest maximum eigenvalue averaging (Allouah et al., 2023): the mean of the k − f
    inputs whose empirical covariance has the smallest top eigenvalue (exhaustive over
    C(k, f) subsets, first minimiser in lexicographic order). f = ⌊δk⌋.

    Bound: k ≥ 2f + 1 and, for δ > 0, f ≥ 1 (k ≥ ⌈1/δ⌉); refused below unless
    ``allow_unprotected=True``."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    max_subsets: int = 200_000
    allow_unprotected: bool = False
    name = "smea"

    def __post_init__(self) -> None:
        check_delta(self.delta, "smea")
        check_limit(self.max_subsets, "smea")
        check_flag(self.allow_unprotected, "smea: allow_unprotected")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, refused where the rule protects nothing."""
        return check("smea", self.delta, k, self.allow_unprotected)

    def select(self, X: np.ndarray) -> np.ndarray:
        """The indices of the subset of smallest top covariance eigenvalue (sorted)."""
        k = len(X)
        m = k - self.tolerated(k)
        if m == k:
            return np.arange(k)
        G = gram(X)[0]
        C = np.eye(m) - 1.0 / m
        best, best_val = None, np.inf
        for S in subsets(k, m, self.max_subsets, "smea"):
            H = C @ G[S[:, :, None], S[:, None, :]] @ C
            lam = np.linalg.eigvalsh(H)[:, -1]
            i = int(np.argmin(lam))
            if lam[i] < best_val:
                best, best_val = S[i], lam[i]
        return best

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "smea")
        return restore(mean_rows(X, self.select(X)))


@dataclass(frozen=True)
class SMEAOptions(AggregatorOptions):
    """The subsets SMEA may search."""

    max_subsets: int = option(200_000, "refuse a cohort with more candidate subsets")


register_rule("caf", CAF, doc="Covariance-bound agnostic filter (CAF): down-weights rows "
              "along the top eigenvector of their covariance.")
register_rule("smea", SMEA, SMEAOptions, doc="Smallest maximum eigenvalue averaging (SMEA): "
              "the mean of the k − f rows whose covariance has the smallest top eigenvalue.")
