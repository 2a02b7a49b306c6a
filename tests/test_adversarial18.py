"""Adversarial round 18 (issue 21, tried again from scratch): regression tests of what broke.

Each test failed on the code it was written against (checked with ``--runxfail``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest


# -- area 3 on Flower's asynchronous jobs: one hostile client fills more than δ of a buffer ----
def _client0_huge(partition, mtype, content):
    from flwr.app import Array

    if mtype != "train" or "vectors" not in content.keys():
        return
    cohort = list(content["update"]["cohort"])
    if 0 in cohort:  # the one hostile client of the 8: every update it sends is 1e30
        a = content["vectors"]["theta"].numpy().copy()
        a[cohort.index(0)] = 1e30
        content["vectors"]["theta"] = Array(a)


def test_one_hostile_client_within_delta_never_moves_theta_under_fedbuff(loopback):
    """2 SuperNodes, 8 clients, ``[asynchronous] rule = {name = "fedbuff", buffer = 4}``,
    concurrency 1, ``[aggregation] name = "tm", delta = 0.25``: the trimmed mean tolerates
    f = ⌊0.25·4⌋ = 1 Byzantine update per step. Only client 0 is hostile (1 of 8 clients,
    fraction 0.125 < δ), sending 1e30 in every update. Jobs go to idle clients, so the same
    client can fill several slots of one buffer: the first buffer held jobs of clients
    [2, 0, 3, 0] — two 1e30 rows among 4, one survives the trim — and θ reached ~2.6e27 in
    40 applied updates, with no failure, warning or refusal (the docs: "a robust aggregation
    rule is checked at the updates one step aggregates", which counts rows, not clients).
    The synchronous rounds never give a client two rows. Expected: θ stays bounded (one
    update per client per buffer, f counted over distinct clients, or a refusal)."""
    from _flower_sims import ls_run

    from partialfl.flower.server import run_server

    run = ls_run(40, eval_every=0, spec={
        "aggregation": {"name": "tm", "delta": 0.25},
        "asynchronous": {"rule": {"name": "fedbuff", "buffer": 4}, "concurrency": 1},
        "personalize": {"server": {"lr": 0.05}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            report = run_server(loopback(2, tamper=_client0_huge), run)
        except (RuntimeError, ValueError) as e:  # a one-line refusal is fine too
            assert "\n" not in str(e)
            return
    assert np.abs(report.theta["theta"]).max() < 1e3


# -- area 8: evaluate follows a run's config.json / metrics.json linked from elsewhere ---------
@pytest.mark.parametrize("name", ["config.json", "metrics.json"])
def test_evaluate_refuses_a_run_file_linked_from_outside_the_run(tmp_path, user_module, capsys,
                                                                 name):
    """Issue 21 (8): a symlinked ``deploy.safetensors`` made ``evaluate`` score a run outside
    the folder; the fix (:func:`partialfl.pipeline.runs.confined`: "refuse a file a command
    reads from a run folder (the deployed model, metrics, logs) … that is a symbolic link")
    is applied by ``report`` and ``compare`` to ``metrics.json`` (adv13), but ``evaluate``
    confines only the deploy file: :func:`partialfl.pipeline.evaluation.evaluate_run` then
    reads ``config.json`` (the architecture, split, fine-tuning settings, seed) and
    ``metrics.json`` (``finetune_choice``: the epochs and lr of stage 3) with
    ``pio.read_json``, which follows links — so the scores come from settings outside the
    run, exit 0. Expected: exit 2 with one line naming the symbolic link."""
    from _user_project import client_folder, tiny_toml

    from partialfl.cli import main

    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--no-progress"]) == 0
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((run / name).read_bytes())
    (run / name).unlink()
    (run / name).symlink_to(outside)
    capsys.readouterr()
    rc = main(["evaluate", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "symbolic link" in err, (rc, err)


# -- area 3: multi-Krum with the number of averaged rows m given ------------------------------
class _Send:
    """Every Byzantine client sends 1e30 (finite)."""

    def __call__(self, honest, own, rng):
        return np.full_like(own, 1e30)


def _br_multi_krum(m, fail=()):
    """BR-FFGG, 10 clients all per round, ``multi-krum`` δ = 0.1 (f = 1) averaging ``m`` rows,
    client 0 Byzantine (fraction 0.1 = δ), the clients ``fail`` raising every round."""
    from partialfl.algorithms.byzantine import ByzantineConfig, br_ffgg
    from partialfl.build import make_aggregator, make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.runtime.faults import FaultInjector

    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=10, n=40, d_theta=3, d_w=2, seed=0))
    alg = br_ffgg(make_solver("exact"), 1 / p.L, make_aggregator("multi-krum", delta=0.1, m=m),
                  ByzantineConfig((0,), _Send()), clients_per_round=10)
    alg = FaultInjector(alg, at={(r, c): "raise" for r in range(3) for c in fail})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_rounds(p, alg, 3, clients_per_round=10, seed=0)


def test_multi_krum_averaging_more_than_k_minus_f_rows_is_refused():
    """``[aggregation] name = "multi-krum", delta = 0.1, m = 10`` with 10 clients per round:
    f = ⌊0.1·10⌋ = 1, and averaging m = 10 > k − f = 9 rows takes every row, the attacker's
    too — multi-Krum's guarantee needs m ≤ k − f. One Byzantine client (fraction 0.1 = δ,
    which ``check_fraction`` and ``tolerated`` accept) moved θ to ~2e28 with no refusal or
    warning (m = 9 keeps θ at 0.8). Expected: refused with one line (the rule's own bound,
    as k ≥ 2f + 3 is), or θ bounded."""
    from partialfl.aggregation.protection import UnprotectedError

    try:
        res = _br_multi_krum(10)
    except (UnprotectedError, ValueError) as e:
        assert "\n" not in str(e)
        return
    assert np.abs(res.state.theta["theta"]).max() < 1e3


def test_honest_failures_never_make_multi_krum_average_the_attacker():
    """Same run with m = 8 (≤ k − f = 9: protected; θ stays 0.8 without failures). Two honest
    clients fail every round: 8 rows are left, the planned f = 1 is kept
    (:func:`~partialfl.aggregation.protection.cohort_checked`), and m = 8 > k − f = 7
    averages every row left, the attacker's included: θ reached ~2.7e28. The round-16/17
    fixes keep f, but nothing checks m against k − f. Expected: the round's step skipped
    (θ kept, counted) or θ bounded."""
    res = _br_multi_krum(8, fail=(1, 2))
    assert np.abs(res.state.theta["theta"]).max() < 1e3


def test_honest_failures_below_multi_krums_m_never_stop_the_run():
    """Same run with m = 8 and three honest clients failing every round: k = 7 < m and
    ``Krum.__call__`` raises ``ValueError: krum: cannot average m=8 of only k=7 inputs``,
    which :func:`partialfl.runtime.sync._step` does not catch (it skips the step only for an
    :class:`UnprotectedError`), so three failing clients stop the run
    (docs: "a failing client is never fatal"; the run's ``max_failure_fraction`` is 0.5).
    Expected: the round's step skipped (θ kept, counted), the run finishes."""
    res = _br_multi_krum(8, fail=(1, 2, 3))
    assert np.abs(res.state.theta["theta"]).max() < 1e3
