"""Adversarial round 59a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against 92a5afa: the code of round 58a's fixes —
:func:`partialfl.flower.jobs.run_async` counting the stage's ``rounds`` as applied updates
(FedBuff: ``rounds``/K server steps), ``checkpoint-every`` in server steps, and
``secagg_round``'s zero-weight skip —, Flower runs compared record by record with the
in-process run). Each test failed on that code because of the defect it names, and passes
since the fix: Flower's asynchronous run has the nodes evaluate where the in-process run
does — every ``eval_every`` applied updates, before the first and after the last — and
records the final state (a partial last buffer) as ``AsyncServer.result`` does in process.

* Area 2 (the ServerApp runs another run than the spec), a FedBuff run on Flower never
  evaluates its final θ: since round 58a the stage's ``rounds`` are applied updates
  (``cfg.rounds`` = R arrivals, R/K server steps), but the evaluation schedule
  :func:`partialfl.flower.evaluate.eval_due` still reads them as server steps —
  ``round_ in (0, cfg.rounds) or round_ % every == 0`` with ``round_`` the server step
  (``run_async``'s ``evaluate`` passes ``st.round``). Least squares (the paper's Example 1,
  FFGG, CG τ = 5), 3 loopback SuperNodes, ``concurrency = 1``, ``rounds = 6``, FedBuff
  K = 2: with the default ``eval_every = 0`` ("before the first round and after the
  last") the in-process run records ``loss_gap`` 24.709 then 0.7217 after its 3rd server
  step (the 6th applied update); on Flower the only evaluation is the one before the first
  step (server step 3 is not ``cfg.rounds`` = 6) — the run's result has no final metric at
  all. With ``eval_every = 2`` in process evaluates every 2 applied updates (after steps
  1, 2, 3: 5.120, 1.478, 0.7217), Flower every 2 server steps (step 2 only: 1.478; the
  final θ again never evaluated); K = 3, ``eval_every = 3``: in process 5.442, 1.473, on
  Flower nothing after step 0. FedAsync (K = 1) agrees. Suspected root cause:
  ``eval_due`` / ``run_async``'s ``evaluate`` (the cadence and the "after the last" test
  should count applied updates, ``server.arrivals``, as
  :class:`partialfl.runtime.asynchronous.server.AsyncServer` does in process).

* Area 2, the same runs record the work of a partial last buffer in process, not on
  Flower: with ``rounds`` not a multiple of K (``rounds = 5``, K = 2, ``eval_every = 1``)
  the in-process run's last record is that of the 5th applied update (``step`` 5,
  ``grad_evals`` 30: :meth:`AsyncServer.result` evaluates the final state when the last
  record is not of the last arrival), Flower's last record is that of server step 2
  (``local_grads`` 24): the 5th client's 6 local gradient evaluations, which the SuperNode
  spent and the server received, are in no record (``rounds = 7``, K = 3: 36 against 42).
  θ agrees exactly (the partial buffer is not applied, in both). Suspected root cause:
  ``run_async`` returns ``server.state`` without the final evaluation ``server.result``
  makes in process.

Tried and held (run unless marked "read"): FedBuff on Flower against in process (K = 2,
3; ``rounds`` 5, 6, 7; ``concurrency`` 1): θ bit-identical; FedBuff checkpointed every
server step and stopped after step 1 (``stop:round=0`` and ``stop:round=1``), resumed: θ,
the number of records and ``local_grads`` equal to the uninterrupted run's;
``checkpoint-every = 2`` stopped before its first checkpoint: the resume refused in one
line ("no checkpoint"); FedBuff with ``concurrency`` 2 and 3 (K = 2, 3; ``rounds`` 7, 8, 9;
``checkpoint-every`` 1, 2, 3), stopped and resumed: θ and ``local_grads`` equal to the
uninterrupted run's (observed, not filed: a resumed run's ``requested_client_updates``
also counts the replies that were pulled but not yet applied at the checkpoint and are sent
again, 12 against 9); round 58a's cold-start federation with ``weighting = "examples"``,
plain Flower against SecAgg+ record by record (12 server steps each, no failure,
``grad_evals`` equal; SecAgg+ records no ``train_loss``); (read) the SecAgg+ node reply
(metrics in Flower's ConfigRecord, which ``secaggplus_mod`` does not mask: counts and the
allowed aggregated sums only; the weight in clear is the known "one free float"); (read) a
hostile server's ``clients`` list in SecAgg+'s FitIns config (JSON, checked against the
node's own clients) and its shared numbers (only ``shared_extra`` names, int or float).
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import in_process, ls_run, quiet  # noqa: E402


def _fedbuff(loopback, rounds, k, eval_every):  # noqa: F811
    from partialfl.flower.server import run_server

    run = ls_run(rounds, None, eval_every=eval_every,
                 spec={"asynchronous": {"rule": {"name": "fedbuff", "buffer": k},
                                        "concurrency": 1}})
    _, ref = in_process(run)
    rep = quiet(run_server, loopback(3), run)
    assert not rep.failures
    for n in rep.theta:  # the same run (round 58a's fix)
        np.testing.assert_allclose(np.asarray(rep.theta[n]), np.asarray(ref.state.theta[n]),
                                   rtol=1e-9, atol=1e-12)
    return ref, rep


def test_control_fedasync_evaluates_its_final_theta_on_flower(loopback):  # noqa: F811
    ref, rep = _fedbuff(loopback, 6, 1, 0)
    assert rep.history[-1]["eval_loss_gap"] == pytest.approx(ref.history[-1]["loss_gap"])


@pytest.mark.parametrize("k,every", [(2, 0), (2, 2), (3, 3)])
def test_fedbuff_on_flower_evaluates_as_in_process(loopback, k, every):  # noqa: F811
    """Found (rounds = 6, K = 2, eval_every = 0): in process ``loss_gap`` 24.709 before the
    first step and 0.7217 after the last; on Flower only 24.709 (the last θ never
    evaluated). Expected: the in-process evaluations, at the same θ."""
    ref, rep = _fedbuff(loopback, 6, k, every)
    want = [round(h["loss_gap"], 9) for h in ref.history]
    got = [round(h["eval_loss_gap"], 9) for h in rep.history if "eval_loss_gap" in h]
    assert got == want


@pytest.mark.parametrize("rounds,k", [(5, 2), (7, 3)])
def test_fedbuff_partial_last_buffer_is_recorded_on_flower(loopback, rounds, k):  # noqa: F811
    """Found (rounds = 5, K = 2): in process the last record's ``grad_evals`` is 30 (5
    applied updates × 6), on Flower ``local_grads`` 24. Expected: the same count."""
    ref, rep = _fedbuff(loopback, rounds, k, 1)
    last = ref.history[-1]
    assert rep.history[-1]["local_grads"] == last.get("local_grads", last.get("grad_evals"))
