"""Adversarial round 41a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes). The test failed on the code it was written against (adv41a at
a148fc1) because of the defect it names, and passes since the fix: ``FlowerJobs.send`` counts
a train message the SuperLink did not store (empty message id) as a failure of that node at
once, as the synchronous transport does.

* Area 2, the asynchronous Flower transport and a SuperNode that leaves: a SuperLink stores
  no message for a destination node that is no longer registered (a SuperNode unregistered
  through the Fleet API's ``UnregisterNode`` — any node may call it for itself when SuperNode
  authentication is off, and Flower's own client does on exit — or by its owner's
  ``flwr supernode unregister``): its ``PushMessages`` answers ``""`` for that message, and
  :meth:`partialfl.flower.federation.Link.push` hands the ServerApp ``""`` as its id. The
  synchronous transport expects that (``Link.exchange`` waits only for non-empty ids; the
  node's part of the round is a counted ``timeout``). The asynchronous one does not:
  :meth:`partialfl.flower.jobs.FlowerJobs.send` files every task under its id in
  ``self.inflight`` — so a second task sent to the gone node while the first is still
  pending *replaces* it under the key ``""``. The replaced task never produces an event: it
  is neither applied nor counted as a failure (``requested_client_updates`` and the report
  miss it), its client stays "busy" for the rest of the run, and its slot of
  ``[asynchronous] concurrency`` is never relaunched. Each collision costs one slot for
  good, so one node that leaves collapses the run to concurrency 1 without a word (seen:
  concurrency 4, 8 clients on 2 nodes, node 1 gone after it described itself — from the
  fifth server step on every update has staleness 0, against 3 in the same run with node 1
  present; 3 of the 4 tasks sent to node 1 vanished, 1 was counted). With a deployment's
  ``round-timeout`` (minutes), every later task sent to the gone node then holds the only
  slot left for the whole timeout: the run all but stops. Suspected root cause:
  ``FlowerJobs.send`` / ``next`` key in-flight tasks by message id without handling an
  empty id (a push the SuperLink refused) — such a task should be a counted failure of its
  node at once (or after ``round-timeout``), like the synchronous transport's.

Tried and held (not tested here): area 2 — the synchronous transport and evaluation with the
same gone node (ids ``""`` excluded, counted as ``timeout`` / ``eval-timeout``); the same
with concurrency 1 and 2 (slots lost without a hang: the last slot's task times out and is
counted); two clients of one node reporting finite train losses of 1.7e308 (the node's
``train_loss.sum`` overflows, the server refuses the reply as not finite: the node's
cohort is lost, no more than one raising client already costs it — node granularity);
DP with an asynchronous rule (refused by the spec); SecAgg+'s ``_LinkGrid`` with an empty
id (a dropout). Area 5 (read) — what a node sends after ``screened``: weights above
``max(1, n_m)`` on the plain path reach the server (refused there, quoted with ``%g``) but
an in-bound weight already is one free float; the count of non-finite updates in the
node's refusal (``refuse_non_finite``: log2(k+1) bits, no more than a raising client's
bit per message); local-DP noise seeds (``SeedSequence([key, purpose, round, client])``:
no two (round, client) pairs of one key collide, replays get a fresh key through
``_ANSWERED`` / the ledger); ``arrays.plain`` detaches tensors (no autograd graph back to
w reaches the server). Area 6 (read) — ``check_code`` and the build's ``allow_code(False)``
both see the spec with ``set`` applied; the only imports a spec can name are
``model.name`` with ``:`` and ``plugins``.
"""

from __future__ import annotations

import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import LoopbackGrid, loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


class _GoneGrid(LoopbackGrid):
    """Partition 1's SuperNode (node 1001) unregisters right after it described itself: the
    SuperLink then stores no message for it and ``push_messages`` answers ``""`` for each,
    in order, as Flower's deployment grid does (``PushAppMessagesResponse.message_ids``)."""

    def push_messages(self, messages):
        out = []
        for m in messages:
            if m.metadata.dst_node_id == 1001 and m.metadata.message_type != "query.describe":
                out.append("")
                continue
            out.extend(super().push_messages([m]))
        return out


def _staleness(grid_class, out) -> list[int]:
    """Per server step, the staleness of the update it applied: FedAsync with 4 tasks in
    flight on least squares (8 clients, 2 loopback SuperNodes), 20 server steps."""
    from partialfl.flower.server import run_server

    spec = {"personalize": {"server": {"lr": 0.05}}, "max_failure_fraction": 0.9,
            "asynchronous": {"rule": "fedasync", "concurrency": 4}}
    run = ls_run(20, 2, spec=spec)
    run.update({"node-wait-timeout": 2.0, "round-timeout": 0.3, "out-dir": str(out)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_server(grid_class(2), run)
    return [int(r["max_staleness"]) for r in report.history if "max_staleness" in r]


def test_a_node_that_leaves_does_not_collapse_an_async_runs_concurrency(
        loopback, tmp_path):  # noqa: F811
    """Found: with node 1 gone, every server step from the fifth on applies an update of
    staleness 0 (one task in flight), where the same run with node 1 present keeps 4 in
    flight (staleness 3). Expected: the tasks sent to the gone node fail (counted) and their
    slots go on training on node 0's clients, so later updates are still applied while
    other tasks are in flight (staleness >= 1)."""
    healthy = _staleness(LoopbackGrid, tmp_path / "healthy")
    assert max(healthy[10:]) >= 1  # the scenario: 4 tasks in flight without the gone node
    gone = _staleness(_GoneGrid, tmp_path / "gone")
    assert max(gone[10:]) >= 1, (f"staleness per server step {gone}: one task in flight "
                                 "after the SuperNode left")
