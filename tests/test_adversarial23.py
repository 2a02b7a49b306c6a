"""Adversarial round 23 (issue 21, tried again from scratch): defects still present.

Each test fails on the current code because of the defect it names (hence ``xfail(strict)``)
and passes once the defect is fixed."""

from __future__ import annotations

import numpy as np


# -- area 1: a process pool reused by a direct cohort call runs a stale copy of the problem --
def test_a_direct_cohort_call_on_a_reused_process_pool_sees_the_changed_problem():
    """``ProcessBackend(1).run(alg, state, problem, cohort, ctx)`` (the public
    ``CohortRunner.run``) called twice on the same problem object, changed in place in between
    (``p.p *= 2; p.q *= 2``), returns the first call's update again (client 0:
    [-2.050, -1.811, -2.649]) where the sequential and threads backends return the changed
    problem's [-4.100, -3.621, -5.299]. Root cause: runtime/cohort_pool.py
    ``ProcessBackend._pool_for`` compares the problem's content digest only after
    :meth:`new_run`, which only ``runtime/sync.py`` (``run_rounds``) calls; a direct call
    reuses the pool by identity (``WorkerPool.fits``). Expected: the sequential backend's
    update, or a one-line refusal."""
    from partialfl.algorithms.base import RoundContext
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime.backends import SequentialBackend
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.server import SGD

    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=2, n=20, d_theta=3, d_w=2, seed=0))
    alg = FFGG(make_solver("cg", tau=3), SGD(lr=1 / p.L))
    state, ctx, cohort = alg.init(p, p.init_theta()), RoundContext(0, 0), np.arange(2)
    with ProcessBackend(1) as pb:
        pb.run(alg, state, p, cohort, ctx)
        p.p *= 2.0
        p.q *= 2.0
        try:
            got = pb.run(alg, state, p, cohort, ctx)
        except ValueError as e:
            assert "\n" not in str(e)
            return
    want = SequentialBackend().run(alg, state, p, cohort, ctx)
    for n, v in want.updates.vectors.items():
        np.testing.assert_allclose(np.asarray(got.updates.vectors[n]), np.asarray(v),
                                   rtol=1e-12, atol=1e-12)
