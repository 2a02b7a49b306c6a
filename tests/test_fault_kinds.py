"""``partialfl reproduce faults``: issue 21's fault kinds, each with the outcome it must have
(:mod:`partialfl.reproductions.fault_kinds`) — a closed worker pool (skipped and counted,
never reused), a hostile SuperNode (refused and counted), a kill between checkpoint files
(resumable)."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - a federation in one process, no Ray
from _flower_sims import ls_run

from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.reproductions import fault_kinds


@pytest.mark.timeout(120)
def test_a_closed_pool_is_replaced_and_failed_clients_are_skipped_and_counted():
    p = LeastSquaresProblem(LeastSquaresSpec(12, 200, 8, 4, seed=0))
    row = fault_kinds.closed_pool(p, 8, seed=0)
    assert row["ok"], row
    assert row["ref_diff"] == 0.0 and "3 pools started" in row["observed"]
    assert "pool closed before rounds [2, 4]" in row["injected"]


def test_the_closing_backend_closes_before_the_rounds_asked_only():
    from partialfl.algorithms import FFGG
    from partialfl.build import make_solver
    from partialfl.runtime import run_rounds
    from partialfl.server import SGD

    p = LeastSquaresProblem(LeastSquaresSpec(6, 100, 4, 2, seed=1))
    alg = FFGG(make_solver("cg", 5), SGD(1.0 / p.L))
    with fault_kinds.ClosingPool((1,), workers=1) as be:
        res = run_rounds(p, alg, 3, seed=1, backend=be)
        assert be.closed == [1] and be.pools == 2 and not be._pool.closed
    ref = run_rounds(p, FFGG(make_solver("cg", 5), SGD(1.0 / p.L)), 3, seed=1)
    np.testing.assert_array_equal(res.state.theta["theta"], ref.state.theta["theta"])


@pytest.mark.parametrize("kind", sorted(fault_kinds.HOSTILE))
def test_a_hostile_node_is_refused_counted_and_equals_a_crashed_node(loopback,  # noqa: F811
                                                                    kind):
    """The study's run configs on an in-process federation: every bad reply refused
    ('invalid'), θ float64 and bit-identical to the run where node 1 crashed instead."""
    from partialfl.flower.server import run_server

    base = ls_run(9, spec={"max_failure_fraction": 0.6})
    configs = fault_kinds.hostile_runs(base, rounds=4)
    assert [c["fault-injection"].split(":")[0] for c in configs] == ["crash", "dtype", "extra"]
    assert all(c["spec"]["personalize"]["rounds"] == 4 for c in configs)
    reports = {k: run_server(loopback(2), c) for k, c in zip(("crash", "dtype", "extra"),
                                                             configs)}
    (row,) = fault_kinds.hostile_rows({"crash": reports["crash"], kind: reports[kind]}, 0.0,
                                      seed=3)
    assert row["ok"], row
    assert row["kind"] == f"hostile SuperNode ({kind})" and "3 replies refused" in row["observed"]
    assert "12 updates lost" in row["observed"]
    # a run without the hostile node differs from the crashed-node run: the check has teeth
    clean = run_server(loopback(2), {**configs[0], "fault-injection": ""})
    assert not fault_kinds.hostile_rows({"crash": reports["crash"], kind: clean}, 0.0, 3)[0]["ok"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_kill_between_checkpoint_files_resumes_bit_identically(tmp_path):
    size = {"clients": 8, "n": 100, "d_theta": 6, "d_w": 3, "rounds": 4, "seed": 0}
    rows = fault_kinds.checkpoint_kill(size, tmp_path)
    assert [r["ok"] for r in rows] == [True, True], rows
    assert "after the client-side file" in rows[0]["kind"]
    assert "run.g3.client-side.ckpt" in rows[0]["injected"]  # killed between the files
    assert "run.g3.server.ckpt" not in rows[0]["injected"]
    assert "(exit -9)" in rows[1]["injected"] and "run.g3.server.ckpt" in rows[1]["injected"]


def test_the_section_says_no_when_a_kind_failed():
    ok = fault_kinds._row("a", "w", "i", "e", "o", True, 0.0)
    bad = fault_kinds._row("b", "w", "i", "e", "o", False, 0.0)
    assert fault_kinds.section([]) == []
    text = "\n".join(fault_kinds.section([ok, bad]))
    assert "| b | w | i | e | o | NO |" in text and "expected outcome: NO." in text
    assert "expected outcome: yes." in "\n".join(fault_kinds.section([ok]))
