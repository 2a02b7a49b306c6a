"""The geometric median argmin_z Σ_i a_i ‖z − x_i‖ (RFA, Pillutla et al., 2022) by smoothed
Weiszfeld iterations run in the k-dimensional span of the inputs (Gram matrix)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from partialfl.aggregation.common import (
    gram,
    norms,
    positive_total,
    prepare,
    sq_dists,
    tame,
    to_numpy,
)
from partialfl.aggregation.compose import AggregatorOptions, register_rule
from partialfl.aggregation.protection import majority
from partialfl.registry import option


@dataclass(frozen=True)
class GeometricMedian:
    """argmin_z Σ_i a_i ‖z − x_i‖ by smoothed Weiszfeld (RFA, Pillutla et al., 2022).

    Every Weiszfeld iterate is a convex combination z = Σ_i α_i x_i of the inputs, so the
    iteration runs on α ∈ ℝ^k with distances from the Gram matrix G (:func:`gram`):
    ‖z − x_i‖² = G_ii − 2(Gα)_i + αᵀGα — O(k²d) once, then O(k²) per iteration; z = Xᵀα is
    formed once at the end. z⁰ is the medoid (the input of least Σ_j a_j‖x_i − x_j‖, a robust
    start). With r_i = ‖z − x_i‖ and β_i = a_i / max(ν, r_i): α ← β / Σβ. The iteration stops
    when the optimality residual ‖Σ_i β_i (z − x_i)‖ / Σ_i a_i (the norm of the average unit
    vector pointing from the inputs to z, 0 at the smoothed optimum) is ≤ ``tol``. The
    smoothing ν = ``nu`` · median_i ‖z⁰ − x_i‖ is relative to the spread of the inputs, so the
    rule is exactly scale-equivariant. When an iterate comes close to an input x_j, the
    subgradient condition of x_j is checked and x_j returned if it is the minimiser (Weiszfeld
    converges only sublinearly to a median that sits on an input), else the iterate steps off
    x_j by Vardi and Zhang's modified step (the medoid start is such an input). Reaching
    ``max_iter`` first raises a RuntimeWarning. ``weighted=False`` uses a_i = 1.
    """

    nu: float = 1e-8
    tol: float = 1e-7
    max_iter: int = 2000
    weighted: bool = False
    name = "gm"

    def __post_init__(self) -> None:
        if not (self.nu > 0 and math.isfinite(self.nu)):
            raise ValueError(f"geometric median: smoothing nu must be positive, got {self.nu!r}")
        if not (self.tol > 0 and math.isfinite(self.tol)):
            raise ValueError(f"geometric median: tol must be positive, got {self.tol!r}")
        if isinstance(self.max_iter, bool) or not (isinstance(self.max_iter, int)
                                                   and self.max_iter >= 1):
            raise ValueError(f"geometric median: max_iter must be an integer >= 1, "
                             f"got {self.max_iter!r}")

    def tolerated(self, k: int) -> int:
        """⌊(k − 1)/2⌋: the geometric median's breakdown point is 1/2; weighted, a Byzantine
        client may claim any weight, so none."""
        return 0 if self.weighted else majority("geometric median", k)

    def solve(self, vectors, weights=None) -> tuple[np.ndarray, int, float]:
        """``(z, iterations, residual)`` in numpy (for tests and diagnostics). The iteration
        runs on the Gram matrix; should float64 cancellation there stall it (e.g. inputs
        spread over many orders of magnitude), it continues with exact distances in ℝ^d."""
        X, a, _ = prepare(vectors, weights, "geometric median")
        X = tame(X)  # (a row 1e100 beyond the median one pulls as a unit vector either way)
        a = positive_total(a, "geometric median") if self.weighted else np.ones(len(X))
        if not 1e-150 < a.max() < 1e150:  # the minimiser does not change with the scale of a
            a = a / a.max()
        G = gram(X)[0]
        D = np.sqrt(sq_dists(G))
        j0 = int(np.argmin(D @ a))
        alpha = np.zeros(len(X))
        alpha[j0] = 1.0
        scale = float(np.median(D[j0]))
        on = D[j0] <= 1e-7 * np.sqrt(np.maximum(G[j0, j0], np.diag(G)))  # G's precision
        if 2 * a[on].sum() >= a.sum():
            # Inputs holding half of the mass coincide with the medoid: their pull outweighs
            # that of all others, so that point is the geometric median.
            return X[j0].copy(), 0, 0.0
        nu = self.nu * scale
        alpha, it, resid, done = self._iterate(_GramGeometry(G, D), a, alpha, nu, scale,
                                               self.max_iter)
        if not done:
            alpha, more, resid, done = self._iterate(_ExactGeometry(X), a, alpha, nu, scale,
                                                     self.max_iter)
            it += more
        if not done:
            warnings.warn(
                f"geometric median: smoothed Weiszfeld did not reach tol={self.tol} in "
                f"{self.max_iter} iterations (residual {resid:.2e})", RuntimeWarning,
                stacklevel=3,
            )
        if np.count_nonzero(alpha) == 1:
            return X[int(np.argmax(alpha))].copy(), it, resid
        return alpha @ X, it, resid

    def _iterate(self, geo, a, alpha, nu: float, scale: float, max_iter: int):
        """Weiszfeld on α from ``alpha``: ``(α, iterations, residual, converged)``."""
        total = a.sum()
        r = geo.dists(alpha)
        resid = math.inf
        left: set[int] = set()  # inputs found not optimal and stepped off
        for it in range(1, max_iter + 1):
            j = int(np.argmin(r))
            if r[j] <= 1e-3 * scale and j not in left:
                c, R, A = self._pull(geo, a, j, nu)
                if R <= A:
                    alpha = np.zeros(len(a))
                    alpha[j] = 1.0
                    return alpha, it, 0.0, True
                # Vardi & Zhang (2000): off a non-optimal input along the pull of the others,
                # z = (A/R) x_j + (1 − A/R) T̃, T̃ = Σ c_i x_i / Σ c — a descent step, where
                # the smoothed step would stay at x_j (its weight a_j/ν dominates).
                alpha = (1.0 - A / R) * c / c.sum()
                alpha[j] += A / R
                left.add(j)
                r = geo.dists(alpha)
                continue
            beta = a / np.maximum(nu, r)
            new = beta / beta.sum()
            # Residual at z (before the step): Σβ_i (z − x_i) = Σβ · (z − z_new).
            resid = float(beta.sum() * geo.norm(alpha - new) / total)
            alpha = new
            r = geo.dists(alpha)
            if resid <= self.tol:
                return alpha, it, resid, True
        return alpha, max_iter, resid, False

    @staticmethod
    def _pull(geo, a, j: int, nu: float) -> tuple[np.ndarray, float, float]:
        """``(c, R, A)`` at the input x_j: c_i = a_i/‖x_j − x_i‖ for the inputs i ∉ C, the
        norm R = ‖Σ_{i ∉ C} c_i (x_i − x_j)‖ of the others' pull and the mass A of the
        inputs C that coincide with x_j (within ν or the geometry's precision). x_j is the
        minimiser iff 0 ∈ ∂g(x_j) iff R ≤ A."""
        d = geo.row(j)
        on = d <= np.maximum(nu, geo.precision(j))
        if on.all():
            return np.zeros(len(a)), 0.0, float(a.sum())
        c = np.where(on, 0.0, a / np.where(on, 1.0, d))
        v = -c
        v[j] += c.sum()
        return c, geo.norm(v), float(a[on].sum())

    def __call__(self, vectors, weights=None):
        arr, restore = to_numpy(vectors)
        self.tolerated(len(arr))  # refused below a planned f (see protection.cohort_checked)
        return restore(self.solve(vectors, weights)[0])


class _GramGeometry:
    """Distances of convex combinations z = Xᵀα from the Gram matrix (O(k²) each)."""

    def __init__(self, G: np.ndarray, D: np.ndarray) -> None:
        self.G, self.D, self.g = G, D, np.diag(G)

    def dists(self, alpha):
        """‖z − x_i‖ for z = Xᵀα, every i."""
        Ga = self.G @ alpha
        return np.sqrt(np.maximum(self.g - 2.0 * Ga + alpha @ Ga, 0.0))

    def row(self, j: int):
        """‖x_j − x_i‖, every i."""
        return self.D[j]

    def norm(self, v) -> float:
        """‖Xᵀv‖."""
        return float(np.sqrt(max(v @ self.G @ v, 0.0)))

    def precision(self, j: int):
        """Distances this small are float64 noise of G_ii + G_jj − 2G_ij."""
        return 1e-7 * np.sqrt(np.maximum(self.g, self.g[j]))


class _ExactGeometry:
    """The same quantities computed in ℝ^d (O(kd) each): the fallback."""

    def __init__(self, X: np.ndarray) -> None:
        self.X = X

    def dists(self, alpha):
        """‖z − x_i‖ for z = Xᵀα, every i."""
        return norms(self.X - alpha @ self.X)

    def row(self, j: int):
        """‖x_j − x_i‖, every i."""
        return norms(self.X - self.X[j])

    def norm(self, v) -> float:
        """‖Xᵀv‖."""
        return float(norms((v @ self.X)[None])[0])

    def precision(self, j: int):
        """Distances this small are float64 noise around x_j."""
        return 1e-12 * float(np.abs(self.X[j]).max()) + np.finfo(np.float64).tiny


@dataclass(frozen=True)
class GMOptions(AggregatorOptions):
    """The Weiszfeld iterations of the geometric median."""

    nu: float = option(1e-8, "smoothing ν of the distances")
    tol: float = option(1e-7, "relative stopping tolerance")
    max_iter: int = option(2000, "iterations at most")
    weighted: bool = option(False, "weight each row by the weight it sent")


register_rule("gm", GeometricMedian, GMOptions, aliases=("geometric-median", "geomed", "rfa"),
              doc="Geometric median by smoothed Weiszfeld iterations (RFA, Pillutla et al. "
              "2022).")
