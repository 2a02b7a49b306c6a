"""Robust rules and attacks (issue 13): defaults that keep robustness, non-finite guards, the
new rules (MDA, MoNNA, Meamed, CAF, SMEA, ARC, static clipping) and attacks (Inf, optimised
ALIE/IPM), and agreement with the reference library byzfl where the semantics match."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _byzfl import load_byzfl

from partialfl.aggregation import (
    ARC,
    CAF,
    MDA,
    SMEA,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Meamed,
    Mean,
    MoNNA,
    NearestNeighborMixing,
    NonFiniteInputError,
    StaticClipping,
    TrimmedMean,
    aggregate_tree,
)
from partialfl.aggregation.common import gram, sq_dists
from partialfl.attacks import (
    ALIE,
    IPM,
    Inf,
    OptimizedALIE,
    OptimizedIPM,
    line_search,
)
from partialfl.build import make_aggregator, make_attack
from partialfl.registry import names as _names

BYZFL = load_byzfl()
needs_byzfl = pytest.mark.skipif(BYZFL is None, reason="byzfl (reference library) not installed")


def rand(k, d, seed=0):
    return np.random.default_rng(seed).standard_normal((k, d)) * np.arange(1, d + 1)


def with_outliers(k=20, d=6, f=4, value=1e30, seed=0):
    X = rand(k, d, seed)
    X[:f] = value
    return X


# ------------------------------------------------------------- robustness kept by defaults

def test_nnm_takes_delta_from_the_rule_or_refuses():
    # Before: make_aggregator("gm", nnm=True) mixed every input with all k (δ = 0) and one
    # input at 1e30 moved the output to ~1e29.
    for name in ("cm", "gm", "cc"):
        with pytest.raises(ValueError, match="nearest-neighbour mixing needs the Byzantine"):
            make_aggregator(name, nnm=True)
    with pytest.raises(ValueError, match="delta = 0 would mix every input"):
        NearestNeighborMixing(CoordinateMedian(), delta=0.0)
    with pytest.raises(ValueError, match="has none: pass delta > 0"):
        NearestNeighborMixing(CoordinateMedian())
    assert NearestNeighborMixing(Krum(0.2)).delta == 0.2  # derived from the wrapped rule
    assert make_aggregator("krum", nnm=True).delta == 0.1  # the rule's default δ
    X = with_outliers(k=20, f=1)
    for name in ("cm", "gm", "krum", "cc", "tm"):
        kw = {} if name in ("krum", "tm") else {"delta": 0.1}
        out = make_aggregator(name, nnm=True, **kw)(X, None)
        assert np.abs(out).max() < 100, (name, np.abs(out).max())


def test_bucketing_derives_delta_and_never_caps_silently():
    # No delta given: the rule's default δ = 0.1 of clients -> s·δ of the bucket means.
    assert make_aggregator("krum", bucketing=2).inner.delta == pytest.approx(0.2)
    assert make_aggregator("tm", bucketing=3, nnm=True).inner.delta == pytest.approx(0.3)
    assert make_aggregator("krum", bucketing=2).delta == pytest.approx(0.1)
    with pytest.raises(ValueError, match="s·delta = 0.6"):
        make_aggregator("cm", delta=0.3, bucketing=2)


def test_multi_krum_under_bucketing_refuses_or_caps_explicitly():
    X = rand(10, 3)
    agg = make_aggregator("multi-krum", delta=0.2, bucketing=2)  # 5 buckets, f = 2 > 1
    with pytest.raises(ValueError, match="needs k ≥ 2f \\+ 3 = 7.*cap=True"):
        agg(X, None)
    capped = make_aggregator("multi-krum", delta=0.2, bucketing=2, cap=True)
    assert capped.inner.cap and np.isfinite(capped(X, None)).all()


# ------------------------------------------------------------------- non-finite inputs

def test_mean_skips_nonfinite_rows_and_counts_them():
    X = rand(5, 3)
    bad = X.copy()
    bad[1, 2], bad[3, 0] = np.nan, np.inf
    with pytest.warns(RuntimeWarning, match="skipped 2 of 5 input rows"):
        out = Mean()(bad, np.ones(5))
    np.testing.assert_allclose(out, X[[0, 2, 4]].mean(0))
    w = np.array([1.0, np.nan, 2.0, 1.0, 1.0])
    with pytest.warns(RuntimeWarning, match="skipped 1 of 5"):
        out = Mean(weighted=True)(X, w)
    keep = [0, 2, 3, 4]
    np.testing.assert_allclose(out, (w[keep, None] * X[keep]).sum(0) / w[keep].sum())
    with pytest.raises(NonFiniteInputError, match="all 2 input rows"):
        Mean()(np.full((2, 3), np.nan), None)
    # A tree: a client with NaN in one leaf is dropped from every leaf.
    tree = {"a": X[:, :2].copy(), "b": X[:, 2:].copy()}
    tree["b"][4, 0] = np.nan
    with pytest.warns(RuntimeWarning, match="skipped 1 of 5"):
        out = aggregate_tree(Mean(), tree, np.ones(5))
    np.testing.assert_allclose(out["a"], X[:4, :2].mean(0))
    np.testing.assert_allclose(out["b"], X[:4, 2:].mean(0))


def test_mean_of_finite_rows_is_finite():
    # Before: numpy's sum overflowed (inf) for entries near 1e308, and a weight of 1e39 became
    # inf in float32 (θ turned NaN under example weighting).
    X = np.array([[1.7e308, -1.0], [1.7e308, 1.0]])
    with np.errstate(over="ignore"):
        assert not np.isfinite(X.mean(0)).all()
    np.testing.assert_allclose(Mean()(X, None), [1.7e308, 0.0])
    np.testing.assert_allclose(Mean(weighted=True)(X, np.array([1e308, 1.5e308])),
                               [1.7e308, 0.2], rtol=1e-14)
    Y = rand(5, 3)
    w = np.arange(1.0, 6.0)
    np.testing.assert_array_equal(Mean(weighted=True)(Y, w), (w[:, None] * Y).sum(0) / w.sum())
    torch = pytest.importorskip("torch")
    T = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    out = Mean(weighted=True)(T, np.array([1e39, 1e39]))
    assert out.dtype == torch.float32 and out.tolist() == [2.0, 3.0]


def test_weighted_geometric_median_with_huge_weights_is_finite():
    # Before: weights of 1e308 overflowed the Weiszfeld sums (found by tests/fuzz): NaN.
    X = np.array([[1e-201], [-1e-201], [3e-201]])
    w = np.array([1e308, 1e308, 1e308])
    out = GeometricMedian(weighted=True)(X, w)
    np.testing.assert_allclose(out, GeometricMedian()(X, None), rtol=1e-9)


def test_mean_on_torch_skips_nonfinite_rows():
    torch = pytest.importorskip("torch")
    X = torch.tensor(rand(4, 3))
    X[2, 1] = float("nan")
    with pytest.warns(RuntimeWarning):
        out = Mean()(X, None)
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(out.numpy(), rand(4, 3)[[0, 1, 3]].mean(0))


def test_centered_clipping_has_no_overflow_warning():
    X = np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]])  # rows equal to v⁰ = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = CenteredClipping(tau=10.0, iters=2)(X, None)
    np.testing.assert_allclose(out, [0.75, 1.0])  # nothing clipped: the mean


# ------------------------------------------------------------------- Gram distances

def test_gram_distances_are_exact_enough_and_outlier_safe():
    X = rand(12, 30, 3) + 1e6  # a large common offset
    D = sq_dists(gram(X)[0])
    ref = ((X[:, None] - X[None]) ** 2).sum(2)
    np.testing.assert_allclose(D, ref, rtol=1e-9, atol=1e-9 * ref.max())
    Y = rand(8, 5, 4)
    Y[0] = 1e300  # centre is never the outlier; nothing overflows, nothing underflows
    G, s = gram(Y)
    D = sq_dists(G)
    assert np.isfinite(D).all() and 1e50 < s < 1e51  # √(1e100·mid · mid), mid = median ‖·‖∞
    ref = ((Y[1:, None] - Y[None, 1:]) ** 2).sum(2)
    np.testing.assert_allclose(D[1:, 1:], ref / s / s, rtol=1e-9)  # no atol: none underflow
    assert D[0, 1:].min() > 1e150 * D[1:, 1:].max()  # the outlier stays the farthest by far


# ------------------------------------------------------------------- every rule

NEW_RULES = {
    "mda": MDA(0.2), "monna": MoNNA(0.2, index=0), "meamed": Meamed(0.2), "caf": CAF(0.2),
    "smea": SMEA(0.2), "arc-cm": ARC(CoordinateMedian(), 0.2),
    "clip-cm": StaticClipping(CoordinateMedian(), c=1e3),
}
ALL_RULES = {**{n: make_aggregator(n, delta=0.2, **({"index": 0} if n == "monna" else {}))
                for n in _names("aggregator", builtin=True) if n != "mean"},
             **NEW_RULES}


@pytest.mark.parametrize("name", sorted(ALL_RULES))
def test_rule_properties(name):
    agg = ALL_RULES[name]
    X = rand(10, 4, 7)
    ref = np.asarray(agg(X, None))
    # Permutation invariance (MoNNA: the trusted input stays first).
    perm = np.random.default_rng(1).permutation(10)
    if name == "monna":
        perm = np.concatenate([[0], perm[perm != 0]])
    np.testing.assert_allclose(agg(X[perm], None), ref, atol=1e-9)
    # Exactness on identical inputs.
    same = np.repeat(X[1:2], 10, 0)
    np.testing.assert_allclose(agg(same, None), X[1], rtol=1e-12, atol=1e-12)
    # Robustness: f = 2 inputs at 1e30 (the trusted input of MoNNA is honest).
    Y = X.copy()
    Y[[3, 7]] = 1e30
    out = np.asarray(agg(Y, None))
    assert np.isfinite(out).all() and np.abs(out).max() < 50, np.abs(out).max()


def test_torch_inputs_come_back_as_torch():
    torch = pytest.importorskip("torch")
    X = torch.tensor(rand(8, 3), dtype=torch.float32)
    for agg in NEW_RULES.values():
        out = agg(X, torch.ones(8))
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32


def test_new_rules_by_hand():
    X = np.array([[0.0], [1.0], [2.0], [10.0], [11.0]])
    # MDA, f = 2: the 3 points of least diameter are {0, 1, 2}.
    np.testing.assert_allclose(MDA(0.4)(X, None), [1.0])
    # MoNNA around x_3 = 10, k − f = 3 nearest: 10, 11, 2.
    np.testing.assert_allclose(MoNNA(0.4, index=3)(X, None), [23 / 3])
    # Meamed: median 2, the 3 values closest: 1, 2, 0.
    np.testing.assert_allclose(Meamed(0.4)(X, None), [1.0])
    # SMEA in 1-D: the 3 points of least variance.
    np.testing.assert_allclose(SMEA(0.4)(X, None), [1.0])
    # ARC, f = 1 of 5: ⌊2·(1/5)·4⌋ = 1 clipped (11 → 10); static clipping to 5.
    np.testing.assert_allclose(ARC(Mean(), 0.2).transform(X)[:, 0], [0, 1, 2, 10, 10])
    np.testing.assert_allclose(StaticClipping(Mean(), 5.0).transform(X)[:, 0], [0, 1, 2, 5, 5])
    # CAF with f = 0 is the mean.
    np.testing.assert_allclose(CAF(0.0)(X, None), X.mean(0))


@pytest.mark.parametrize("call,match", [
    (lambda: MDA(0.2, max_subsets=10)(rand(20, 2), None), "subsets of 16 among 20"),
    (lambda: MoNNA(0.1, index=5)(rand(3, 2), None), "trusted index 5"),
    (lambda: StaticClipping(Mean(), c=0.0), "radius c must be a positive"),
    (lambda: ARC(CoordinateMedian()), "has none: pass delta"),
    (lambda: make_aggregator("cm", arc=True), "ARC needs the Byzantine"),
    (lambda: make_aggregator("smea", nnm="yes"), "nnm: expected true or false"),
    (lambda: Krum(0.1, cap=1), "cap must be True or False"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_registry_wraps_in_order():
    agg = make_aggregator("cm", delta=0.1, bucketing=2, nnm=True, arc=True, clip=3.0, seed=4)
    assert isinstance(agg, StaticClipping) and isinstance(agg.inner, ARC)
    assert agg.inner.delta == 0.1 and agg.inner.inner.s == 2
    assert agg.inner.inner.inner.delta == pytest.approx(0.2)


# ------------------------------------------------------------------- attacks

def test_inf_attack_is_dropped_by_the_server():
    own = rand(2, 3)
    assert np.isposinf(Inf()(rand(5, 3), own)).all()
    assert make_attack("inf").name == "inf"


def test_alie_ddof_is_explicit():
    H = rand(6, 3)
    np.testing.assert_allclose(ALIE(z=1.0)(H, H[:1])[0], H.mean(0) - H.std(0))
    np.testing.assert_allclose(ALIE(z=1.0, ddof=1)(H, H[:1])[0], H.mean(0) - H.std(0, ddof=1))
    with pytest.raises(ValueError, match="ddof must be 0"):
        ALIE(ddof=2)


def test_line_search_by_hand():
    seen = []

    def obj(t):
        seen.append(t)
        return -(t - 13.0) ** 2

    # 0 → 10 (better, step doubles to 20) → 30 (worse: step 16, contraction) → 26 → 22.8 …
    assert line_search(obj, 0.0, 10.0, 0.8, 5) == 10.0
    np.testing.assert_allclose(seen, [0.0, 10.0, 30.0, 26.0, 22.8])
    seen.clear()
    # … 20.24, 18.192, 16.5536 (all worse), then 15.24288 = 10 + 16·0.8⁵ is better than 10.
    assert line_search(obj, 0.0, 10.0, 0.8, 9) == pytest.approx(10.0 + 16 * 0.8**5)


def test_optimized_attacks_beat_their_fixed_versions():
    H = rand(15, 5, 2) + 1.0
    own = H[:4]
    mu = H.mean(0)
    for agg in (Mean(), CoordinateMedian(), TrimmedMean(0.2)):

        def damage(sent, agg=agg):
            return np.linalg.norm(agg(np.concatenate([H, sent]), None) - mu)

        opt = OptimizedALIE().against(agg)
        assert damage(opt(H, own)) >= damage(ALIE(z=0.0)(H, own)) - 1e-12
        assert damage(OptimizedIPM().against(agg)(H, own)) >= damage(IPM(0.1)(H, own)) - 1e-12
    # no defence given: the mean (byzfl's default)
    np.testing.assert_array_equal(OptimizedIPM()(H, own), OptimizedIPM().against(Mean())(H, own))


def test_byzantine_wrapper_hands_the_defence_to_optimized_attacks():
    from partialfl.algorithms.base import RoundContext
    from partialfl.algorithms.byzantine import ByzantineConfig, ByzantineRobust
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.types import ClientUpdates

    agg = CoordinateMedian()
    alg = ByzantineRobust(FFGG(make_solver("exact")), agg,
                          ByzantineConfig((0, 1), make_attack("ipm-opt")))
    X = rand(8, 3) + 1.0
    ups = ClientUpdates({"theta": X}, np.ones(8), np.arange(8))
    sent = alg.corrupt(ups, RoundContext(0, 0)).vectors["theta"][:2]
    expect = OptimizedIPM(aggregator=agg)(X[2:], X[:2])
    np.testing.assert_array_equal(sent, expect)


# ------------------------------------------------------------------- byzfl agreement

@needs_byzfl
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rules_agree_with_byzfl(seed):
    A, P, _ = BYZFL
    k, d, f = 11, 7, 2
    X = rand(k, d, seed)
    X[0] += 8.0
    delta = f / k + 1e-6  # ⌊δk⌋ = f
    tol = dict(rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(CoordinateMedian()(X, None), A.Median()(X), **tol)
    np.testing.assert_allclose(TrimmedMean(delta)(X, None), A.TrMean(f)(X), **tol)
    # Krum: byzfl averages the k − f' − 1 nearest, ours sums the k − f − 2: f' = f + 1.
    np.testing.assert_allclose(Krum(delta)(X, None), A.Krum(f + 1)(X), **tol)
    np.testing.assert_allclose(Krum(delta, m=k - f - 1)(X, None), A.MultiKrum(f + 1)(X), **tol)
    np.testing.assert_allclose(MDA(delta)(X, None), A.MDA(f)(X), **tol)
    for idx in (0, 4):
        np.testing.assert_allclose(MoNNA(delta, index=idx)(X, None), A.MoNNA(f, idx)(X), **tol)
    np.testing.assert_allclose(Meamed(delta)(X, None), A.Meamed(f)(X), **tol)
    np.testing.assert_allclose(CenteredClipping(tau=2.5, iters=4, init="zero")(X, None),
                               A.CenteredClipping(L=4, tau=2.5)(X), **tol)
    # Pre-aggregators: NNM, ARC, static clipping transform the inputs the same way.
    np.testing.assert_allclose(NearestNeighborMixing(Mean(), delta).transform(X),
                               P.NNM(f)(X.copy()), **tol)
    np.testing.assert_allclose(ARC(Mean(), delta).transform(X), P.ARC(f)(X.copy()), **tol)
    np.testing.assert_allclose(StaticClipping(Mean(), 3.0).transform(X),
                               P.Clipping(3.0)(X.copy()), **tol)
    # GM: byzfl runs T Weiszfeld steps from 0 with absolute smoothing; run long, compare.
    np.testing.assert_allclose(GeometricMedian(tol=1e-13)(X, None),
                               A.GeometricMedian(nu=1e-12, T=3000)(X), rtol=1e-7, atol=1e-7)


@needs_byzfl
@pytest.mark.parametrize("seed", [0, 1])
def test_eigenvalue_rules_agree_with_byzfl_where_its_power_step_is_exact(seed):
    """byzfl's CAF and SMEA take one power-iteration step from a random vector and use ‖Av‖ as
    the eigenvalue: exact in one dimension only, where ours (exact eigenpair) must agree."""
    A, _, _ = BYZFL
    X = np.random.default_rng(seed).standard_normal((11, 1))
    X[[2, 5]] += 9.0
    f = 2
    delta = f / 11 + 1e-6
    np.random.seed(seed)
    np.testing.assert_allclose(CAF(delta)(X, None), A.CAF(f)(X), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(SMEA(delta)(X, None), A.SMEA(f)(X), rtol=1e-10, atol=1e-10)


@needs_byzfl
def test_attacks_agree_with_byzfl():
    A, _, T = BYZFL
    H = rand(9, 4, 5) + 0.5
    own = H[:3]
    np.testing.assert_allclose(ALIE(z=-1.5, ddof=1)(H, own)[0],
                               T.ALittleIsEnough(1.5)(H), rtol=1e-12)
    np.testing.assert_allclose(IPM(2.0)(H, own)[0], T.InnerProductManipulation(2.0)(H),
                               rtol=1e-12)
    assert np.isposinf(T.Inf()(H)).all() and np.isposinf(Inf()(H, own)).all()
    ours = OptimizedIPM(aggregator=CoordinateMedian())(H, own)[0]
    theirs = T.Optimal_InnerProductManipulation(agg=A.Median(), pre_agg_list=[], f=3)(H)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
    ours = OptimizedALIE(aggregator=CoordinateMedian(), step=-10.0, ddof=1)(H, own)[0]
    theirs = T.Optimal_ALittleIsEnough(agg=A.Median(), pre_agg_list=[], f=3)(H)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
