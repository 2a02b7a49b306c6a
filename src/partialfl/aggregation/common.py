"""Helpers shared by every aggregation rule and wrapper (no rule lives here).

* input handling: :func:`to_numpy`, :func:`prepare` (validated float64 ``[k, d]``),
  :func:`finite_rows`, :func:`drop_nonfinite`; :class:`ZeroWeightsError` (a weighing rule
  given weights that sum to 0);
* Byzantine counts: :func:`count` (f = ⌊δk⌋), :func:`check_delta`;
* option checks and the subsets of the exhaustive rules: :func:`check_int`, :func:`subsets`;
* overflow-safe arithmetic: :func:`norms`, :func:`dists_to`, :func:`safe_mean`,
  :func:`mean_rows` / :func:`mean_into` (means of chosen rows without copying them);
* pairwise geometry: :func:`gram` — the Gram matrix of the inputs, centred at one input and
  scaled, computed with one matrix product per column block (BLAS), from which
  :func:`sq_dists` and the Weiszfeld iteration of the geometric median work in k dimensions.
* :func:`bind` — fix a randomized rule's randomness for one round.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import numpy as np

from partialfl import arrays

#: columns per block of the Gram computation (a block of 25 rows is ~6.5 MB of float64)
_BLOCK = 1 << 15
#: rows beyond this factor times the median row's ‖·‖∞ are shrunk to it for distances
_RANGE = 1e100
#: columns per block of the row sums of :func:`mean_rows` (L2-sized)
_BLOCK_MEAN = 1 << 14
#: rows at least this long get their sums of squares from one BLAS dot each
_ROW_DOT = 4096


class NonFiniteInputError(ValueError):
    """An aggregator was given NaN or ±inf (the caller must drop those rows first)."""


def to_numpy(x) -> tuple[np.ndarray, Any]:
    """``(array, restore)``: a numpy view of ``x`` and a function mapping a numpy result back
    to ``x``'s type (torch dtype/device) — robust rules compute in numpy."""
    if arrays.is_torch(x):
        return arrays.to_numpy(x), (lambda y: arrays.as_like(y, x))
    return np.asarray(x), (lambda y: y)


def finite_rows(vectors) -> np.ndarray:
    """``[k]`` bool: the rows of ``vectors`` without NaN or ±inf (where they live: a tensor
    on an accelerator is not copied to the host)."""
    return arrays.rows_finite(vectors)


def drop_nonfinite(vectors, weights=None):
    """``(vectors, weights, mask)`` keeping only the finite rows (mask marks the kept ones)."""
    mask = finite_rows(vectors)
    if mask.all():
        return vectors, weights, mask
    idx = np.flatnonzero(mask)
    w = None if weights is None else np.asarray(weights)[idx]
    return arrays.take_rows(vectors, idx), w, mask


def count(delta: float, k: int) -> int:
    """f = ⌊δk⌋, the number of Byzantine inputs a rule tolerates among k (robust to the
    rounding of δk, e.g. 0.15·20 = 3.0000000000000004)."""
    return int(math.floor(delta * k + 1e-9))


def check_int(value, name: str, minimum: int) -> None:
    """A ValueError naming ``name`` unless ``value`` is an integer ≥ ``minimum``."""
    if isinstance(value, bool) or not (isinstance(value, int | np.integer) and value >= minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_limit(limit, name: str) -> None:
    """``max_subsets`` of an exhaustive rule: an integer ≥ 1."""
    check_int(limit, f"{name}: max_subsets", 1)


def subsets(k: int, size: int, limit: int, name: str):
    """Batches ``[B, size]`` of all size-subsets of range(k) in lexicographic order (exhaustive
    rules: MDA, SMEA); a ValueError when there are more than ``limit``."""
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


def check_delta(delta: float, name: str) -> None:
    """A ValueError naming ``name`` unless 0 ≤ δ < 1/2."""
    if isinstance(delta, bool) or not (isinstance(delta, int | float) and 0 <= delta < 0.5):
        raise ValueError(f"{name}: Byzantine fraction delta must be in [0, 0.5), got {delta!r}")


def require_finite(X: np.ndarray, name: str, rows=None) -> None:
    """A :class:`NonFiniteInputError` naming the rows of X (or of ``rows`` only) with NaN/inf."""
    idx = np.arange(len(X)) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    ok = finite_rows(X[idx]) if len(idx) < len(X) else finite_rows(X)
    if not ok.all():
        raise NonFiniteInputError(
            f"{name}: input rows {idx[~ok].tolist()} contain NaN or inf; drop them "
            "first (partialfl.aggregation.drop_nonfinite)"
        )


class ZeroWeightsError(ValueError):
    """A rule that weighs its inputs was given weights that sum to 0 (clients without
    examples, or a SuperNode saying so): nothing to average. Raised only by the rules that use
    the weights (a rule that ignores them aggregates as usual); the runtimes skip that server
    step with a warning (θ stays), never fatal."""


def positive_total(w: np.ndarray, name: str) -> np.ndarray:
    """``w`` (float64 weights, finite and ≥ 0) if their sum is > 0, else
    :class:`ZeroWeightsError`."""
    if not float(np.sum(w)) > 0:
        raise ZeroWeightsError(f"{name}: the weights sum to 0 (clients without examples?); "
                               "a weighted rule has nothing to average")
    return w


def prepare(vectors, weights, name: str,
            check_finite: bool = True) -> tuple[np.ndarray, np.ndarray, Any]:
    """Validated float64 ``[k, d]`` matrix, ``[k]`` weights (finite, ≥ 0; they may all be 0:
    a rule that uses them calls :func:`positive_total`) and the restore function.
    ``check_finite=False``: the caller checks the rows itself on a pass it makes anyway
    (e.g. :func:`dists_to`)."""
    arr, restore = to_numpy(vectors)
    if arr.ndim != 2:
        raise ValueError(f"{name}: vectors must be a [k, d] matrix, got shape {arr.shape}")
    k = arr.shape[0]
    if k < 1:
        raise ValueError(f"{name}: need at least one input vector, got 0")
    X = arr.astype(np.float64, copy=False)
    if check_finite:
        require_finite(X, name)
    if weights is None:
        w = np.ones(k)
    else:
        w = np.asarray(to_numpy(weights)[0], dtype=np.float64).reshape(-1)
        if len(w) != k:
            raise ValueError(f"{name}: {len(w)} weights for {k} input vectors")
        if not (np.isfinite(w).all() and (w >= 0).all()):
            raise ValueError(f"{name}: weights must be finite and non-negative")
    return X, w, restore


def sq_norms(D: np.ndarray) -> np.ndarray:
    """Σ_j D_ij² for every row: one BLAS dot per row for long rows (faster than einsum)."""
    if D.shape[1] >= _ROW_DOT:
        return np.array([row @ row for row in D], dtype=np.float64).reshape(len(D))
    return np.einsum("ij,ij->i", D, D)


def norms(D: np.ndarray) -> np.ndarray:
    """Row norms that do not overflow (entries near 1e300) or underflow (near 1e-300): one
    pass of sums of squares; rows where that is not exact enough are recomputed scaled."""
    sq = sq_norms(D)
    bad = ~np.isfinite(sq) | (sq < 1e-280)
    if bad.any():
        B = D[bad]
        scale = np.abs(B).max(1)
        safe = np.where(scale > 0, scale, 1.0)
        out = np.sqrt(sq)
        out[bad] = scale * np.sqrt(((B / safe[:, None]) ** 2).sum(1))
        return out
    return np.sqrt(sq)


def dists_to(X: np.ndarray, c: np.ndarray, name: str = "distances") -> np.ndarray:
    """‖x_i − c‖ / s for every row, s = 1 unless entries so large (or differences so small)
    that squares overflow (underflow), then s is the power of two with max |entries| / s in
    [1, 2) (an exact scaling: only order and ratios are meaningful). One row at a time: no
    ``[k, d]`` copy. Also the finiteness check of X and c: a row whose distance is not finite
    is checked, and NaN/inf raise :class:`NonFiniteInputError` (so the caller may skip
    :func:`prepare`'s separate pass)."""
    buf = np.empty(X.shape[1])
    sq = np.empty(len(X))
    with np.errstate(over="ignore", invalid="ignore"):
        for i, row in enumerate(X):
            np.subtract(row, c, out=buf)
            sq[i] = buf @ buf  # BLAS
    bad = ~np.isfinite(sq)
    if bad.any():  # NaN/inf in a row (or in c: then in every row), or an overflow
        if not np.isfinite(c).all():
            raise NonFiniteInputError(f"{name}: the reference contains NaN or inf")
        require_finite(X, name, np.flatnonzero(bad))
    zero = np.flatnonzero(sq == 0)
    exact = (not bad.any() and not ((sq > 0) & (sq < 1e-280)).any()
             and all(np.array_equal(X[i], c) for i in zero))
    if exact:
        return np.sqrt(sq)
    top = max(float(np.abs(X).max()), float(np.abs(c).max()))
    s = math.ldexp(1.0, math.frexp(top)[1] - 1) if top > 0 else 1.0  # top/s ∈ [1, 2)
    return norms(X / s - c / s)


def mean_into(acc: np.ndarray, rows, m: int) -> np.ndarray:
    """acc ← (Σ_r rows[r]) / m for equal-length arrays, added in order (bit for bit
    ``np.mean`` of the stacked rows); where the sum overflows (entries near 1e308) each row is
    divided before it is added, which cannot overflow."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(acc, rows[0])
        for r in rows[1:]:
            acc += r
    if np.isfinite(acc).all():
        acc /= m
    else:
        np.divide(rows[0], m, out=acc)
        for r in rows[1:]:
            acc += r / m
    return acc


def mean_rows(X: np.ndarray, rows=None) -> np.ndarray:
    """(1/m) Σ_{i ∈ rows} x_i over the m given rows (None: all), equal bit for bit to
    ``X[rows].mean(0)`` where that is finite, without its ``[m, d]`` copy: :func:`mean_into`
    over blocks of columns that stay in cache."""
    rows = np.arange(len(X)) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(rows) == 0:
        raise ValueError("mean of no rows")
    d = X.shape[1]
    out = np.empty(d, dtype=np.float64)
    for j in range(0, d, _BLOCK_MEAN):
        mean_into(out[j : j + _BLOCK_MEAN], [X[i, j : j + _BLOCK_MEAN] for i in rows],
                  len(rows))
    return out


def safe_mean(X: np.ndarray, axis: int = 0) -> np.ndarray:
    """Mean that cannot overflow on huge finite inputs (1e308): :func:`mean_rows` for the rows
    of a matrix, else dividing before summing."""
    if X.ndim == 2 and axis == 0:
        return mean_rows(X)
    return (X / X.shape[axis]).sum(axis)


def _row_linf(X: np.ndarray) -> np.ndarray:
    """max_j |X_ij| for every row, one column block at a time."""
    linf = np.zeros(len(X))
    for j in range(0, X.shape[1], _BLOCK):
        np.maximum(linf, np.abs(X[:, j : j + _BLOCK]).max(1), out=linf)
    return linf


def _tame_factors(linf: np.ndarray) -> np.ndarray | None:
    """Per-row factors that shrink every row whose ‖·‖∞ exceeds ``_RANGE`` × the median
    row's to that size (direction kept); None when no row does."""
    cap = float(np.median(linf)) * _RANGE
    if not 0.0 < cap < math.inf or linf.max() <= cap:
        return None
    return np.minimum(1.0, cap / np.maximum(linf, cap))


def tame(X: np.ndarray) -> np.ndarray:
    """``X`` with every row beyond ``_RANGE`` (1e100) times the median row's ‖·‖∞ shrunk
    radially to that size — a clip no honest update meets (an honest majority puts the
    median among the honest rows), after which the squared distances of all rows fit in
    float64 together: a row 1e200 away no longer makes the honest rows' differences
    underflow to 0 (what the distance rules compare). ``X`` itself when no row is beyond."""
    f = _tame_factors(_row_linf(X))
    return X if f is None else X * f[:, None]


def gram(X: np.ndarray) -> tuple[np.ndarray, float]:
    """``(G, s)``: G_ij = ⟨x_i − c, x_j − c⟩ / s² over the rows of :func:`tame` (``X``) with
    c the input of smallest ‖·‖∞; s = 1 unless the largest row is so large (> 1e100) or the
    median row so small (< 1e-100) that squares could overflow or underflow, then
    s = √(top · mid), top and mid the largest and the median row ‖·‖∞ (within 1e100 of each
    other after taming), so both scaled sizes square within float64's range (s = top if
    mid is 0).

    Centring at an input keeps the formula ‖x_i − x_j‖² = G_ii + G_jj − 2G_ij accurate where
    the inputs share a large offset; choosing the input of smallest ‖·‖∞ means an outlier
    (e.g. 1e30) never becomes the centre. One ``[k, b] @ [b, k]`` product per block of b
    columns: O(k²d) flops in BLAS and O(kb) extra memory (no ``[k, d]`` copy)."""
    k, d = X.shape
    linf = _row_linf(X)
    f = _tame_factors(linf)
    if f is not None:
        linf = linf * f
    c = X[int(np.argmin(linf))]  # never shrunk: its ‖·‖∞ is at most the median's
    top, mid = float(linf.max()), float(np.median(linf))
    if top == 0.0:
        return np.zeros((k, k)), 1.0
    low = mid if mid > 0.0 else top  # (a zero median row: the largest one decides)
    s = 1.0 if 1e-100 <= low and top <= 1e100 else (math.sqrt(top) * math.sqrt(mid) or top)
    G = np.zeros((k, k))
    for j in range(0, d, _BLOCK):
        B = X[:, j : j + _BLOCK]
        if f is not None:
            B = B * f[:, None]
        if s == 1.0:
            B = B - c[j : j + _BLOCK]
        else:  # divide first: x − c may overflow near 1e308
            B = B / s - c[j : j + _BLOCK] / s
        G += B @ B.T
    return (G + G.T) / 2, s


def sq_dists(G: np.ndarray) -> np.ndarray:
    """``[k, k]`` squared distances from a Gram matrix (clipped at 0, zero diagonal)."""
    g = np.diag(G)
    D = np.maximum(g[:, None] + g[None, :] - 2.0 * G, 0.0)
    np.fill_diagonal(D, 0.0)
    return D


def sq_dists_of(X: np.ndarray) -> np.ndarray:
    """Squared pairwise distances of the rows of X, in the (scaled) units of :func:`gram`;
    only their order and ratios are meaningful (what Krum, NNM and MDA need)."""
    return sq_dists(gram(X)[0])


def chain_of(agg):
    """The aggregator and every rule it wraps (through ``inner``)."""
    while agg is not None:
        yield agg
        agg = getattr(agg, "inner", None)


def inner_delta(inner) -> float | None:
    """The Byzantine fraction δ a rule (or a chain of wrappers) tolerates: the smallest δ
    along the chain (a chain is as robust as its weakest rule: NNM with δ = 0.3 around a
    trimmed mean with δ = 0.05 tolerates 5 %), else None."""
    ds = [float(d) for agg in chain_of(inner) if (d := getattr(agg, "delta", None)) is not None]
    return min(ds) if ds else None


def bind(agg, seed: int, round_: int):
    """The aggregator with its randomness fixed for one round (randomized rules such as
    :class:`~partialfl.aggregation.wrappers.Bucketing` draw from
    ``generator(seed, "bucketing", round)``); deterministic rules are returned unchanged."""
    b = getattr(agg, "bind", None)
    return b(seed, round_) if b is not None else agg


def warn_skipped(name: str, bad: int, k: int) -> None:
    """RuntimeWarning: ``bad`` of ``k`` rows were skipped for NaN/inf."""
    warnings.warn(f"{name}: skipped {bad} of {k} input rows with NaN/inf (never averaged)",
                  RuntimeWarning, stacklevel=3)
