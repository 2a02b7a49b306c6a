"""Adversarial round 46a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes). Each test failed on the code it was written against (r46a at
cac5ff1) because of the defect it names, and passes since the fix: discovery settles nothing
while a connected node's description is awaited (before node-wait-timeout), nor on one group
that does not fit the spec before the deadline.

Round 28a found that a SuperNode describing a federation of its own that is complete alone
(``partition 0 of 1``) took the run over when it connected before the honest nodes; the fix
(:func:`partialfl.flower.federation._settled`) prefers the complete group that fits the
server's spec with the most nodes, and waits while a fitting group could still grow. This
round tried a new *interleaving*: every node connected at once and asked at once, the
stranger's describe reply arriving before the honest ones (a hostile node answers at once;
an honest ClientApp builds its data and model on its first message, which takes seconds).

* Area 2, a stranger whose reply arrives first takes the run over: ``_settled`` returns
  ``bool(complete)`` as soon as the described nodes hold *one* key (``len(keys) < 2``),
  whatever the describe queries still pending and whatever the server's spec fixes
  (``expect``). Seen: least squares (8 clients), ``min-nodes = 3``, honest partitions 0 and
  1 of 2 answering 0.5 s after the query, a node describing ``partition 0 of 1`` of the same
  8 clients answering at once: the run trains on the stranger alone (``nodes`` =
  ``[(1002, 0, 1)]``, every ``train`` message to 1002), the two honest nodes — connected,
  asked, answering well within ``node-wait-timeout`` = 5 s — neither used nor counted
  (``failures`` = ``[]``). Suspected root cause: ``federation._settled`` (the
  ``len(keys) < 2`` shortcut settles while describe queries are pending, and before
  ``fits`` is checked); ``federation.describe`` calls it with ``final`` false but does not
  tell it that nodes are still to answer.
* Area 2, the same with a stranger of another size stops the ServerApp: a ``partition 0 of
  1`` of a *4*-client federation (well-formed) answering first settles the federation on the
  shortcut above (``expect`` = 8 clients is never compared), and ``stage.server_parts``
  raises ``ConfigError: the SuperNodes hold 4 clients, the spec's problem has 8`` — one node
  stops the ServerApp before round 1 although the honest federation, which the server's own
  spec names, answers 0.5 s later. Same root cause.

Tried and held (not tested here; run unless marked "read"): area 2 — the same stranger when
every reply arrives in the same poll (two keys: the two-node group wins, the stranger is a
``describe-invalid``); (read) a train reply answered by another node than the one asked (the
SuperLink's ``store_message_res`` refuses a reply whose ``src_node_id`` is not the
instruction's ``dst_node_id``); (read) the shapes a node declares in a Flower ``Array``
(``Array.numpy`` is ``np.load`` of the bytes sent: the declared shape sizes nothing); (read)
SecAgg+ replies: destinations, share owners and masked-vector shapes bounded by the request
(``check_reply``); extra metric names in a SecAgg+ FitRes are checked finite and never read,
logged or stored; a share that does not combine fails the round, not the ServerApp
(semi-honest, known); (read) ``num-examples`` on the server: the weight bound, SecAgg+'s
``max_weight`` (declared data, known) and a round record's ``examples`` only — no loop, array
or file sized by it; (read) the asynchronous transport: a late reply of a timed-out task is
never pulled, each reply is checked against its own task's client and θ; (read) a
``grad-evals`` or metric count a node sends (bounded by 2^53 / by k). Area 5 — (read) the
node's evaluation covers all its clients at the θ sent, the server picks no subset; a
one-client cohort's train loss (known). Area 6 — (read) the run config a message carries is
checked for code (``node.check_code``) before anything is parsed or built; its
``fault-injection`` can only make the node raise or sleep (the server's own run).
"""

from __future__ import annotations

import time
import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import LoopbackGrid, loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402

STRANGER = 1002


class _SlowHonestGrid(LoopbackGrid):
    """Honest partitions 0 and 1 of 2 (nodes 1000, 1001: the spec's 8 clients), whose
    describe replies arrive ``delay`` seconds after the query (a ClientApp starting), and a
    stranger (node 1002) describing ``partition 0 of 1`` of ``clients`` clients, answering at
    once. Every node is connected from the start."""

    def __init__(self, clients: int = 8, delay: float = 0.5) -> None:
        from flwr.app import ConfigRecord, Context, RecordDict

        def tamper(partition, mtype, content):
            if mtype == "query.describe" and content["info"]["num-partitions"] == 1 and \
                    clients != 8:
                content["info"] = ConfigRecord({
                    "partition-id": 0, "num-partitions": 1, "num-clients": clients,
                    "clients": list(range(clients)), "num-examples": [200.0] * clients,
                    "eval-units": [0.0, 0.0], "torch": 0})

        super().__init__(2, tamper=tamper)
        self.contexts[STRANGER] = Context(1, STRANGER, {"partition-id": 0,
                                                        "num-partitions": 1},
                                          RecordDict(), {})
        self.delay, self.t0, self.held = delay, None, {}

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for m, mid in zip(messages, ids):
            if m.metadata.message_type == "query.describe" and \
                    m.metadata.dst_node_id != STRANGER:
                self.t0 = self.t0 or time.monotonic()
                self.held[mid] = self.replies.pop(mid)
        return ids

    def pull_messages(self, ids):
        if self.t0 is not None and time.monotonic() - self.t0 > self.delay:
            self.replies.update(self.held)
            self.held.clear()
        return super().pull_messages(ids)


def _run(grid):
    from partialfl.flower.server import run_server

    run = ls_run(2, min_nodes=3, node_wait_timeout=5, round_timeout=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_server(grid, run)


def _honest(rep, grid) -> None:
    held = sorted((n["partition-id"], n["num-partitions"]) for n in rep.nodes)
    trained = {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert held == [(0, 2), (1, 2)], f"the run's federation is {held}, trained on {trained}"
    assert trained == {1000, 1001} and rep.server_steps == 2
    assert [f.kind for f in rep.failures] == ["describe-invalid"]


def test_a_stranger_answering_first_never_takes_the_run_over(loopback):  # noqa: F811
    """Found: ``nodes`` = [(1002, partition 0 of 1)], every train message to the stranger, no
    failure counted; the honest nodes (asked, answering after 0.5 s of a 5 s wait) are never
    used. Expected: the two-node federation trains, the stranger a ``describe-invalid``."""
    grid = _SlowHonestGrid(8)
    _honest(_run(grid), grid)


def test_a_misfit_stranger_answering_first_never_stops_the_server(loopback):  # noqa: F811
    """Found: ``ConfigError: the SuperNodes hold 4 clients, the spec's problem has 8`` before
    round 1. Expected: the honest federation (8 clients, what the spec names) trains, the
    stranger a ``describe-invalid``."""
    grid = _SlowHonestGrid(4)
    _honest(_run(grid), grid)
