"""Byzantine-robust aggregation rules (for BR-FFGG, the paper's Algorithm 5).

Each rule is a small frozen dataclass, validated once at construction, and called like every
aggregator: ``agg(vectors [k, d], weights [k]) -> [d]`` (numpy arrays or torch tensors; the
computation runs in float64 numpy and the result comes back in the input's type).

* :class:`CoordinateMedian`  CM(x)_j = median_i x_{i,j}.
* :class:`TrimmedMean`       per coordinate, drop the f largest and f smallest values and
  average the remaining k − 2f.
* :class:`GeometricMedian`   argmin_z Σ_i a_i ‖z − x_i‖ by the smoothed Weiszfeld iteration
  (Pillutla et al., 2022, RFA), run in the k-dimensional span of the inputs (Gram matrix).
* :class:`Krum`              Krum / multi-Krum (Blanchard et al., 2017).
* :class:`CenteredClipping`  (Karimireddy et al., 2021).
* :class:`MDA`               minimum-diameter averaging (El Mhamdi et al., 2018).
* :class:`MoNNA`             mean of the k − f nearest neighbours of a trusted input
  (Farhadkhani et al., 2023).
* :class:`Meamed`            per coordinate, mean of the k − f values closest to the median
  (Xie et al., 2018).
* :class:`CAF`               covariance-bound agnostic filter (Allouah et al., 2024).
* :class:`SMEA`              smallest-maximum-eigenvalue averaging (Allouah et al., 2023).

Conventions (where byzfl 0.0.11 differs, the byzfl call giving the same result is named):
the number of Byzantine inputs is a fraction ``delta`` of the inputs seen at call time,
f = ⌊δk⌋ (byzfl takes an integer f), so the same rule works on raw updates and on bucket means.
Krum's score sums the k − f − 2 nearest squared distances (Blanchard et al.; byzfl averages
the k − f − 1 nearest: ``byzfl.Krum(f + 1)`` selects the same input). CAF and SMEA use the
exact top eigenvalue of the covariance (byzfl: one power-iteration step from a random start,
exact only when the covariance has rank one). Ties go to the lower index. Robust rules treat
all inputs alike and ignore ``weights`` (a Byzantine client could claim any weight), except
:class:`GeometricMedian` with ``weighted=True``.

Non-finite inputs are rejected with a clear error: the server drops them first
(:func:`~partialfl.aggregation.common.drop_nonfinite`), so a NaN or inf sent by a client never
reaches θ.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from partialfl.aggregation.common import (
    check_delta,
    count,
    gram,
    norms,
    prepare,
    safe_mean,
    sq_dists,
    to_numpy,
)


def _check_int(value, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | np.integer) and value >= minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _f_below_half(delta: float, k: int, name: str) -> int:
    f = count(delta, k)
    if 2 * f >= k:  # unreachable for δ < 1/2, kept as a guard
        raise ValueError(f"{name}: cannot tolerate f = {f} of k = {k} inputs (needs 2f < k)")
    return f


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
    converges only sublinearly to a median that sits on an input). Reaching ``max_iter`` first
    raises a RuntimeWarning. ``weighted=False`` uses a_i = 1.
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

    def solve(self, vectors, weights=None) -> tuple[np.ndarray, int, float]:
        """``(z, iterations, residual)`` in numpy (for tests and diagnostics). The iteration
        runs on the Gram matrix; should float64 cancellation there stall it (e.g. inputs
        spread over many orders of magnitude), it continues with exact distances in ℝ^d."""
        X, a, _ = prepare(vectors, weights, "geometric median")
        a = a if self.weighted else np.ones(len(X))
        G = gram(X)[0]
        D = np.sqrt(sq_dists(G))
        j0 = int(np.argmin(D @ a))
        alpha = np.zeros(len(X))
        alpha[j0] = 1.0
        scale = float(np.median(D[j0]))
        if scale <= 1e-12 * max(float(np.sqrt(np.diag(G).max())), np.finfo(np.float64).tiny):
            # At least half of the inputs coincide with the medoid: their mass outweighs the
            # pull of all others (unweighted), so that point is the geometric median.
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
        for it in range(1, max_iter + 1):
            j = int(np.argmin(r))
            if r[j] <= 1e-3 * scale and self._optimal_at_input(geo, a, j, nu):
                alpha = np.zeros(len(a))
                alpha[j] = 1.0
                return alpha, it, 0.0, True
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
    def _optimal_at_input(geo, a, j: int, nu: float) -> bool:
        """Is the input x_j itself the minimiser? 0 ∈ ∂g(x_j) iff
        ‖Σ_{i ∉ C} a_i (x_j − x_i)/‖x_j − x_i‖‖ ≤ Σ_{i ∈ C} a_i for the inputs C that
        coincide with x_j (within ν or the geometry's precision)."""
        d = geo.row(j)
        on = d <= np.maximum(nu, geo.precision(j))
        if on.all():
            return True
        c = np.where(on, 0.0, a / np.where(on, 1.0, d))
        v = -c
        v[j] += c.sum()
        return geo.norm(v) <= a[on].sum()

    def __call__(self, vectors, weights=None):
        _, restore = to_numpy(vectors)
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
            _check_int(self.m, "krum: m (inputs to average)", 1)
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
        _check_int(self.iters, "centered clipping: iters", 1)
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


def _subsets(k: int, size: int, limit: int, name: str):
    """Batches ``[B, size]`` of all size-subsets of range(k) in lexicographic order."""
    n = math.comb(k, size)
    if n > limit:
        raise ValueError(f"{name}: {n:,} subsets of {size} among {k} inputs exceed "
                         f"max_subsets={limit:,} (the rule is exhaustive); raise max_subsets, "
                         "lower delta, or use bucketing")
    it = itertools.combinations(range(k), size)
    while True:
        batch = np.array(list(itertools.islice(it, 4096)), dtype=np.int64)
        if not len(batch):
            return
        yield batch


def _check_limit(limit, name: str) -> None:
    _check_int(limit, f"{name}: max_subsets", 1)


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
        _check_limit(self.max_subsets, "mda")

    def select(self, X: np.ndarray) -> np.ndarray:
        """The indices of the minimum-diameter subset S (sorted)."""
        k = len(X)
        m = k - _f_below_half(self.delta, k, "mda")
        if m == k:
            return np.arange(k)
        D = sq_dists(gram(X)[0])
        best, best_val = None, np.inf
        for S in _subsets(k, m, self.max_subsets, "mda"):
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
        _check_int(self.index, "monna: index", 0)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "monna")
        k = len(X)
        if self.index >= k:
            raise ValueError(f"monna: trusted index {self.index} but only {k} inputs")
        d2 = norms(X - X[self.index])
        d2[self.index] = -1.0  # itself first among its ties
        nn = np.sort(np.argsort(d2, kind="stable")[: k - count(self.delta, k)])
        return restore(safe_mean(X[nn]))


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
    remembered μ_c. All in k dimensions through the Gram matrix. f = ⌊δk⌋ (f = 0: the mean)."""

    delta: float = 0.1
    name = "caf"

    def __post_init__(self) -> None:
        check_delta(self.delta, "caf")

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
        f = _f_below_half(self.delta, len(X), "caf")
        c = self.weights(gram(X)[0], f)
        return restore((c / c.sum()) @ X)


@dataclass(frozen=True)
class SMEA:
    """Smallest maximum eigenvalue averaging (Allouah et al., 2023): the mean of the k − f
    inputs whose empirical covariance has the smallest top eigenvalue (exhaustive over
    C(k, f) subsets, first minimiser in lexicographic order). f = ⌊δk⌋."""

    delta: float = 0.1
    max_subsets: int = 200_000
    name = "smea"

    def __post_init__(self) -> None:
        check_delta(self.delta, "smea")
        _check_limit(self.max_subsets, "smea")

    def select(self, X: np.ndarray) -> np.ndarray:
        """The indices of the subset of smallest top covariance eigenvalue (sorted)."""
        k = len(X)
        m = k - _f_below_half(self.delta, k, "smea")
        if m == k:
            return np.arange(k)
        G = gram(X)[0]
        C = np.eye(m) - 1.0 / m
        best, best_val = None, np.inf
        for S in _subsets(k, m, self.max_subsets, "smea"):
            H = C @ G[S[:, :, None], S[:, None, :]] @ C
            lam = np.linalg.eigvalsh(H)[:, -1]
            i = int(np.argmin(lam))
            if lam[i] < best_val:
                best, best_val = S[i], lam[i]
        return best

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "smea")
        return restore(safe_mean(X[self.select(X)]))
