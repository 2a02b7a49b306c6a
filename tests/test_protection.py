"""Robust rules are never silently non-robust (issue 21, item 3): f = ⌊δk⌋ = 0 for δ > 0, a
Byzantine fraction above δ, a rule's own bound on k and MoNNA's trusted reference are refused
(or, explicitly allowed, warned about once); a client sending NaN cannot make a checked cohort
refuse."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from partialfl.aggregation import (
    ARC,
    CAF,
    MDA,
    SMEA,
    CoordinateMedian,
    Krum,
    Meamed,
    Mean,
    MoNNA,
    NearestNeighborMixing,
    TrimmedMean,
)
from partialfl.aggregation.protection import UnprotectedWarning
from partialfl.algorithms.byzantine import ByzantineConfig, ByzantineRobust, br_ffgg
from partialfl.build import make_aggregator, make_solver
from partialfl.problems.overpersonalized import OverpersonalizedLeastSquares
from partialfl.runtime import run_rounds


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Warnings are once per (rule, k, δ) and process: start each test with none given."""
    from partialfl.aggregation import protection

    monkeypatch.setattr(protection, "_WARNED", set())


def with_attacker(k, d=4, value=1e30, row=0, seed=0):
    X = np.random.default_rng(seed).standard_normal((k, d))
    X[row] = value
    return X


#: every rule or wrapper with a δ, at δ = 0.1 (MoNNA trusts the honest row 1)
SMALL_COHORT = {
    "tm": lambda **kw: TrimmedMean(0.1, **kw),
    "multi-krum": lambda **kw: Krum(0.1, m=None, **kw),
    "mda": lambda **kw: MDA(0.1, **kw),
    "monna": lambda **kw: MoNNA(0.1, index=1, **kw),
    "meamed": lambda **kw: Meamed(0.1, **kw),
    "caf": lambda **kw: CAF(0.1, **kw),
    "smea": lambda **kw: SMEA(0.1, **kw),
    "nnm": lambda **kw: NearestNeighborMixing(CoordinateMedian(), 0.1, **kw),
    "arc": lambda **kw: ARC(Mean(), 0.1, **kw),
}


@pytest.mark.parametrize("name", sorted(SMALL_COHORT))
def test_small_cohort_is_refused_not_averaged(name):
    # Before: at k = 5 with δ = 0.1 (f = 0) one input at 1e30 moved every rule to ~1e29.
    X = with_attacker(5)
    with pytest.raises(ValueError, match=r"delta = 0.1 and k = 5 inputs, f = ⌊δk⌋ = 0.*"
                                         r"needs k ≥ 10 inputs.*allow_unprotected=True"):
        SMALL_COHORT[name]()(X, None)
    # k = 10: f = 1, the attacker is outvoted.
    out = SMALL_COHORT[name]()(with_attacker(10), None)
    assert np.abs(out).max() < 10


@pytest.mark.parametrize("name", sorted(SMALL_COHORT))
def test_allow_unprotected_runs_with_one_warning(name):
    from partialfl.aggregation.protection import UnprotectedWarning

    agg = SMALL_COHORT[name](allow_unprotected=True)
    X = with_attacker(6, seed=1)
    with pytest.warns(UnprotectedWarning, match="running unprotected"):
        first = agg(X, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (rule, k, δ): no second warning
        np.testing.assert_array_equal(agg(X, None), first)
    assert np.abs(first).max() > 1e28  # what it allowed: the attacker passes


def test_error_names_the_rule_bound_and_the_way_out():
    # Krum's own bound k ≥ 2f + 3: δ = 0.2 at k = 5 (f = 1) is fine, at k = 6 f = 1 too …
    X = with_attacker(7)
    with pytest.raises(ValueError, match=r"krum: f = ⌊δk⌋ = 2 .* k = 7 needs k ≥ 2f \+ 3 = 7"
                                         r"|krum: f = ⌊δk⌋ = 2 Byzantine inputs among k = 6"):
        Krum(0.34)(X[:6], None)
    # … and the message of the f = 0 refusal names k, δ, f and the smallest k allowed.
    with pytest.raises(ValueError) as e:
        TrimmedMean(0.15)(X[:6], None)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("trimmed mean", "delta = 0.15", "k = 6", "f = ⌊δk⌋ = 0", "k ≥ 7"):
        assert part in msg, (part, msg)


def test_factory_passes_allow_unprotected_to_the_rule_and_wrappers():
    from partialfl.aggregation.protection import UnprotectedWarning

    X = with_attacker(5, seed=2)
    with pytest.raises(ValueError, match="nearest-neighbour mixing: with delta = 0.1"):
        make_aggregator("cm", delta=0.1, nnm=True)(X, None)
    with pytest.raises(ValueError, match="arc: with delta = 0.1"):
        make_aggregator("cm", delta=0.1, arc=True)(X, None)
    agg = make_aggregator("tm", delta=0.1, nnm=True, arc=True, allow_unprotected=True)
    assert agg.allow_unprotected and agg.inner.allow_unprotected
    assert agg.inner.inner.allow_unprotected
    with pytest.warns(UnprotectedWarning):
        agg(X, None)
    with pytest.raises(ValueError, match="allow_unprotected: expected true or false"):
        make_aggregator("tm", allow_unprotected="yes")


def test_bucketing_names_the_bucket_means():
    # 8 clients in buckets of 2: 4 bucket means, inner δ = 0.2 → ⌊0.8⌋ = 0.
    with pytest.raises(ValueError, match=r"bucketing s = 2 makes k = 8 inputs 4 bucket means: "
                                         r"trimmed mean: with delta = 0.2 and k = 4"):
        make_aggregator("tm", delta=0.1, bucketing=2)(with_attacker(8), None)
    assert make_aggregator("tm", delta=0.1, bucketing=2).tolerated(10) == 1


def test_tolerated_reports_the_whole_chain():
    from partialfl.aggregation.protection import tolerated

    assert tolerated(Mean(), 10) is None and tolerated(CoordinateMedian(), 10) == 4
    assert tolerated(TrimmedMean(0.2), 10) == 2
    assert tolerated(ARC(TrimmedMean(0.1), 0.2), 10) == 1  # the weaker of the two
    with pytest.raises(ValueError, match="f = ⌊δk⌋ = 0"):
        tolerated(NearestNeighborMixing(CoordinateMedian(), 0.1), 9)


# ------------------------------------------------------------------ MoNNA's trusted reference

def test_monna_needs_a_reference_the_server_chose():
    # Before: MoNNA() trusted row 0, whatever client sent it; with the attacker there (k = 20,
    # f = 2) the result was ~1e29.
    with pytest.raises(ValueError, match="monna: needs exactly one trusted reference"):
        MoNNA(0.1)
    with pytest.raises(ValueError, match="monna: needs exactly one trusted reference"):
        MoNNA(0.1, index=0, reference=np.zeros(4))
    with pytest.raises(ValueError, match="monna: needs exactly one trusted reference"):
        make_aggregator("monna", delta=0.1)
    X = with_attacker(20, row=0)
    honest = X[1:].mean(0)
    out = MoNNA(0.1, reference=honest)(X, None)  # a server-side vector, not an input
    assert np.abs(out).max() < 10
    np.testing.assert_allclose(MoNNA(0.1, reference=X[3])(X, None),
                               MoNNA(0.1, index=3)(X, None), rtol=1e-12)
    with pytest.raises(ValueError, match="reference vector of length 4 for inputs of dim"):
        MoNNA(0.1, reference=np.zeros(4))(np.ones((10, 3)), None)
    with pytest.raises(ValueError, match="reference vector contains NaN"):
        MoNNA(0.1, reference=[0.0, np.nan])
    # Under bucketing the trusted input would be a random bucket mean: refused.
    for key in ("index", "trusted"):
        with pytest.raises(ValueError, match="trusted input would be a bucket mean"):
            make_aggregator("monna", delta=0.1, bucketing=2, **{key: 0})
    agg = make_aggregator("monna", delta=0.1, index=0)
    assert np.abs(agg(with_attacker(20, row=5), None)).max() < 10


# ------------------------------------------------------------------ BR-FFGG

def huge(honest, own, rng=None):
    """Every Byzantine client sends 1e30 (finite, so it is not dropped)."""
    return np.full_like(own, 1e30)


@pytest.fixture(scope="module")
def problem():
    return OverpersonalizedLeastSquares(num_clients=20, n=40, d_theta=6, d_w=3,
                                        heterogeneity=1.0, seed=1)


def test_br_ffgg_refuses_a_cohort_its_rule_cannot_protect(problem):
    # Before: 5 clients per round with δ = 0.1 (f = 0) and 10% Byzantine ran and diverged.
    byz = ByzantineConfig.sample(20, 0.1, 0, huge)
    alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.1), byz)
    with pytest.raises(ValueError, match="trimmed mean: with delta = 0.1 and k = 5 inputs"):
        run_rounds(problem, alg, 3, clients_per_round=5, seed=0)
    # Every client each round (k = 20, f = 2): protected, it converges.
    res = run_rounds(problem, alg, 30, clients_per_round=None, seed=0)
    assert np.isfinite(res.state.theta["theta"]).all()
    assert np.abs(res.state.theta["theta"]).max() < 1e3


def test_br_ffgg_refuses_a_byzantine_fraction_above_delta(problem):
    # Before: 20% Byzantine with δ = 0.1 at k = 20 reached an error of 5e8 without a word.
    byz = ByzantineConfig.sample(20, 0.2, 0, huge)
    alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.1), byz)
    with pytest.raises(ValueError, match=r"fraction of the run \(0.2\) exceeds the "
                                         r"aggregator's delta = 0.1.*delta ≥ 0.2"):
        run_rounds(problem, alg, 3, seed=0)
    from partialfl.aggregation.protection import UnprotectedWarning

    loose = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.1),
                    byz, allow_unprotected=True)
    with pytest.warns(UnprotectedWarning) as seen:
        res = run_rounds(problem, loose, 2, seed=0)
    said = " ".join(str(w.message) for w in seen)
    assert "exceeds the aggregator's delta" in said and "more than the f = 2" in said
    assert res.state.extra["byz_excess"] == 2  # 4 Byzantine in each cohort of 20, f = 2
    # Bucketing: the client-level δ is the rule's δ over s.
    ok = ByzantineRobust(alg.base, make_aggregator("cm", delta=0.1, bucketing=2), byz)
    ok.init(problem, problem.init_theta())  # CM has no δ: not checked
    with pytest.raises(ValueError, match="exceeds the aggregator's delta = 0.1"):
        ByzantineRobust(alg.base, make_aggregator("krum", delta=0.1, bucketing=2),
                        byz).init(problem, problem.init_theta())


def test_dropped_nonfinite_rows_do_not_make_the_cohort_refuse(problem):
    """10 clients per round with δ = 0.1 tolerate one; when that client sends inf its row is
    dropped and the rule sees 9 < ⌈1/δ⌉ inputs: the cohort was checked as sent, so the round
    aggregates (the Byzantine budget was spent on the dropped row)."""

    def inf(honest, own, rng=None):
        return np.full_like(own, np.inf)

    byz = ByzantineConfig((3,), inf)
    for name in ("tm", "krum", "meamed"):
        alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator(name, delta=0.1),
                      byz)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            res = run_rounds(problem, alg, 4, clients_per_round=10, seed=1)
        assert res.state.extra["byz_dropped"] >= 1
        assert np.isfinite(res.state.theta["theta"]).all()
    # Called directly, the same 9 inputs are refused.
    with pytest.raises(ValueError, match="k = 9 inputs, f = ⌊δk⌋ = 0"):
        TrimmedMean(0.1)(np.ones((9, 3)), None)


def test_rounds_with_more_byzantine_clients_than_tolerated_are_counted(problem):
    """10% Byzantine (2 of 20) is within δ = 0.1, but a sampled cohort of 10 tolerates only one:
    such rounds are counted (and warned about once)."""
    from partialfl.aggregation.protection import UnprotectedWarning

    byz = ByzantineConfig((0, 1), huge)
    alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.1), byz)
    with pytest.warns(UnprotectedWarning, match="more than the f = 1 the aggregator tolerates"):
        res = run_rounds(problem, alg, 30, clients_per_round=10, seed=3)
    from partialfl.runtime.sync import sample_cohort

    expect = sum(int(np.isin([0, 1], sample_cohort(3, r, 20, 10)).all()) for r in range(30))
    assert expect > 0 and res.state.extra["byz_excess"] == expect


def test_a_planned_cohort_is_refused_before_any_round(problem):
    byz = ByzantineConfig.sample(20, 0.1, 0, huge)
    alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.1), byz,
                  clients_per_round=5)
    with pytest.raises(ValueError, match="trimmed mean: with delta = 0.1 and k = 5 inputs"):
        alg.init(problem, problem.init_theta())
    with pytest.raises(ValueError, match="clients_per_round must be an integer >= 1"):
        ByzantineRobust(alg.base, Mean(), clients_per_round=0)


def test_clients_that_fail_do_not_stop_a_protected_run(problem):
    """10 clients per round with δ = 0.1 tolerate one; when a client fails in round 2 only 9
    reply: the rule keeps the planned f = 1 (⌊0.9⌋ = 0 would let the attacker through), so the
    round runs protected, unwarned and uncounted, and θ stays near the attack-free run's."""
    from partialfl.runtime.faults import FaultInjector
    from partialfl.runtime.sync import sample_cohort

    byz = ByzantineConfig((0,), huge)
    alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.1), byz)
    victim = int(sample_cohort(2, 2, 20, 10)[-1])
    run = FaultInjector(alg, at={(2, victim): "raise"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        res = run_rounds(problem, run, 5, clients_per_round=10, seed=2)
    assert res.state.extra["rounds_unprotected"] == 0 and res.state.round == 5
    clean = run_rounds(problem, br_ffgg(make_solver("exact"), 1 / problem.L,
                                        make_aggregator("tm", delta=0.1)), 5,
                       clients_per_round=10, seed=2)
    gap = np.abs(res.state.theta["theta"] - clean.state.theta["theta"]).max()
    assert gap < np.abs(clean.state.theta["theta"]).max()  # bounded: the 1e30s were trimmed


def test_too_few_usable_updates_for_the_planned_f_skip_the_step(problem):
    """TM with δ = 0.2 and 5 clients per round tolerates f = 1 and needs k ≥ 3: when 3 clients
    fail in round 1, the 2 left cannot be protected for f = 1, so that round's step is
    skipped (θ kept), warned and counted; the other rounds step."""
    from partialfl.runtime.faults import FaultInjector
    from partialfl.runtime.sync import sample_cohort

    byz = ByzantineConfig((0,), huge)
    alg = br_ffgg(make_solver("exact"), 1 / problem.L, make_aggregator("tm", delta=0.2), byz)
    lost = [int(m) for m in sample_cohort(2, 1, 20, 5) if int(m) != 0][:3]
    run = FaultInjector(alg, at={(1, m): "raise" for m in lost})
    with pytest.warns(UnprotectedWarning, match=r"round 1: only 2 of the 5 clients .* planned "
                      r"f = 1: .* the round's step is skipped"):
        res = run_rounds(problem, run, 3, clients_per_round=5, seed=2)
    assert res.state.extra["rounds_unprotected"] == 1 and res.state.round == 3
    assert np.isfinite(res.state.theta["theta"]).all()
    assert np.abs(res.state.theta["theta"]).max() < 1e3


def test_the_sync_runtime_keeps_the_planned_f_when_clients_fail(problem):
    """FFGG with a trimmed mean (δ = 0.1) and 10 clients per round (f = 1): a client failing
    in round 1 leaves 9 (⌊0.9⌋ = 0). The runtime runs the rule with the planned f = 1 — the
    round steps (it used to be skipped) and the rule still trims one input from each side."""
    from partialfl.aggregation import TrimmedMean
    from partialfl.aggregation.protection import tolerated
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.runtime.faults import FaultInjector
    from partialfl.runtime.sync import sample_cohort
    from partialfl.server import SGD

    seen: list[tuple[int, int]] = []

    class Spy:
        weighted = False

        def __init__(self) -> None:
            self.inner = TrimmedMean(delta=0.1)

        def tolerated(self, k: int) -> int:
            return self.inner.tolerated(k)

        def __call__(self, vectors, weights=None):
            seen.append((len(vectors), tolerated(self.inner, len(vectors))))
            return self.inner(vectors, weights)

    alg = FFGG(make_solver("exact"), SGD(lr=1 / problem.L), aggregator=Spy())
    victim = int(sample_cohort(2, 1, 20, 10)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        res = run_rounds(problem, FaultInjector(alg, at={(1, victim): "raise"}), 3,
                         clients_per_round=10, seed=2)
    assert res.state.round == 3 and "rounds_unprotected" not in res.state.extra
    assert seen == [(10, 1), (9, 1), (10, 1)]
