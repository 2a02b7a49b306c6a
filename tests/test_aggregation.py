"""Robust aggregators and bucketing: hand-checked inputs, brute force, optimality, errors."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from partialfl import rng as prng
from partialfl.aggregation import (
    Bucketing,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    NearestNeighborMixing,
    TrimmedMean,
    aggregate_tree,
    bind,
    drop_nonfinite,
    finite_rows,
)
from partialfl.aggregation.protection import UnprotectedError, UnprotectedWarning
from partialfl.build import make_aggregator
from partialfl.registry import names as _names


def rand(k, d, seed=0):
    return np.random.default_rng(seed).standard_normal((k, d)) * np.arange(1, d + 1)


# ---------------------------------------------------------------------------- hand-checked


def test_coordinate_median_by_hand():
    X = np.array([[1.0, 5.0], [2.0, -1.0], [10.0, 0.0]])
    np.testing.assert_array_equal(CoordinateMedian()(X, np.ones(3)), [2.0, 0.0])
    X = np.array([[1.0], [3.0], [4.0], [10.0]])
    np.testing.assert_array_equal(CoordinateMedian()(X, None), [3.5])


def test_trimmed_mean_by_hand():
    X = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [4.0, -50.0], [100.0, 3.0]])
    # k = 5, delta = 0.2 -> b = 1 trimmed per side and coordinate.
    np.testing.assert_allclose(TrimmedMean(0.2)(X, None), [3.0, 0.0])
    np.testing.assert_allclose(TrimmedMean(0.0)(X, None), X.mean(0))


def test_geometric_median_by_hand():
    gm = GeometricMedian(tol=1e-12)
    # 1-D: the geometric median is the median.
    np.testing.assert_allclose(gm(np.array([[0.0], [1.0], [10.0]]), None), [1.0], atol=1e-9)
    # Equilateral triangle: the Fermat point is the centroid.
    tri = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, np.sqrt(3) / 2]])
    np.testing.assert_allclose(gm(tri, None), tri.mean(0), atol=1e-9)
    # Square corners plus a far point: the far point moves the mean, not much the median.
    sq = np.array([[1.0, 1], [1, -1], [-1, 1], [-1, -1], [0, 0]])
    np.testing.assert_allclose(gm(sq, None), [0.0, 0.0], atol=1e-9)
    # Weighted: a point holding more than half of the total weight is the median.
    w = np.array([1.0, 1.0, 3.0])
    z = GeometricMedian(weighted=True, tol=1e-12)(tri, w)
    np.testing.assert_allclose(z, tri[2], atol=1e-6)


def test_krum_by_hand():
    X = np.array([[0.0], [1.0], [2.0], [10.0], [100.0]])
    # k = 5 = 2f + 3 for delta = 0.2 -> f = 1; each score sums the k − f − 2 = 2 nearest
    # squared distances.
    np.testing.assert_array_equal(Krum(0.2).scores(X), [5.0, 2.0, 5.0, 145.0, 17704.0])
    np.testing.assert_array_equal(Krum(0.2)(X, None), [1.0])
    np.testing.assert_array_equal(Krum(0.2, m=3)(X, None), [1.0])  # mean of 1, 0, 2
    np.testing.assert_array_equal(Krum(0.2, m=None)(X, None), [13 / 4])  # k - f = 4 best
    # δ = 0.4 would mean f = 2 > (k − 3)/2 = 1: refused, unless capping is chosen explicitly.
    with pytest.raises(ValueError, match="needs k ≥ 2f \\+ 3 = 7.*cap=True"):
        Krum(0.4)(X, None)
    np.testing.assert_array_equal(Krum(0.4, cap=True).scores(X), Krum(0.2).scores(X))
    assert Krum(0.4, cap=True).tolerated(5) == 1 and Krum(0.4, cap=True).tolerated(3) == 0


def test_centered_clipping_by_hand():
    X = np.array([[3.0, 4.0], [0.0, 1.0]])
    cc = CenteredClipping(tau=1.0, iters=1, init="zero")
    # clip([3, 4]) = [0.6, 0.8]; [0, 1] has norm 1 and is kept.
    np.testing.assert_allclose(cc(X, None), [0.3, 0.9])
    # Large radius, many iterations from the median: the plain mean.
    np.testing.assert_allclose(CenteredClipping(tau=1e9, iters=1)(X, None), X.mean(0))


def test_nearest_neighbor_mixing_by_hand():
    X = np.array([[0.0], [1.0], [10.0]])
    nnm = NearestNeighborMixing(Mean(), delta=0.34)  # f = 1: mix with the 2 nearest
    np.testing.assert_allclose(nnm.mix(X), [[0.5], [0.5], [5.5]])
    np.testing.assert_allclose(nnm(X, None), [6.5 / 3])


def test_bucketing_by_hand_and_partition():
    X = rand(7, 3, seed=1)
    b = Bucketing(Mean(), s=2, seed=5, round=3)
    buckets = b.buckets(7)
    assert [len(x) for x in buckets] == [2, 2, 2, 1]
    assert sorted(np.concatenate(buckets).tolist()) == list(range(7))
    perm = prng.generator(5, "bucketing", 3).permutation(7)
    np.testing.assert_array_equal(np.concatenate(buckets), perm)
    means = np.stack([X[idx].mean(0) for idx in buckets])
    np.testing.assert_allclose(b(X, None), means.mean(0))
    # s = 1 leaves the inner rule unchanged; with s | k and Mean it is the mean.
    np.testing.assert_allclose(Bucketing(CoordinateMedian(), s=1)(X, None), np.median(X, 0))
    np.testing.assert_allclose(Bucketing(Mean(), s=2)(X[:6], None), X[:6].mean(0))
    # Bucketing is randomized per round: bind() fixes it, different rounds differ.
    cm = Bucketing(CoordinateMedian(), s=2)
    assert not np.allclose(bind(cm, 0, 1)(X, None), bind(cm, 0, 2)(X, None))
    np.testing.assert_array_equal(bind(cm, 0, 1)(X, None), bind(cm, 0, 1)(X, None))


def test_bucket_means_do_not_overflow():
    X = np.array([[1.5e308], [1.6e308], [1.0], [2.0]])
    Y = Bucketing(Mean(), s=2).bucket_means(X)
    assert np.isfinite(Y).all()


# ---------------------------------------------------------------------------- brute force


def brute_cm(X):
    out = []
    for j in range(X.shape[1]):
        col = sorted(X[:, j])
        k = len(col)
        out.append(col[k // 2] if k % 2 else 0.5 * (col[k // 2 - 1] + col[k // 2]))
    return np.array(out)


def brute_tm(X, b):
    return np.array([np.mean(sorted(X[:, j])[b : len(X) - b]) for j in range(X.shape[1])])


def brute_krum(X, f, m):
    k = len(X)
    scores = []
    for i in range(k):
        d = sorted(sum((X[i][t] - X[j][t]) ** 2 for t in range(X.shape[1]))
                   for j in range(k) if j != i)
        scores.append(sum(d[: k - f - 2]))
    order = sorted(range(k), key=lambda i: (scores[i], i))
    return X[order[:m]].mean(0)


def brute_cc(X, tau, iters, v):
    for _ in range(iters):
        acc = np.zeros_like(v)
        for x in X:
            u = x - v
            n = np.sqrt(sum(t * t for t in u))
            acc += u * min(1.0, tau / n) if n > 0 else u
        v = v + acc / len(X)
    return v


def brute_nnm(X, f):
    k = len(X)
    Y = []
    for i in range(k):
        d = [(float(np.sum((X[i] - X[j]) ** 2)) if j != i else -1.0, j) for j in range(k)]
        Y.append(X[[j for _, j in sorted(d)[: k - f]]].mean(0))
    return np.array(Y)


@pytest.mark.parametrize("k,d,seed", [(5, 3, 0), (8, 4, 1), (11, 2, 2), (20, 6, 3)])
def test_against_brute_force(k, d, seed):
    X = rand(k, d, seed)
    X[0] += 50.0  # an outlier
    np.testing.assert_allclose(CoordinateMedian()(X, None), brute_cm(X), rtol=0, atol=1e-12)
    for delta in (0.0, 0.1, 0.2, 0.3):
        b = int(np.floor(delta * k + 1e-9))
        # δ > 0 with ⌊δk⌋ = 0 protects nothing: refused, unless explicitly allowed.
        kw = {"allow_unprotected": True} if delta > 0 and b == 0 else {}
        if kw:
            with pytest.raises(UnprotectedError, match="f = ⌊δk⌋ = 0"):
                TrimmedMean(delta)(X, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnprotectedWarning)
            np.testing.assert_allclose(TrimmedMean(delta, **kw)(X, None), brute_tm(X, b),
                                       atol=1e-12)
            fk = min(b, (k - 3) // 2)  # Krum's cap: k >= 2f + 3
            for m in (1, 2, None):
                mm = k - fk if m is None else m
                np.testing.assert_allclose(Krum(delta, m=m, cap=fk < b, **kw)(X, None),
                                           brute_krum(X, fk, mm), atol=1e-12)
            if delta > 0:  # NNM refuses δ = 0
                np.testing.assert_allclose(NearestNeighborMixing(Mean(), delta, **kw).mix(X),
                                           brute_nnm(X, b), atol=1e-12)
    v0 = np.median(X, 0)
    np.testing.assert_allclose(CenteredClipping(tau=0.7, iters=4)(X, None),
                               brute_cc(X, 0.7, 4, v0), atol=1e-12)
    tau_auto = np.median(np.linalg.norm(X - v0, axis=1))
    np.testing.assert_allclose(CenteredClipping(iters=2)(X, None), brute_cc(X, tau_auto, 2, v0),
                               atol=1e-12)


@pytest.mark.parametrize("k,d,seed", [(5, 2, 0), (9, 5, 1), (20, 10, 2), (40, 3, 3)])
def test_geometric_median_optimality(k, d, seed):
    X = rand(k, d, seed)
    X[:2] += 30.0
    gm = GeometricMedian(tol=1e-10)
    z, iters, resid = gm.solve(X)
    assert resid <= 1e-10 and iters < gm.max_iter
    # Optimality of g(z) = Σ‖z − x_i‖: 0 ∈ ∂g(z). Away from the inputs the gradient
    # Σ (z − x_i)/‖z − x_i‖ vanishes; at an input x_j the other unit vectors sum to norm ≤ 1.
    dist = np.linalg.norm(X - z, axis=1)
    at = dist < 1e-6 * np.median(dist)
    assert at.sum() <= 1
    units = (z - X[~at]) / dist[~at, None]
    if at.any():
        assert np.linalg.norm(units.sum(0)) <= 1.0 + 1e-6
    else:
        assert np.linalg.norm(units.sum(0)) / k < 1e-8
    # Brute force: no perturbation of z lowers the objective.
    obj = dist.sum()
    assert obj <= np.linalg.norm(X - np.median(X, 0), axis=1).sum() * (1 + 1e-9)
    U = np.random.default_rng(seed).standard_normal((2000, d))
    for eps in (1e-1, 1e-3, 1e-5):
        Z = z + eps * U / np.linalg.norm(U, axis=1, keepdims=True)
        objs = np.linalg.norm(X[None] - Z[:, None], axis=2).sum(1)
        assert objs.min() >= obj - 1e-9 * obj


def test_geometric_median_max_iter_warns():
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        GeometricMedian(max_iter=1, tol=1e-15)(rand(9, 4), None)


# ---------------------------------------------------------------------------- properties

EQUIVARIANT = {
    "cm": CoordinateMedian(), "tm": TrimmedMean(0.2), "gm": GeometricMedian(tol=1e-12),
    "krum": Krum(0.2), "multi-krum": Krum(0.2, m=None), "cc": CenteredClipping(),
    "nnm-cm": NearestNeighborMixing(CoordinateMedian(), 0.2),
}


@pytest.mark.parametrize("name", sorted(EQUIVARIANT))
def test_translation_permutation_scale(name):
    agg = EQUIVARIANT[name]
    X = rand(10, 4, 7)
    ref = agg(X, None)
    shift = np.array([1.0, -2.0, 3.0, 0.5])
    np.testing.assert_allclose(agg(X + shift, None), ref + shift, atol=1e-8)
    perm = np.random.default_rng(0).permutation(10)
    np.testing.assert_allclose(agg(X[perm], None), ref, atol=1e-8)
    np.testing.assert_allclose(agg(3.0 * X, None), 3.0 * ref, rtol=1e-7, atol=1e-8)
    # Identical inputs aggregate to that input.
    same = np.repeat(X[:1], 10, 0)
    np.testing.assert_allclose(agg(same, None), X[0], atol=1e-12)


def test_aggregate_tree_uses_the_flattened_vector():
    tree = {"a": rand(6, 2, 1), "b": rand(6, 3, 2).reshape(6, 3, 1)}
    flat = np.concatenate([tree["a"], tree["b"].reshape(6, 3)], 1)
    out = aggregate_tree(GeometricMedian(tol=1e-12), tree, np.ones(6))
    z = GeometricMedian(tol=1e-12)(flat, None)
    np.testing.assert_allclose(out["a"], z[:2])
    np.testing.assert_allclose(out["b"], z[2:].reshape(3, 1))


def test_torch_inputs_come_back_as_torch():
    torch = pytest.importorskip("torch")
    X = torch.tensor(rand(6, 3), dtype=torch.float32)
    for name in _names("aggregator"):
        kw = {"index": 0} if name == "monna" else {}
        out = make_aggregator(name, delta=0.2, **kw)(X, torch.ones(6))
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (3,)
    out = make_aggregator("cm", bucketing=2)(X, torch.ones(6))
    assert isinstance(out, torch.Tensor)


def test_drop_nonfinite():
    X = rand(5, 3)
    X[1, 2] = np.nan
    X[3, 0] = -np.inf
    np.testing.assert_array_equal(finite_rows(X), [True, False, True, False, True])
    Y, w, mask = drop_nonfinite(X, np.arange(5.0))
    np.testing.assert_array_equal(Y, X[[0, 2, 4]])
    np.testing.assert_array_equal(w, [0.0, 2.0, 4.0])


# ---------------------------------------------------------------------------- validation


def test_factory_builds_every_rule_and_wrappers():
    X = rand(20, 3)
    for name, s, nnm in itertools.product(_names("aggregator"), (1, 2), (False, True)):
        kw = {"index": 0} if name == "monna" else {}
        if name == "monna" and s > 1:  # the trusted index would be a random bucket mean
            with pytest.raises(ValueError, match="trusted input would be a bucket mean"):
                make_aggregator(name, delta=0.15, bucketing=s, nnm=nnm, **kw)
            continue
        agg = make_aggregator(name, delta=0.15, bucketing=s, nnm=nnm, seed=1, **kw)
        assert np.isfinite(agg(X, np.ones(20))).all()
        assert isinstance(agg, Bucketing) == (s > 1)
    b = make_aggregator("krum", delta=0.15, bucketing=2)
    assert isinstance(b.inner, Krum) and b.inner.delta == pytest.approx(0.3) and b.inner.m == 1
    assert make_aggregator("multi-krum", delta=0.1).m is None
    with pytest.raises(ValueError, match="s·delta = 0.6 of the bucket means"):
        make_aggregator("tm", delta=0.3, bucketing=2)  # no silent cap at 0.49
    assert isinstance(make_aggregator("geometric-median"), GeometricMedian)


@pytest.mark.parametrize("call,match", [
    (lambda: make_aggregator("avg"), "'avg' is not allowed; allowed: caf, cc, cm"),
    (lambda: make_aggregator("cm", tau=1.0), "unknown key 'aggregator.tau'.*allowed keys"),
    (lambda: make_aggregator("krum", delta=0.6), "delta must be in"),
    (lambda: make_aggregator("cm", bucketing=0), "bucketing size"),
    (lambda: TrimmedMean(-0.1), "delta must be in"),
    (lambda: GeometricMedian(nu=0), "nu must be positive"),
    (lambda: GeometricMedian(max_iter=0), "max_iter"),
    (lambda: Krum(0.1, m=0), "m \\(inputs to average\\)"),
    (lambda: CenteredClipping(tau=-1), "radius tau must be positive"),
    (lambda: CenteredClipping(init="mean"), "unknown init"),
    (lambda: Bucketing(Mean(), s=0), "bucket size"),
    (lambda: CoordinateMedian()(np.ones(3), None), "must be a \\[k, d\\] matrix"),
    (lambda: CoordinateMedian()(np.ones((3, 2)), np.ones(2)), "2 weights for 3"),
    (lambda: GeometricMedian()(np.array([[1.0], [np.nan]]), None), "contain NaN or inf"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
