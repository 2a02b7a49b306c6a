"""Adversarial round 43a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes). Each test failed on the code it was written against (adv43a at
7247fea) because of the defect it names, and passes since the fix: ``describe`` asks a node
again when it is listed again under its id after going offline, and a node answering with an
error is left out like a silent one (discovery goes on until every partition is held or
node-wait-timeout passed).

Both are in the ServerApp's discovery of its federation,
:func:`partialfl.flower.federation.describe`, as rewritten in round 42a (answers collected
as they come; a node that leaves before the federation is settled gives its partition back).

* Area 2, a SuperNode back under its own node id loses its partition for good: in flwr 1.42
  a SuperNode keeps its node id when it goes offline and comes back (the SuperLink's
  ``deactivate_node`` / ``activate_node``: OFFLINE → ONLINE, the same id; a missed
  heartbeat, a network hiccup or a restart of the SuperNode process), and
  ``Grid.get_node_ids`` lists ONLINE nodes only. :func:`_forget_departed` drops a
  described node that one listing misses and opens its partition — but the node stays in
  ``asked``, so when it is listed again it is never asked to describe itself again, and it
  is not a "spare" either (:func:`_forget_departed` reinstates only spares). The partition
  stays open until ``node-wait-timeout`` and the run ends in ``RuntimeError: no SuperNode
  holds partition(s) [0] after …s; partitions present: [1]`` while the node of partition 0
  is registered, online and has described itself. (Before round 42a the same blip was
  harmless: the node kept its partition.) Seen: node 1000 (partition 0) describes itself,
  one listing misses it ("SuperNode 1000 left before the run started; partition 0 is open
  again"), then 1000 and 1001 are listed; only 1001 is asked. Suspected root cause:
  ``federation.describe`` / ``_forget_departed`` — a forgotten node is neither removed
  from ``asked`` nor reinstated from ``infos_of`` when it is listed again.
* Area 2, one SuperNode that answers the describe query with an error stops the ServerApp:
  the early exit "every node there raised (e.g. its data not found): waiting cannot help"
  (``not nodes and not pending and len(raised) >= cfg.min_nodes``) is taken on the nodes
  listed *so far*, without listing again. With ``min-nodes = 1`` (the default) a stranger
  (or hostile node) listed first whose ClientApp replies with an error ends the run at once
  in ``RuntimeError: no SuperNode answered the describe query (last refusal: …)`` — the
  honest nodes of both partitions, listed from the next poll on, are never asked. A node
  sending a *malformed* description instead is left out and discovery goes on (the same
  node, the same power: only the kind of reply differs); so does a silent one since round
  42a. ``raised`` also counts nodes that have left, so a node that re-registers under a
  new id counts twice towards ``min-nodes``. Suspected root cause: the early-exit
  condition in ``federation.describe`` (it should hold only when every *currently listed*
  node has raised, after listing again, or not at all before ``node-wait-timeout``).

Tried and held (not tested here; run unless marked "read"): area 2 — a node leaving and
coming back under a *new* id during discovery with a spare (42a's case: reinstated); a
stranger describing a larger fitting federation (the server waits to node-wait-timeout,
then takes the complete group: by design); θ⁰ of a departed partition-0 node (the first θ⁰
of the key is kept: a known non-defect); (read) a describe reply to another message id
(``Link.pull`` asks only for its own ids); (read) the asynchronous transport's empty ids
(counted since 41a). Area 5 (read) — a node with an integer ``dp-noise-key`` and no ledger
answering a replayed round in a new process with the same noise (documented: the ledger is
what gives replays in new processes fresh noise). Area 6 (read) — the node checks the
spec's code references (``code_refs`` of the decoded ``spec`` + ``set``) before
building, builds under ``allow_code(allow-imports)`` (the node's environment's
``PARTIALFL_ALLOW_CODE`` does not leak in), and ``import_callable`` checks again; the
registry imports only its own providers and the node's installed plugins.
"""

from __future__ import annotations

import uuid
import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import LoopbackGrid, loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


def _run(grid, out, **flower) -> str | None:
    """``run_server`` on ``grid`` (least squares, 8 clients on 2 partitions, 2 rounds of 2
    clients); returns the error it ended in, or None."""
    from partialfl.flower.server import run_server

    run = ls_run(2, 2)
    run.update({"out-dir": str(out), **flower})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_server(grid, run)
        except Exception as e:  # noqa: BLE001 - what the test reports
            return f"{type(e).__name__}: {e}"
    return None


def _asked(grid) -> list[int]:
    return [m.metadata.dst_node_id for m in grid.sent
            if m.metadata.message_type == "query.describe"]


class _BackUnderItsIdGrid(LoopbackGrid):
    """Node 1000 (partition 0) is listed and describes itself; the next listing misses it
    (OFFLINE for a moment); from then on it is listed again under the same id, with
    partition 1's node 1001."""

    def __init__(self) -> None:
        super().__init__(2)
        self.calls = 0

    def get_node_ids(self):
        self.calls += 1
        return {1: [1000], 2: []}.get(self.calls, [1000, 1001])


def test_a_node_back_online_under_its_id_serves_its_partition(loopback, tmp_path):  # noqa: F811
    """Found: "SuperNode 1000 left before the run started; partition 0 is open again", only
    1001 is asked afterwards, and the run ends in RuntimeError: no SuperNode holds
    partition(s) [0] after 3.0s; partitions present: [1]. Expected: node 1000, online
    again, serves partition 0 and the run trains."""
    grid = _BackUnderItsIdGrid()
    err = _run(grid, tmp_path / "out", **{"node-wait-timeout": 3.0, "round-timeout": 3.0})
    assert err is None, f"{err} (describe asked {_asked(grid)})"
    trained = {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert {1000, 1001} <= trained


class _RaisingFirstGrid(LoopbackGrid):
    """Node 9999 (a stranger) answers every message with an error; it is the only node at
    the first listing; the honest nodes 1000 and 1001 are listed from the next one on."""

    def __init__(self) -> None:
        super().__init__(2)
        self.calls = 0

    def get_node_ids(self):
        self.calls += 1
        return [9999] if self.calls == 1 else [1000, 1001, 9999]

    def push_messages(self, messages):
        from flwr.app import Error, Message

        ids = []
        for m in messages:
            if m.metadata.dst_node_id == 9999:
                mid = uuid.uuid4().hex
                m.metadata.__dict__["_message_id"] = mid
                self.sent.append(m)
                self.replies[mid] = Message(Error(0, "ValueError: not today"), reply_to=m)
                ids.append(mid)
            else:
                ids.extend(super().push_messages([m]))
        return ids


def test_one_raising_node_does_not_stop_discovery(loopback, tmp_path):  # noqa: F811
    """Found: RuntimeError: no SuperNode answered the describe query (last refusal:
    ValueError: not today) after one pass; nodes 1000 and 1001 are never asked.
    Expected: the stranger is left out, the honest nodes are asked and the run trains."""
    grid = _RaisingFirstGrid()
    err = _run(grid, tmp_path / "out", **{"node-wait-timeout": 3.0, "round-timeout": 3.0})
    assert {1000, 1001} <= set(_asked(grid)), \
        f"the honest nodes were never asked ({err}; asked {_asked(grid)})"
    assert err is None, err
