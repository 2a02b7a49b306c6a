"""Byzantine-robust aggregation rules (for BR-FFGG, the paper's Algorithm 5).

Each rule is a small frozen dataclass, validated once at construction, and called like every
aggregator: ``agg(vectors [k, d], weights [k]) -> [d]`` (numpy arrays or torch tensors; the
computation runs in float64 numpy and the result comes back in the input's type).

* :class:`CoordinateMedian`  CM(x)_j = median_i x_{i,j}.
* :class:`TrimmedMean`       per coordinate, drop the b = ⌊δk⌋ largest and b smallest values
  and average the remaining k − 2b.
* :class:`GeometricMedian`   argmin_z Σ_i a_i ‖z − x_i‖ by the smoothed Weiszfeld iteration
  (Pillutla et al., 2022, RFA): β_i = a_i / max(ν, ‖z − x_i‖), z ← Σβ_i x_i / Σβ_i, run until
  the (smoothed) optimality residual ‖Σ_i β_i (z − x_i)‖ / Σ_i a_i falls below ``tol``.
* :class:`Krum`              Krum / multi-Krum (Blanchard et al., 2017): score_i = Σ of the
  squared distances from x_i to its k − f − 2 nearest other inputs; average the m inputs of
  lowest score (m = 1: Krum).
* :class:`CenteredClipping`  (Karimireddy et al., 2021): v ← v + (1/k) Σ_i clip_τ(x_i − v),
  ``iters`` times, clip_τ(u) = u·min(1, τ/‖u‖).
* :class:`NearestNeighborMixing` (Allouah et al., 2023), a pre-aggregation: every x_i is
  replaced by the average of its k − f nearest inputs (itself included), then an inner rule
  aggregates.

Robust rules treat all inputs alike and ignore ``weights`` (a Byzantine client could claim any
weight), except :class:`GeometricMedian` with ``weighted=True``. Counts of tolerated Byzantine
inputs are given as a fraction ``delta`` of the inputs seen at call time, f = ⌊δk⌋, so the
same rule works on raw updates and on bucket means (see :mod:`partialfl.aggregation.bucketing`).

Non-finite inputs are rejected with a clear error: the server drops them first
(:func:`drop_nonfinite`), so a NaN or inf sent by a client never reaches θ.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from partialfl.aggregation.basic import Mean

# ---------------------------------------------------------------------------------------------
# helpers shared by every rule


def to_numpy(x) -> tuple[np.ndarray, Any]:
    """``(array, restore)``: a numpy view of ``x`` and a function mapping a numpy result back
    to ``x``'s type (torch dtype/device) — robust rules compute in numpy."""
    if hasattr(x, "detach"):
        import torch

        dtype, device = x.dtype, x.device
        arr = x.detach().cpu().numpy()

        def restore(y):
            return torch.as_tensor(np.asarray(y), dtype=dtype, device=device)

        return arr, restore
    return np.asarray(x), (lambda y: y)


def finite_rows(vectors) -> np.ndarray:
    """``[k]`` bool: the rows of ``vectors`` without NaN or ±inf."""
    arr, _ = to_numpy(vectors)
    return np.isfinite(arr.reshape(len(arr), -1)).all(1)


def drop_nonfinite(vectors, weights=None):
    """``(vectors, weights, mask)`` keeping only the finite rows (mask marks the kept ones)."""
    mask = finite_rows(vectors)
    if mask.all():
        return vectors, weights, mask
    idx = np.flatnonzero(mask)
    w = None if weights is None else np.asarray(weights)[idx]
    if hasattr(vectors, "detach"):
        import torch

        return vectors[torch.as_tensor(idx, device=vectors.device)], w, mask
    return vectors[idx], w, mask


def count(delta: float, k: int) -> int:
    """f = ⌊δk⌋, the number of Byzantine inputs a rule tolerates among k (robust to the
    rounding of δk, e.g. 0.15·20 = 3.0000000000000004)."""
    return int(math.floor(delta * k + 1e-9))


def _check_delta(delta: float, name: str) -> None:
    if not (isinstance(delta, int | float) and 0 <= delta < 0.5):
        raise ValueError(f"{name}: Byzantine fraction delta must be in [0, 0.5), got {delta!r}")


def _prepare(vectors, weights, name: str) -> tuple[np.ndarray, np.ndarray, Any]:
    """Validated float64 ``[k, d]`` matrix, ``[k]`` weights and the restore function."""
    arr, restore = to_numpy(vectors)
    if arr.ndim != 2:
        raise ValueError(f"{name}: vectors must be a [k, d] matrix, got shape {arr.shape}")
    k = arr.shape[0]
    if k < 1:
        raise ValueError(f"{name}: need at least one input vector, got 0")
    X = arr.astype(np.float64, copy=False)
    if not np.isfinite(X).all():
        bad = np.flatnonzero(~np.isfinite(X).all(1)).tolist()
        raise ValueError(
            f"{name}: input rows {bad} contain NaN or inf; drop them first "
            "(partialfl.aggregation.drop_nonfinite)"
        )
    if weights is None:
        w = np.ones(k)
    else:
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if len(w) != k:
            raise ValueError(f"{name}: {len(w)} weights for {k} input vectors")
        if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
            raise ValueError(f"{name}: weights must be finite, non-negative, not all zero")
    return X, w, restore


def _norms(D: np.ndarray) -> np.ndarray:
    """Row norms that do not overflow for huge finite entries (e.g. 1e300)."""
    scale = np.abs(D).max(1)
    safe = np.where(scale > 0, scale, 1.0)
    return scale * np.sqrt(((D / safe[:, None]) ** 2).sum(1))


def _coincide_tol(x: np.ndarray) -> float:
    """Distance below which two points are the same point in float64 (relative to ‖x‖∞)."""
    return 1e-12 * float(np.abs(x).max()) + np.finfo(np.float64).tiny


def _safe_mean(X: np.ndarray, axis: int = 0) -> np.ndarray:
    """Mean that divides before summing, so huge finite inputs (1e308) cannot overflow."""
    return (X / X.shape[axis]).sum(axis)


def _sq_dists(X: np.ndarray) -> np.ndarray:
    """``[k, k]`` squared Euclidean distances, computed row by row (O(kd) memory; exact,
    unlike the Gram-matrix formula)."""
    k = len(X)
    D = np.empty((k, k))
    with np.errstate(over="ignore"):
        for i in range(k):
            D[i] = ((X - X[i]) ** 2).sum(1)
    return D


def bind(agg, seed: int, round_: int):
    """The aggregator with its randomness fixed for one round (randomized rules such as
    :class:`~partialfl.aggregation.bucketing.Bucketing` draw from
    ``generator(seed, "bucketing", round)``); deterministic rules are returned unchanged."""
    b = getattr(agg, "bind", None)
    return b(seed, round_) if b is not None else agg


# ---------------------------------------------------------------------------------------------
# rules


@dataclass(frozen=True)
class CoordinateMedian:
    """CM(x_1, …, x_k)_j = median_i x_{i,j} (mean of the two middle values for even k)."""

    name = "cm"

    def __call__(self, vectors, weights=None):
        X, _, restore = _prepare(vectors, weights, "coordinate-wise median")
        return restore(np.median(X, axis=0))


@dataclass(frozen=True)
class TrimmedMean:
    """Per coordinate: sort, drop the b = ⌊δk⌋ smallest and b largest, average the rest."""

    delta: float = 0.1
    name = "tm"

    def __post_init__(self) -> None:
        _check_delta(self.delta, "trimmed mean")

    def __call__(self, vectors, weights=None):
        X, _, restore = _prepare(vectors, weights, "trimmed mean")
        k = len(X)
        b = count(self.delta, k)  # δ < 1/2 leaves k − 2b >= 1 values
        S = np.sort(X, axis=0)
        return restore(_safe_mean(S[b : k - b]))


@dataclass(frozen=True)
class GeometricMedian:
    """argmin_z Σ_i a_i ‖z − x_i‖ by smoothed Weiszfeld (RFA, Pillutla et al., 2022).

    z⁰ is the coordinate-wise median (robust start). With r_i = ‖z − x_i‖ and
    β_i = a_i / max(ν, r_i): z ← Σ_i β_i x_i / Σ_i β_i. The iteration stops when the
    optimality residual ‖Σ_i β_i (z − x_i)‖ / Σ_i a_i (the norm of the average unit vector
    pointing from the inputs to z, 0 at the smoothed optimum) is ≤ ``tol``. The smoothing
    ν = ``nu`` · median_i ‖z⁰ − x_i‖ is relative to the spread of the inputs, so the rule is
    exactly scale-equivariant. When an iterate comes close to an input x_j, the subgradient
    condition of x_j is checked and x_j returned if it is the minimiser (Weiszfeld converges
    only sublinearly to a median that sits on an input). Reaching ``max_iter`` first raises a
    RuntimeWarning.
    ``weighted=False`` uses a_i = 1.
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
        if not (isinstance(self.max_iter, int) and self.max_iter >= 1):
            raise ValueError(f"geometric median: max_iter must be an integer >= 1, "
                             f"got {self.max_iter!r}")

    def solve(self, vectors, weights=None) -> tuple[np.ndarray, int, float]:
        """``(z, iterations, residual)`` in numpy (for tests and diagnostics)."""
        X, a, _ = _prepare(vectors, weights, "geometric median")
        if not self.weighted:
            a = np.ones(len(X))
        z = np.median(X, axis=0)
        r = _norms(X - z)
        scale = float(np.median(r))
        if scale <= _coincide_tol(z):
            # At least half of the inputs coincide with the median start: their mass outweighs
            # the pull of all others, so that point is the geometric median.
            return X[int(np.argmin(r))].copy(), 0, 0.0
        nu = self.nu * scale
        total = a.sum()
        resid = math.inf
        for it in range(1, self.max_iter + 1):
            j = int(np.argmin(r))
            if r[j] <= 1e-3 * scale and self._optimal_at_input(X, a, j, nu):
                return X[j].copy(), it, 0.0
            beta = a / np.maximum(nu, r)
            z_new = (beta[:, None] * X).sum(0) / beta.sum()
            # Residual at z (before the step): Σβ_i (z − x_i) = Σβ · (z − z_new).
            resid = float(_norms((beta.sum() * (z - z_new))[None])[0] / total)
            z = z_new
            r = _norms(X - z)
            if resid <= self.tol:
                return z, it, resid
        warnings.warn(
            f"geometric median: smoothed Weiszfeld did not reach tol={self.tol} in "
            f"{self.max_iter} iterations (residual {resid:.2e})", RuntimeWarning, stacklevel=3,
        )
        return z, self.max_iter, resid

    @staticmethod
    def _optimal_at_input(X: np.ndarray, a: np.ndarray, j: int, nu: float) -> bool:
        """Is the input x_j itself the minimiser? (Weiszfeld only creeps towards a median that
        sits on an input.) 0 ∈ ∂g(x_j) iff ‖Σ_{i ∉ C} a_i (x_j − x_i)/‖x_j − x_i‖‖ ≤ Σ_{i ∈ C} a_i
        for the inputs C within ν of x_j."""
        d = _norms(X - X[j])
        on = d <= max(nu, _coincide_tol(X[j]))
        if on.all():
            return True
        pull = (a[~on, None] * (X[j] - X[~on]) / d[~on, None]).sum(0)
        return float(_norms(pull[None])[0]) <= a[on].sum()

    def __call__(self, vectors, weights=None):
        _, restore = to_numpy(vectors)
        return restore(self.solve(vectors, weights)[0])


@dataclass(frozen=True)
class Krum:
    """Multi-Krum: average the ``m`` inputs with the lowest Krum score (m = 1: Krum).

    score_i = Σ_{j ∈ N_i} ‖x_i − x_j‖², N_i the k − f − 2 nearest other inputs, f = ⌊δk⌋.
    ``m=None`` selects k − f inputs (the usual multi-Krum). Ties go to the lower index.
    Krum's guarantee needs k ≥ 2f + 3, so f is capped at ⌊(k − 3)/2⌋ (e.g. when bucketing
    or dropped non-finite updates leave few inputs).
    """

    delta: float = 0.1
    m: int | None = 1
    name = "krum"

    def __post_init__(self) -> None:
        _check_delta(self.delta, "krum")
        if self.m is not None and not (isinstance(self.m, int) and self.m >= 1):
            raise ValueError(f"krum: m (inputs to average) must be an integer >= 1 or None, "
                             f"got {self.m!r}")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, capped at ⌊(k − 3)/2⌋: Krum's guarantee needs k ≥ 2f + 3."""
        return max(0, min(count(self.delta, k), (k - 3) // 2))

    def scores(self, X: np.ndarray) -> np.ndarray:
        """score_i for every input (k ≥ 2)."""
        k = len(X)
        f = self.tolerated(k)
        nb = max(1, k - f - 2)
        D = _sq_dists(X)
        np.fill_diagonal(D, np.inf)
        return np.sort(D, axis=1)[:, :nb].sum(1)

    def __call__(self, vectors, weights=None):
        X, _, restore = _prepare(vectors, weights, "krum")
        k = len(X)
        m = k - self.tolerated(k) if self.m is None else self.m
        if m > k:
            raise ValueError(f"krum: cannot average m={m} of only k={k} inputs")
        if k == 1:
            return restore(X[0].copy())
        sel = np.argsort(self.scores(X), kind="stable")[:m]
        return restore(_safe_mean(X[sel]))


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
        if not (isinstance(self.iters, int) and self.iters >= 1):
            raise ValueError(f"centered clipping: iters must be an integer >= 1, "
                             f"got {self.iters!r}")
        if self.init not in ("median", "zero"):
            raise ValueError(f"centered clipping: unknown init {self.init!r}; allowed: "
                             "'median', 'zero'")

    def __call__(self, vectors, weights=None):
        X, _, restore = _prepare(vectors, weights, "centered clipping")
        v = np.median(X, axis=0) if self.init == "median" else np.zeros(X.shape[1])
        tau = self.tau
        if tau is None:
            tau = self.tau_scale * float(np.median(_norms(X - v)))
            if tau == 0.0:
                return restore(v)
        for _ in range(self.iters):
            D = X - v
            r = _norms(D)
            s = np.minimum(1.0, tau / np.maximum(r, np.finfo(np.float64).tiny))
            v = v + _safe_mean(s[:, None] * D)
        return restore(v)


@dataclass(frozen=True)
class NearestNeighborMixing:
    """NNM pre-aggregation: y_i = mean of the k − f nearest inputs to x_i (x_i included),
    f = ⌊δk⌋; returns ``inner(y, weights)``."""

    inner: Any
    delta: float = 0.1
    name = "nnm"

    def __post_init__(self) -> None:
        _check_delta(self.delta, "nearest-neighbour mixing")
        if not callable(self.inner):
            raise TypeError(f"nearest-neighbour mixing: inner aggregator must be callable, "
                            f"got {self.inner!r}")

    def mix(self, X: np.ndarray) -> np.ndarray:
        """Every row replaced by the mean of its k − ⌊δk⌋ nearest rows (itself included)."""
        k = len(X)
        keep = k - count(self.delta, k)
        D = _sq_dists(X)
        # Stable sort on distance; i itself (distance 0) comes first among its ties.
        D[np.arange(k), np.arange(k)] = -1.0
        nn = np.argsort(D, axis=1, kind="stable")[:, :keep]
        return _safe_mean(X[nn], axis=1)

    def __call__(self, vectors, weights=None):
        X, _, restore = _prepare(vectors, weights, "nearest-neighbour mixing")
        return restore(np.asarray(self.inner(self.mix(X), weights)))

    def bind(self, seed: int, round_: int) -> NearestNeighborMixing:
        """This wrapper with its inner rule bound to (seed, round)."""
        return replace(self, inner=bind(self.inner, seed, round_))


# ---------------------------------------------------------------------------------------------
# factory

#: name -> (class, accepted keyword arguments)
_RULES: dict[str, tuple[type, tuple[str, ...]]] = {
    "mean": (Mean, ("weighted",)),
    "cm": (CoordinateMedian, ()),
    "tm": (TrimmedMean, ("delta",)),
    "gm": (GeometricMedian, ("nu", "tol", "max_iter", "weighted")),
    "krum": (Krum, ("delta",)),
    "multi-krum": (Krum, ("delta", "m")),
    "cc": (CenteredClipping, ("tau", "tau_scale", "iters", "init")),
}
_ALIASES = {"median": "cm", "coordinate-median": "cm", "trimmed-mean": "tm",
            "geometric-median": "gm", "geomed": "gm", "rfa": "gm", "centered-clipping": "cc",
            "multikrum": "multi-krum"}
AGGREGATORS = tuple(_RULES)
_WRAPPER_KW = ("bucketing", "nnm", "seed")


def make_aggregator(name: str, **kw):
    """Build an aggregator by name, e.g. ``make_aggregator("krum", delta=0.2, bucketing=2)``.

    Names: mean, cm, tm, gm, krum, multi-krum, cc (aliases: median, trimmed-mean,
    geometric-median, centered-clipping). Wrappers: ``bucketing=s`` (s ≥ 2 wraps the rule in
    :class:`~partialfl.aggregation.bucketing.Bucketing`, s = 1 is no bucketing),
    ``nnm=True`` (nearest-neighbour mixing first), ``seed`` (bucketing randomness).
    ``delta`` is the fraction of Byzantine *clients*; with bucketing up to s·δ of the bucket
    means can be Byzantine, so the inner rule is given min(s·δ, 0.49).
    """
    key = _ALIASES.get(name, name)
    if key not in _RULES:
        raise ValueError(f"unknown aggregator {name!r}; allowed: {', '.join(AGGREGATORS)}")
    cls, allowed = _RULES[key]
    delta = kw.pop("delta", None)
    s = kw.pop("bucketing", 1)
    nnm = kw.pop("nnm", False)
    seed = kw.pop("seed", 0)
    bad = sorted(set(kw) - set(allowed))
    if bad:
        raise ValueError(
            f"aggregator {key!r} got unknown option(s) {', '.join(bad)}; allowed: "
            f"{', '.join(sorted({*allowed, 'delta', *_WRAPPER_KW}))}"
        )
    if not (isinstance(s, int | np.integer) and s >= 1):
        raise ValueError(f"bucketing size must be an integer >= 1, got {s!r}")
    if delta is not None:
        _check_delta(delta, f"aggregator {key!r}")
    inner_delta = None if delta is None else min(s * delta, 0.49)
    if "delta" in allowed and inner_delta is not None:
        kw["delta"] = inner_delta
    if key == "multi-krum":
        kw.setdefault("m", None)
    agg = cls(**kw)
    if nnm:
        agg = NearestNeighborMixing(agg, delta=0.0 if inner_delta is None else inner_delta)
    if s > 1:
        from partialfl.aggregation.bucketing import Bucketing

        agg = Bucketing(agg, s=int(s), seed=int(seed))
    return agg
