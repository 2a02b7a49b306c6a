"""The faster paths of the robust rules (issue 25, item 3) equal their references: the
median from a block sort vs ``np.median``, the comparator-network trimmed mean vs the sorted
one, Meamed's sorted window vs its argsort definition, the mean of chosen rows vs the copy it
avoids, distances to one row vs ``np.linalg.norm``, clipping in place vs a copy."""

from __future__ import annotations

import numpy as np
import pytest

from partialfl.aggregation import ARC, CoordinateMedian, Mean, StaticClipping, TrimmedMean
from partialfl.aggregation import coordinate as coord
from partialfl.aggregation.common import dists_to, mean_rows, norms


def data(k, d, seed, ties=False):
    g = np.random.default_rng(seed)
    if ties:  # few distinct values: every kind of tie (also across the median)
        return g.integers(-2, 3, (k, d)).astype(np.float64)
    return g.standard_normal((k, d)) * g.choice([1e-3, 1.0, 1e4], d)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 512 columns, so a few thousand columns cross several blocks."""
    monkeypatch.setattr(coord, "_BLOCK_BYTES", 1)


CASES = [(k, ties) for k in (1, 2, 3, 4, 5, 6, 7, 10, 11, 25) for ties in (False, True)]


@pytest.mark.parametrize("k,ties", CASES)
def test_median_equals_numpy_bit_for_bit(k, ties, small_blocks):
    X = data(k, 1500, k, ties)
    np.testing.assert_array_equal(coord.column_median(X), np.median(X, axis=0))
    np.testing.assert_array_equal(CoordinateMedian()(X, None), np.median(X, axis=0))


def test_median_of_huge_values_is_finite():
    X = np.array([[1.7e308, -1.7e308], [1.7e308, -1.6e308]])
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.median(X, axis=0)).all()  # numpy overflows here
    np.testing.assert_allclose(coord.column_median(X), [1.7e308, -1.65e308], rtol=1e-15)


def sorted_tm(X, b):
    k = len(X)
    return np.sort(X, axis=0)[b : k - b].mean(0)


def old_tm(X, b):  # the code before (divided, then summed)
    k = len(X)
    return (np.sort(X, axis=0)[b : k - b] / (k - 2 * b)).sum(0)


@pytest.mark.parametrize("k,ties", CASES)
def test_trimmed_mean_network_and_sort_equal_the_sorted_reference(k, ties, small_blocks):
    X = data(k, 1300, 10 + k, ties)
    scale = np.abs(X).max(0)
    for b in range((k - 1) // 2 + 1):
        ref = sorted_tm(X, b)
        out = coord.trimmed_mean(X, b)
        tol = 4 * k * 2.3e-16 * scale.max()
        np.testing.assert_allclose(out, old_tm(X, b), rtol=0, atol=tol)
        if b > 0 and coord._network_size(k, b) > 5 * k:  # sort path: the sorted mean exactly
            np.testing.assert_array_equal(out, ref)
        else:  # network (or b = 0: the rows as given): the same values in another order
            np.testing.assert_allclose(out, ref, rtol=0, atol=tol)


def test_trimmed_mean_takes_the_network_where_it_is_cheaper():
    assert coord._network_size(25, 2) <= 5 * 25 < coord._network_size(25, 6)
    X = data(25, 20, 3)
    X[:2] = 1e300  # outliers are trimmed, no overflow in the sum
    np.testing.assert_allclose(TrimmedMean(0.1)(X, None), sorted_tm(X, 2), rtol=0,
                               atol=1e-13 * np.abs(X[2:]).max())


def old_meamed(X, f, divide_first=False):
    m = len(X) - f
    med = np.median(X, axis=0)
    idx = np.argsort(np.abs(X - med), axis=0, kind="stable")[:m]
    V = np.take_along_axis(X, idx, axis=0)
    return (V / m).sum(0) if divide_first else V.mean(0)  # the code before: divide first


@pytest.mark.parametrize("k,ties", CASES)
def test_meamed_window_equals_the_argsort_definition(k, ties, small_blocks):
    X = data(k, 1200, 20 + k, ties)
    scale = np.abs(X).max()
    for f in range((k - 1) // 2 + 1):
        ref = old_meamed(X, f)
        np.testing.assert_array_equal(coord.meamed_reference(X, f), ref)
        # (with ties a wrong choice across the median would be off by ≥ 1/k, far above this)
        for r in (ref, old_meamed(X, f, divide_first=True)):
            np.testing.assert_allclose(coord.meamed(X, f), r, rtol=0,
                                       atol=4 * k * 2.3e-16 * scale)


def test_meamed_tie_across_the_median_goes_to_the_lower_row():
    # median 0; the values −1 and +1 are equally close: the one in the lower row is kept.
    X = np.array([[1.0], [0.0], [-1.0], [0.0], [5.0]])
    assert coord.meamed(X, 2)[0] == pytest.approx((1.0 + 0.0 + 0.0) / 3)
    assert coord.meamed(X[[2, 1, 0, 3, 4]], 2)[0] == pytest.approx((-1.0 + 0.0 + 0.0) / 3)


@pytest.mark.parametrize("rows", [None, [3], [0, 2, 5], [6, 1, 4, 0]])
def test_mean_rows_is_the_copying_mean_bit_for_bit(rows):
    X = data(7, 40_000, 5)  # several column blocks
    sel = np.arange(7) if rows is None else np.asarray(rows)
    np.testing.assert_array_equal(mean_rows(X, rows), X[sel].mean(0))
    np.testing.assert_allclose(mean_rows(X, rows), (X[sel] / len(sel)).sum(0),  # before
                               rtol=0, atol=8 * 2.3e-16 * np.abs(X).max())
    huge = np.full((3, 5), 1.7e308)
    huge[1, 2] = -1.0
    with np.errstate(over="ignore"):
        assert not np.isfinite(huge.mean(0)).all()  # numpy overflows
    np.testing.assert_allclose(mean_rows(huge), (huge / 3).sum(0), rtol=1e-15)


def test_dists_to_one_row():
    X = data(9, 40_000, 6)
    np.testing.assert_allclose(dists_to(X, X[2]), np.linalg.norm(X - X[2], axis=1),
                               rtol=1e-12)
    # Entries near the float64 limit: ‖x − c‖ itself overflows, the scaled order does not.
    Y = np.array([[1e308, 1e308], [-1e308, -1e308], [1e308, 9e307], [0.0, 0.0]])
    d = dists_to(Y, Y[0])
    assert np.isfinite(d).all() and list(np.argsort(d)) == [0, 2, 3, 1]
    # Tiny differences whose squares underflow are still ordered.
    Z = np.array([[0.0], [3e-170], [1e-170], [0.0]])
    assert list(np.argsort(dists_to(Z, Z[0]), kind="stable")) == [0, 3, 2, 1]


def test_norms_by_row_dots_equal_einsum():
    X = data(6, 10_000, 7)
    np.testing.assert_allclose(norms(X), np.sqrt(np.einsum("ij,ij->i", X, X)), rtol=1e-14)


@pytest.mark.parametrize("make", [lambda: ARC(Mean(), 0.2), lambda: StaticClipping(Mean(), 50.0)])
def test_clipping_in_place_equals_the_copy_and_never_touches_the_callers_input(make):
    agg = make()
    X = data(10, 300, 8)
    X[:2] *= 1e3
    keep = X.copy()
    ref = agg.transform(X)
    np.testing.assert_array_equal(X, keep)  # no out: the input is untouched
    assert not np.shares_memory(ref, X)
    Y = X.copy()
    out = agg.transform(Y, out=Y)
    assert out is Y
    np.testing.assert_array_equal(Y, ref)  # in place: the same values
    np.testing.assert_array_equal(agg(X, None), ref.mean(0))
    np.testing.assert_array_equal(X, keep)  # the caller's float64 array is not modified
    torch = pytest.importorskip("torch")
    T = torch.tensor(X)
    agg(T, None)
    np.testing.assert_array_equal(T.numpy(), keep)  # a tensor sharing memory: untouched
    F = X.astype(np.float32)
    keep32 = F.copy()
    agg(F, None)  # converted to float64: clipped in the converted copy
    np.testing.assert_array_equal(F, keep32)


@pytest.mark.parametrize("kw", [{"index": 0}, {"index": 3}, {"reference": np.zeros(5)}])
def test_monna_distance_pass_is_its_finiteness_check(kw):
    from partialfl.aggregation import MoNNA, NonFiniteInputError

    X = data(12, 5, 9)
    X[3, 1], X[7, 2] = np.nan, -np.inf
    with pytest.raises(NonFiniteInputError, match=r"monna: input rows \[3, 7\] contain NaN"):
        MoNNA(0.1, **kw)(X, None)
