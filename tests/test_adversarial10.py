"""Adversarial round 10 (issue 21): regression tests for what the tenth independent round found
(a reviewer who did not write the fixes) — a client's negative weight ending a robust run,
and ``partialfl advise --table`` reading a received measurement unchecked."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from partialfl.algorithms import FedAlt
from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.local import GDConfig
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds


class Weighted(AlgorithmWrapper):
    """Client ``target`` reports the weight ``w`` (a hostile or buggy client)."""

    def __init__(self, base, w: float, target: int) -> None:
        super().__init__(base)
        self.w, self.target, self.name = w, target, base.name

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        wts = np.array(res.updates.weights, dtype=np.float64, copy=True)
        wts[np.asarray(cohort) == self.target] = self.w
        return ClientResult(replace(res.updates, weights=wts), res.client_state)


def _problem():
    return LeastSquaresProblem(LeastSquaresSpec(num_clients=8, n=40, d_theta=3, d_w=2, seed=0))


def _run(agg, w=None, target=3):
    from partialfl.runtime.faults import FaultInjector

    base = FedAlt(GDConfig(2, 0.05), w_init="zero", aggregator=agg)
    alg = (FaultInjector(base, at={(r, target): "raise" for r in range(3)}) if w is None
           else Weighted(base, w, target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_rounds(_problem(), alg, 3, clients_per_round=8, seed=0)


@pytest.mark.parametrize("rule", ["tm", "krum", "gm-weighted", "mean-weighted"])
@pytest.mark.parametrize("w", [-1.0, -1e-300])
def test_a_negative_client_weight_is_one_counted_refusal(rule, w):
    """A client's weight was checked to be finite only: one client sending −1 (or −1e-300)
    ended the run with the robust rule's ValueError ('weights must be finite, non-negative')
    — also under trimmed mean or Krum, which ignore weights — and the weighted mean skipped
    it with a warning about NaN/inf, uncounted. A weight counts examples: now a negative one
    is that client's refused message (``updates_refused``), and the run equals the one in
    which that client raises."""
    from partialfl.aggregation import Mean
    from partialfl.build import make_aggregator

    agg = {"tm": lambda: make_aggregator("tm", delta=0.125),
           "krum": lambda: make_aggregator("krum", delta=0.125),
           "gm-weighted": lambda: make_aggregator("gm", weighted=True),
           "mean-weighted": lambda: Mean(weighted=True)}[rule]()
    res = _run(agg, w)
    ref = _run(agg)
    assert (res.faults.refused, res.faults.lost) == (3, 3)
    np.testing.assert_array_equal(res.state.theta["theta"], ref.state.theta["theta"])
