"""Adversarial round 51a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes, against 7c8db5d: round 50a's failure-fraction judgement on Flower).
Each test failed on that code because of the defect it names, and passes since the fix: a run
is stalled only while no client that has not failed (in the current run of failures) is
still computing (the Flower transport's streak stop, and ``check_stalled`` of every
asynchronous loop through ``AsyncServer.failed_clients``; since round 55a, whose resumed
run showed that a horizon of job ids was not enough).

* Area 2, one fast-failing SuperNode still ends an asynchronous run alone, through the paths
  round 50a kept judging "whatever the count": with ``concurrency`` close to the number of
  clients the idle clients a freed slot can draw are the failing node's own (the honest
  nodes' clients are in flight, computing), so a node that answers every train message at
  once with a refused reply (NaN weights) is asked again and again and its failures are all
  the server sees until the honest replies arrive (0.2 s here; seconds for a real model):

  - ``concurrency = 6`` (8 clients, 3 SuperNodes holding 0–2 / 3–5 / 6–7), even with
    ``max_failure_fraction = 1`` (every loss tolerated): after ``max(10, 3 × 6) = 18``
    consecutive failures — all partition 0's, all within the first 0.2 s — the run "stops
    early" (``report.stopped = "18 consecutive client tasks failed ..."``) with 0 server
    steps, although 6 honest tasks are in flight and would succeed
    (:meth:`partialfl.flower.jobs.FlowerJobs.next`: the streak counts failures in arrival
    order, which the failing node controls). With the default fraction 0.5 the same run
    aborts: ``RunAborted: 18 of 18 requested client updates failed``.
  - ``concurrency = 8 = M`` with ``max_failure_fraction = 1``: after 20 failures and no
    success yet, the simulator loop's :func:`partialfl.runtime.faults.check_stalled` raises
    ``ClientFaultError: none of the 20 client computations succeeded ... θ never moved``
    out of :func:`partialfl.flower.server.run_server` (not even a ``RunAborted``: no
    ``result.json``), while 5 honest tasks are in flight.

  The honest federation (same timing, same configs) finishes its 12 server steps in both
  cases. Suspected root cause: ``FlowerJobs.next`` (the streak stop) and ``check_stalled``
  in :func:`partialfl.runtime.asynchronous.loop.drive` treat failures as a stall while
  tasks that have not failed are still in flight; a stall is "nothing in flight can
  succeed", not "the last N arrivals failed".

Tried and held (run unless marked "read"): the same hostile node with ``concurrency`` 2, 3
(delay 0.2 s and 1 s) and 4 — the run finishes its 12 steps, only partition 0's failures
counted, no abort; (read) SecAgg+'s refused key-share replies counted without clients (the
node's update is in the aggregate) and the workflow's failure path (every node's clients
counted once); evaluation failures carry no clients (they never inflate
``failed_client_updates``); the ``"end"`` judgement (only when none succeeded and the
fraction is below 1, as :func:`partialfl.runtime.faults.check_end`); a synchronous run
with fewer than 20 requested updates and most of them lost finishes (as in process: judged
after ``min_attempts``); area 5, a hostile server against an honest node — (read) the
``extra.*`` task values a node reads (only DP's adaptive clip norm, which needs central DP:
the server sees the clipped updates anyway), θ's leaves checked by name, dtype and shape
before any computation, the task's client ids checked against the node's own.
"""

from __future__ import annotations

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402
from test_adversarial50a import _nan_weights, _run, _Timed  # noqa: E402


def _async(concurrency: int, fraction: float) -> dict:
    spec = {"asynchronous": {"rule": "fedasync", "concurrency": concurrency},
            "personalize": {"server": {"lr": 0.05}}, "max_failure_fraction": fraction}
    return ls_run(12, spec=spec, node_wait_timeout=5, round_timeout=5, poll_interval=0.01)


@pytest.mark.parametrize("concurrency", [6, 8])
def test_control_an_honest_federation_with_high_concurrency_finishes(loopback,  # noqa: F811
                                                                     concurrency):
    rep = _run(_Timed(3), _async(concurrency, 1.0))
    assert rep.server_steps == 12 and not rep.failures and not rep.stopped


def test_a_fast_failing_node_does_not_stop_a_tolerant_async_run(loopback):  # noqa: F811
    """Found: ``stopped = "18 consecutive client tasks failed (last: invalid: reply weight
    must be finite, got nan)"``, 0 server steps, with max_failure_fraction = 1 (every loss
    tolerated) and 6 honest tasks in flight. Expected: the run finishes its 12 steps,
    partition 0's failures counted."""
    rep = _run(_Timed(3, tamper=_nan_weights), _async(6, 1.0))
    assert rep.server_steps == 12, (rep.server_steps, rep.stopped)
    assert {f.partition for f in rep.failures} == {0}


def test_a_fast_failing_node_does_not_end_an_async_run_with_concurrency_m(loopback):  # noqa: F811
    """Found: ``ClientFaultError: none of the 20 client computations succeeded (20 raised,
    ...): θ never moved`` out of ``run_server``, with max_failure_fraction = 1 and 5 honest
    tasks in flight. Expected: the run finishes its 12 steps."""
    from partialfl.runtime.faults import ClientFaultError

    try:
        rep = _run(_Timed(3, tamper=_nan_weights), _async(8, 1.0))
    except ClientFaultError as e:
        pytest.fail(f"one node's fast failures ended the run: {e}")
    assert rep.server_steps == 12, (rep.server_steps, rep.stopped)
    assert {f.partition for f in rep.failures} == {0}
