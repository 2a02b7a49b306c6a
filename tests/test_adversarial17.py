"""Adversarial round 17 (issue 21, tried again from scratch): regression tests of what broke.

Each test failed on the code before its fix (checked with ``--runxfail``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest


class _Send:
    """Every Byzantine client sends 1e30 (finite)."""

    def __call__(self, honest, own, rng):
        return np.full_like(own, 1e30)


# -- area 3: a Byzantine fraction above the δ of a rule inside a wrapper -----------------------
def test_a_fraction_above_the_inner_rules_delta_is_refused_through_a_wrapper():
    """``NearestNeighborMixing(TrimmedMean(δ=0.05), delta=0.3)`` with 5 of 20 clients
    Byzantine (fraction 0.25 > 0.05) and full participation: the chain tolerates
    min(⌊0.3·20⌋, ⌊0.05·20⌋) = 1 Byzantine client (``tolerated`` says so), yet
    ``ByzantineRobust.init`` passes the fraction — :func:`check_fraction` reads
    :func:`inner_delta`, the *first* δ along the chain (NNM's 0.3) — and the run only warns
    ``byz_excess`` every round while θ reaches ~1.7e28. The same trimmed mean unwrapped is
    refused (fraction 0.25 > δ 0.05). Expected: refused (one line), or θ bounded."""
    from partialfl.aggregation.protection import UnprotectedError, check_fraction, tolerated
    from partialfl.aggregation.wrappers import NearestNeighborMixing
    from partialfl.algorithms.byzantine import ByzantineConfig, br_ffgg
    from partialfl.build import make_aggregator, make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds

    tm = make_aggregator("tm", delta=0.05)
    with pytest.raises(UnprotectedError):  # unwrapped: refused, as documented
        check_fraction(tm, 0.25, False)
    agg = NearestNeighborMixing(tm, delta=0.3)
    assert tolerated(agg, 20) == 1  # what the chain tolerates among the 20
    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=20, n=40, d_theta=3, d_w=2, seed=0))
    alg = br_ffgg(make_solver("exact"), 1 / p.L, agg, ByzantineConfig((1, 2, 3, 4, 5), _Send()),
                  clients_per_round=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            res = run_rounds(p, alg, 3, clients_per_round=20, seed=0)
        except UnprotectedError as e:
            assert "\n" not in str(e)
            return
    assert np.abs(res.state.theta["theta"]).max() < 1e3


# -- area 2: central DP on Flower — a node's rows are not checked against the clip norm -------
def _scaled_rows(factor):
    def tamper(partition, mtype, content):
        from flwr.app import Array

        if partition == 1 and mtype == "train" and "vectors" in content.keys():
            for name in list(content["vectors"].keys()):
                content["vectors"][name] = Array(content["vectors"][name].numpy() * factor)
    return tamper


def test_central_dp_rows_above_the_clip_norm_are_refused_or_clipped(loopback):
    """Central DP (``[privacy] clip_norm = 1, noise_multiplier = 0.5``) over 2 SuperNodes,
    no SecAgg: the server sends C and each node must clip every row to ‖ũ_m‖ ≤ C
    (:mod:`partialfl.algorithms.dp`: "one client moves ū by at most C/k whatever the cohort's
    size"; the accountant's sensitivity). Partition 1 multiplies its rows by 1e3 or 1e6:
    the server sums them as they are — |θ| went from 0.12 (clean) to 32 and 7e4. Rows the
    server can see in plain text violate the bound it sent, so expected: that node's reply is
    a counted failure, or the server clips it to C (then the two tampered runs are equal)."""
    pytest.importorskip("dp_accounting")
    from _flower_sims import ls_run

    from partialfl.flower.server import run_server

    run = ls_run(3, 4, eval_every=1, spec={"privacy": {"name": "dp", "clip_norm": 1.0,
                                                       "noise_multiplier": 0.5}})
    reports = [run_server(loopback(2, tamper=_scaled_rows(f),
                                   node_config={"dp-noise-key": "seed"}), run)
               for f in (1e3, 1e6)]
    if all(1 in {x.partition for x in r.failures} for r in reports):
        return
    np.testing.assert_allclose(reports[0].theta["theta"], reports[1].theta["theta"],
                               rtol=1e-6, atol=1e-9)


# -- area 1: a processes backend reused after the algorithm changed ----------------------------
def test_a_reused_process_pool_never_runs_a_stale_copy_of_the_algorithm():
    """``backend = ProcessBackend(1)`` passed to two ``run_rounds`` calls (a user's sweep in
    Python), the algorithm's fine-tuner changed in between (``alg.solver = cg(tau=5)``, a
    public attribute): the pool's key is ``(id(problem), id(algorithm))``
    (runtime/pool.py ``WorkerPool.fits``), so the workers still hold the copy pickled at the
    first run (tau = 1) and the second run returns exactly the first run's θ — not the θ the
    sequential backend (or a fresh pool) gives for tau = 5. Every backend must give the same
    θ (docs: "all give the same θ"). Expected: the second run equals the sequential one, or
    the reuse is refused with one line."""
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.server import SGD

    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=2, n=20, d_theta=3, d_w=2, seed=0))
    alg = FFGG(make_solver("cg", tau=1), SGD(lr=1 / p.L))
    with ProcessBackend(1) as pb:
        run_rounds(p, alg, 1, clients_per_round=2, seed=0, backend=pb)
        alg.solver = make_solver("cg", tau=5)
        try:
            got = run_rounds(p, alg, 1, clients_per_round=2, seed=0, backend=pb)
        except ValueError as e:  # a one-line refusal is fine too
            assert "\n" not in str(e)
            return
    want = run_rounds(p, alg, 1, clients_per_round=2, seed=0)
    np.testing.assert_allclose(got.state.theta["theta"], want.state.theta["theta"],
                               rtol=1e-12, atol=1e-12)


# -- area 3 on Flower: an honest node's failure lowers f below the planned one -----------------
def _hostile_and_crashed(partition, mtype, content):
    from flwr.app import Array

    if mtype != "train":
        return
    if partition == 0:  # hostile: two of its rows (2 of the 8 clients: the fraction δ) huge
        a = content["vectors"]["theta"].numpy().copy()
        a[:2] = 1e30
        content["vectors"]["theta"] = Array(a)
    if partition == 1:  # honest, but its reply is broken (a crash): a counted failure
        del content["vectors"]


@pytest.mark.parametrize("rule", ["tm", "mda", "meamed"])
def test_an_honest_nodes_failure_never_lets_a_hostile_node_within_delta_through(loopback, rule):
    """3 SuperNodes, all 8 clients per round, ``aggregation = {name = rule, delta = 0.25}``:
    the planned cohort tolerates f = ⌊0.25·8⌋ = 2 Byzantine rows, and partition 0 (hostile)
    sends 2 rows of 1e30 — within δ; alone it is tolerated (θ ≈ 0.85 as clean). When the
    honest partition 1 (3 clients) fails the same round, the server aggregates the k = 5 rows
    left with f = ⌊1.25⌋ = 1, and the two huge rows pass: |θ| = 7e28 (tm), 1e29 (MDA),
    5e28 (Meamed). Round 16 fixed this inside ``ByzantineRobust._protection`` (the planned f
    under ``cohort_checked``), but the Flower ServerApp aggregates with the plain rule and
    :func:`partialfl.runtime.sync._step` skips a step only when the rule *refuses* (f = 0).
    Expected: the round's step skipped (θ kept) or the planned f kept — θ stays bounded."""
    from _flower_sims import ls_run

    from partialfl.flower.server import run_server

    run = ls_run(3, 8, eval_every=0, spec={"aggregation": {"name": rule, "delta": 0.25},
                                           "max_failure_fraction": 0.9})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_server(loopback(3, tamper=_hostile_and_crashed), run)
    assert {f.partition for f in report.failures} == {1}
    assert np.abs(report.theta["theta"]).max() < 1e3
