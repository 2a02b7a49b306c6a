"""Coordinate-wise robust rules: each coordinate j is aggregated from the k values x_{1,j}, …,
x_{k,j} alone.

* :class:`CoordinateMedian`  CM(x)_j = median_i x_{i,j}.
* :class:`TrimmedMean`       drop the f largest and f smallest values, average the k − 2f left.
* :class:`Meamed`            the mean of the k − f values closest to the median (Xie et al., 2018).

f = ⌊δk⌋ (see :mod:`partialfl.aggregation.rules` for the conventions shared by every rule).

Speed: the columns of a ``[k, d]`` input are strided, where numpy's partition (``np.median``)
is slow; the rules sort blocks of columns instead (``np.sort`` along axis 0, ~4× faster than
``np.median`` at k = 25), and the trimmed mean with few trimmed values moves the f smallest and
f largest values of every column aside with a comparator network on whole rows (vectorised
over the columns, ~2f·k min/max passes) instead of sorting. Each block stays in cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from partialfl.aggregation.common import check_delta, mean_into, mean_rows, prepare
from partialfl.aggregation.compose import register_rule
from partialfl.aggregation.protection import check, check_flag, majority

#: bytes of one block of columns (k rows × width float64) sorted or filtered at a time
_BLOCK_BYTES = 1 << 21


def _width(k: int) -> int:
    return max(512, _BLOCK_BYTES // (8 * max(k, 1)))


def _blocks(X: np.ndarray):
    """``(j, X[:, j : j + w])`` over blocks of columns of width w (a cache-sized block)."""
    w = _width(len(X))
    for j in range(0, X.shape[1], w):
        yield j, X[:, j : j + w]


def middle(S: np.ndarray) -> np.ndarray:
    """The median of every column of column-sorted S: the middle value, or for even k the mean
    (a + b)/2 of the two middle ones exactly as ``np.median`` computes it (a/2 + b/2 where
    a + b would overflow)."""
    k = len(S)
    h = k // 2
    if k % 2:
        return S[h].copy()
    a, b = S[h - 1], S[h]
    with np.errstate(over="ignore"):
        out = (a + b) / 2
    bad = ~np.isfinite(out)
    if bad.any():
        out[bad] = a[bad] / 2 + b[bad] / 2
    return out


def column_median(X: np.ndarray) -> np.ndarray:
    """median_i x_{i,j} for every j (equal to ``np.median(X, axis=0)`` where that is finite)."""
    out = np.empty(X.shape[1])
    for j, B in _blocks(X):
        out[j : j + B.shape[1]] = middle(np.sort(B, axis=0))
    return out


def _network_size(k: int, b: int) -> int:
    """Comparators of :func:`_move_extremes` for k rows and b values at each end."""
    return b * (2 * k - 3) - 2 * b * (b - 1)


def _move_extremes(rows: list, b: int, tmp: np.ndarray) -> None:
    """A partial bubble sort of the rows, elementwise: afterwards rows[:b] hold the b smallest
    values of every column and rows[-b:] the b largest (the middle rows hold the rest, in no
    order). Each comparator writes min/max into the two rows' buffers (no copies)."""
    k = len(rows)
    for p in range(b):
        for i in range(p, k - 1 - p):  # the largest of rows p..k-1-p up to k-1-p
            lo = np.minimum(rows[i], rows[i + 1], out=tmp)
            np.maximum(rows[i], rows[i + 1], out=rows[i + 1])
            rows[i], tmp = lo, rows[i]
        for i in range(k - 2 - p, p, -1):  # the smallest of rows p..k-2-p down to p
            lo = np.minimum(rows[i - 1], rows[i], out=tmp)
            np.maximum(rows[i - 1], rows[i], out=rows[i])
            rows[i - 1], tmp = lo, rows[i - 1]


def trimmed_mean(X: np.ndarray, b: int) -> np.ndarray:
    """Per column, the mean of the values left after dropping the b smallest and b largest.
    A comparator network when it needs few passes (b small), else a sort; the sort path is
    bit for bit ``np.sort(X, 0)[b : k − b].mean(0)``, the network path sums the same values
    in another order (equal up to rounding)."""
    k, d = X.shape
    if b == 0:
        return mean_rows(X)
    m = k - 2 * b
    out = np.empty(d)
    if _network_size(k, b) > 5 * k:  # ~ the cost of sorting the block (measured at k = 25)
        for j, B in _blocks(X):
            out[j : j + B.shape[1]] = mean_rows(np.sort(B, axis=0), np.arange(b, k - b))
        return out
    for j, B in _blocks(X):
        C = B.copy()
        rows = list(C)
        tmp = np.empty(C.shape[1])
        _move_extremes(rows, b, tmp)
        mean_into(out[j : j + C.shape[1]], rows[b : k - b], m)
    return out


def meamed(X: np.ndarray, f: int) -> np.ndarray:
    """Per column, the mean of the k − f values closest to the median, ties to the lower row.

    In a sorted column the values closest to the median form a window S[a : a + k − f]: the
    f values dropped are taken one at a time from whichever end is farther from the median.
    Only where the two ends are equally far with different values does the choice depend on
    the rows' indices; those columns are recomputed by the reference (a stable argsort of
    |x − median|). Equal to the reference up to the rounding of the sum's order."""
    k, d = X.shape
    m = k - f
    if f == 0:
        return mean_rows(X)
    out = np.empty(d)
    tied: list[np.ndarray] = []
    for j, B in _blocks(X):
        S = np.sort(B, axis=0)
        n = S.shape[1]
        med = middle(S)
        cols = np.arange(n)
        lo = np.zeros(n, dtype=np.int64)
        hi = np.full(n, k - 1, dtype=np.int64)
        tie = np.zeros(n, dtype=bool)
        with np.errstate(over="ignore", invalid="ignore"):
            for _ in range(f):
                a, c = S[lo, cols], S[hi, cols]
                dl, dh = np.abs(a - med), np.abs(c - med)
                tie |= ~(dl != dh) & (a != c)  # equal (or both inf / nan): ask the reference
                drop_lo = dl > dh
                lo += drop_lo
                hi -= ~drop_lo
        # the window always holds rows f … k − f − 1; an end row r only where it is kept
        ends = [np.where(lo <= r, S[r], 0.0) for r in range(f)]
        ends += [np.where(hi >= r, S[r], 0.0) for r in range(k - f, k)]
        mean_into(out[j : j + n], [*S[f : k - f], *ends], m)
        if tie.any():
            tied.append(j + np.flatnonzero(tie))
    if tied:
        cols = np.concatenate(tied)
        out[cols] = meamed_reference(X[:, cols], f)
    return out


def meamed_reference(X: np.ndarray, f: int) -> np.ndarray:
    """Meamed by its definition (a stable argsort of |x − median| per column): the reference
    the fast path is tested against, and used by it for columns with ties."""
    m = len(X) - f
    med = column_median(X)
    with np.errstate(over="ignore"):
        idx = np.argsort(np.abs(X - med), axis=0, kind="stable")[:m]
    return mean_rows(np.take_along_axis(X, idx, axis=0))


@dataclass(frozen=True)
class CoordinateMedian:
    """CM(x_1, …, x_k)_j = median_i x_{i,j} (mean of the two middle values for even k).
    Tolerates f < k/2 Byzantine inputs (its breakdown point), so it has no δ to check."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    name = "cm"

    def tolerated(self, k: int) -> int:
        """⌊(k − 1)/2⌋: the median stays between honest values while they are a majority."""
        return majority("coordinate-wise median", k)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "coordinate-wise median")
        self.tolerated(len(X))  # refused below a planned f (see protection.cohort_checked)
        return restore(column_median(X))


@dataclass(frozen=True)
class TrimmedMean:
    """Per coordinate: sort, drop the f = ⌊δk⌋ smallest and f largest, average the rest.

    Bound: k ≥ 2f + 1 (always true for δ < 1/2) and, for δ > 0, f ≥ 1, i.e. k ≥ ⌈1/δ⌉; below
    it the rule refuses (:mod:`~partialfl.aggregation.protection`) unless
    ``allow_unprotected=True``."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    allow_unprotected: bool = False
    name = "tm"

    def __post_init__(self) -> None:
        check_delta(self.delta, "trimmed mean")
        check_flag(self.allow_unprotected, "trimmed mean: allow_unprotected")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, refused where the rule protects nothing."""
        return check("trimmed mean", self.delta, k, self.allow_unprotected)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "trimmed mean")
        return restore(trimmed_mean(X, self.tolerated(len(X))))


@dataclass(frozen=True)
class Meamed:
    """Mean around the median: per coordinate j, the mean of the k − f values x_{i,j}
    closest to median_i x_{i,j} (ties to the lower index). f = ⌊δk⌋.

    Bound: k ≥ 2f + 1 and, for δ > 0, f ≥ 1 (k ≥ ⌈1/δ⌉); refused below unless
    ``allow_unprotected=True``."""

    weighted: ClassVar[bool] = False  # the rows' weights are not used

    delta: float = 0.1
    allow_unprotected: bool = False
    name = "meamed"

    def __post_init__(self) -> None:
        check_delta(self.delta, "meamed")
        check_flag(self.allow_unprotected, "meamed: allow_unprotected")

    def tolerated(self, k: int) -> int:
        """f = ⌊δk⌋, refused where the rule protects nothing."""
        return check("meamed", self.delta, k, self.allow_unprotected)

    def __call__(self, vectors, weights=None):
        X, _, restore = prepare(vectors, weights, "meamed")
        return restore(meamed(X, self.tolerated(len(X))))


register_rule("cm", CoordinateMedian, aliases=("median", "coordinate-median"),
              doc="Coordinate-wise median (Yin et al. 2018).")
register_rule("tm", TrimmedMean, aliases=("trimmed-mean",),
              doc="Coordinate-wise trimmed mean: drop the f = ⌊δk⌋ largest and smallest "
              "values per coordinate (Yin et al. 2018).")
register_rule("meamed", Meamed, doc="Mean around the median: per coordinate, the mean of the "
              "k − f values closest to the median (Xie et al. 2018).")
