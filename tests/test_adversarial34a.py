"""Adversarial round 34a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). Each test failed on the code it was written against (adv34a at aac6cb7)
because of the defect it names, and passes since the fix (the first two rewritten for it: a
node whose operator set a policy about its clients refuses runs on the spec's ``[data]``).

* Area 5, a SuperNode that serves the spec's ``[data]`` (no ``data`` in its node config: it
  reads the data set the run config names and serves its partition by index): which client
  an id means is decided by the run config the *server* sends — ``data.num_clients`` with
  ``data.seed`` keep a seeded subset, ``data.holdout`` holds some out, and the node's
  partition is then the ids ``partition_clients`` gives. Everything the node's own policy
  keys on a client is keyed on that server-chosen number:

  - the release ledger (``dp-ledger`` with ``dp-max-releases`` = R, documented: "sends at
    most R updates of a client, so the per-client guarantee (R releases at noise z) then
    holds whatever the server asks") counts ``releases[str(id)]``
    (``NodeRuntime.context`` → ``ReleaseLedger.request``): under another subset the same
    client file has a fresh id with no releases, so the server collects R more noised
    updates of it per renumbering;
  - the evaluation floor (node config ``eval-min-clients``: "the node evaluates only when it
    holds at least the larger of the two"): the node's clients for an evaluation are the
    ids of the run config's subset, so two evaluations at the same θ under two subsets
    whose node sets differ by one client give that client's exact test counts and loss
    (``correct``, ``total``, ``loss_sum``) by subtraction.

  (A node with its own client store is not affected: its clients are the store's.)
* Area 5, values the server sends that the node writes to its disk: every train request
  adds an ``answered`` entry ``<key digest>:<round>`` to the ledger, also one whose cohort is
  empty (it releases nothing, so the cap never refuses it) and one the DP budget then
  refuses: distinct rounds grow the ledger file without bound, ~42 bytes a message, and
  every later request reads and rewrites the whole file under its lock.
* Area 5, error texts: a node builds the spec's data outside ``kept_on_node``, so the data
  set's own validation error — ``train_y of client 'alice' has labels in [5, 7], outside
  0..4`` when the server's spec says ``data.options.num_classes = 5`` — is the node's error
  reply (Flower sends an exception's text): a client's name and its label range reach the
  server.
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


def _client_files(folder, n: int = 6) -> None:
    """``n`` clients ``c0.npz`` … of 28×28 images (3 classes): 6 train, 3 test examples."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for i in range(n):
        np.savez(folder / f"c{i}.npz", train_x=rng.random((6, 28, 28)).astype(np.float32),
                 train_y=rng.integers(0, 3, 6),
                 test_x=rng.random((3, 28, 28)).astype(np.float32),
                 test_y=rng.integers(0, 3, 3))


def _spec(folder, privacy: bool, **data) -> dict:
    spec = {"seed": 1, "model": {"name": "emnist_cnn"},
            "data": {"source": "folder", "path": str(folder), **data},
            "method": {"algorithm": "ffgg"}, "pretrain": {"rounds": 0},
            "personalize": {"rounds": 2, "eval_every": 0}}
    if privacy:
        spec["privacy"] = {"name": "dp", "clip_norm": 1.0, "noise_multiplier": 2.0,
                           "mode": "local", "sampling": "fixed"}
    return spec


def _subset_seed(keep_first: list[int], size: int, total: int = 6) -> int:
    """A ``data.seed`` whose seeded subset of ``size`` of ``total`` clients starts with
    exactly the files ``keep_first`` (as :func:`partialfl.data.sources._subset_holdout`
    draws it)."""
    for s in range(1000):
        keep = np.sort(np.random.default_rng(s).permutation(total)[:size])
        if keep[:len(keep_first)].tolist() == keep_first:
            return s
    raise AssertionError("no such seed")


class _Server:
    """A hostile ServerApp talking to the loopback SuperNode of partition 0 directly, each
    message under the run config of the spec it chooses."""

    def __init__(self, grid):
        self.grid = grid

    def ask(self, mtype: str, content, spec: dict):
        from flwr.app import ConfigRecord, Message

        from partialfl.flower.config import parse_run_config

        content["run-config"] = ConfigRecord(
            parse_run_config({"spec": spec, "stage": "personalize"}).to_run_config())
        mid, = self.grid.push_messages([Message(content, dst_node_id=1000,
                                                message_type=mtype)])
        reply, = self.grid.pull_messages([mid])
        return reply

    def theta0(self, spec: dict):
        from flwr.app import ConfigRecord, RecordDict

        from partialfl.flower.codec import decode_params

        reply = self.ask("query.describe",
                         RecordDict({"request": ConfigRecord({"init-partition": 0})}), spec)
        assert not reply.has_error(), reply.error.reason
        return decode_params(reply.content["theta0"])


def _ids(spec: dict) -> tuple[str, ...]:
    """The client files behind the run's client ids 0, 1, … (what the node serves)."""
    from partialfl.build import build_data
    from partialfl.flower.config import parse_run_config

    return tuple(build_data(parse_run_config({"spec": spec}).run)[0].client_ids)


def _store(spec: dict, folder) -> str:
    """Partition 0's own client store (``partialfl flower node-data``) of ``spec``'s data."""
    from partialfl.build import build_data
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.local import write_node_stores

    data = build_data(parse_run_config({"spec": spec}).run)[0]
    return str(write_node_stores(data, 2, folder)[0])


_OWN_DATA = "protect the clients of its own data"


def test_a_nodes_release_cap_holds_for_a_client_the_server_renumbers(loopback, tmp_path):  # noqa: F811
    """2 loopback SuperNodes, each with the floor ``dp-min-noise = 2`` and a ledger capping
    every client at ONE released update; the server's spec is FFGG with local DP (z = 2, the
    floor) on a folder of 6 client files. Found before the fix: a node reading the spec's
    ``[data]`` keyed its ledger on the client's position in the server-chosen subset, so the
    same spec with ``data.num_clients = 5`` and a ``data.seed`` keeping ``c1..c5`` (id 0 is
    file ``c1``) released ``c1`` a second time. Now such a node refuses the run (its policy
    holds only for its own data); with its own store (``partialfl flower node-data``) the
    server's data options do not renumber its clients, and ``c1`` is released once."""
    from partialfl.flower.rounds import train_content

    folder = tmp_path / "clients"
    _client_files(folder)
    policy = {"dp-min-noise": 2.0, "dp-ledger": str(tmp_path / "ledger.json"),
              "dp-max-releases": 1}
    first = _spec(folder, True)
    renumbered = _spec(folder, True, num_clients=5, seed=_subset_seed([1, 2, 3], 5))
    assert _ids(first)[1] == _ids(renumbered)[0] == "c1"
    theta = _Server(loopback(2)).theta0(first)  # a node without a policy: θ⁰
    server = _Server(loopback(2, node_config=policy))
    for spec in (first, renumbered):  # the spec's [data]: refused, nothing released
        reply = server.ask("train", train_content(theta, 0, [0, 1]), spec)
        assert reply.has_error() and _OWN_DATA in reply.error.reason
    server = _Server(loopback(2, node_config={**policy,
                                              "data": _store(first, tmp_path / "stores")}))
    once = server.ask("train", train_content(theta, 0, [1]), first)
    assert not once.has_error(), once.error.reason
    for spec in (first, renumbered):
        again = server.ask("train", train_content(theta, 1, [1]), spec)
        assert again.has_error() and "dp-max-releases" in again.error.reason, (
            "file c1's second noised update was released past dp-max-releases = 1")


def test_a_nodes_evaluation_floor_holds_for_clients_the_server_renumbers(loopback, tmp_path):  # noqa: F811
    """2 loopback SuperNodes reading the spec's folder of 6 client files, each with its own
    floor ``eval-min-clients = 2`` (no DP). Found before the fix: the server evaluated
    partition 0 at θ⁰ under the spec (its clients: files c0, c1, c2) and under the spec with
    ``data.num_clients = 4`` and a ``data.seed`` keeping c0, c1 first (its clients: c0,
    c1); the difference of the two sums was client c2's own test counts and loss. Now the
    node refuses every evaluation of a run on the spec's ``[data]`` (its floor holds only
    for its own data), and with its own store the two specs evaluate the same clients."""
    from flwr.app import ConfigRecord, RecordDict

    from partialfl.flower.codec import params_to_record

    folder = tmp_path / "clients"
    _client_files(folder)
    full = _spec(folder, False)
    fewer = _spec(folder, False, num_clients=4, seed=_subset_seed([0, 1], 4))
    assert _ids(full)[:3] == ("c0", "c1", "c2") and _ids(fewer)[:2] == ("c0", "c1")
    theta = _Server(loopback(2)).theta0(full)

    def evaluate(server, spec):
        content = RecordDict({"theta": params_to_record(theta),
                              "task": ConfigRecord({"round": 0})})
        return server.ask("evaluate", content, spec)

    server = _Server(loopback(2, node_config={"eval-min-clients": 2}))
    for spec in (full, fewer):
        reply = evaluate(server, spec)
        assert reply.has_error() and _OWN_DATA in reply.error.reason
    server = _Server(loopback(2, node_config={"eval-min-clients": 2,
                                              "data": _store(full, tmp_path / "stores")}))
    big, small = (evaluate(server, spec) for spec in (full, fewer))
    assert not big.has_error() and not small.has_error(), (big.error, small.error)
    assert dict(big.content["eval"]) == dict(small.content["eval"]), (
        "the server's data options changed which clients the node evaluated")


def test_requests_that_release_nothing_do_not_grow_a_nodes_ledger(loopback, tmp_path):  # noqa: F811
    """2 loopback SuperNodes (least squares) with the floor ``dp-min-noise = 2`` and a ledger
    capping each client at one release; one honest local-DP round. The server then sends
    300 train messages with an empty cohort (nothing released, so the cap never refuses)
    and 300 distinct rounds (past the DP budget's: refused by it too, after the ledger
    recorded them). Expected: the node's ledger (its count of releases) stays the
    size it was — nothing was released. Found: it grows by ~42 bytes a message (300 entries
    ``<digest>:<round>``), without bound, and each request rewrites all of it."""
    import warnings

    from flwr.app import ConfigRecord, Message, RecordDict

    from partialfl.flower.server import run_server

    ledger = tmp_path / "ledger.json"
    grid = loopback(2, node_config={"dp-min-noise": 2.0, "dp-ledger": str(ledger),
                                    "dp-max-releases": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_server(grid, ls_run(1, 4, spec={"privacy": {
            "name": "dp", "clip_norm": 1.0, "noise_multiplier": 2.0, "mode": "local",
            "sampling": "fixed"}}))
    train = next(m for m in grid.sent if m.metadata.message_type == "train")
    before = ledger.stat().st_size
    for r in range(300):
        content = RecordDict(dict(train.content.items()))
        content["task"] = ConfigRecord({**dict(train.content["task"]), "round": 10 ** 17 + r,
                                        "clients": []})
        mid, = grid.push_messages([Message(content, dst_node_id=train.metadata.dst_node_id,
                                           message_type="train")])
        grid.pull_messages([mid])
    after = ledger.stat().st_size
    assert after <= before + 1000, (f"300 requests that released nothing grew the node's "
                                    f"ledger from {before} to {after} bytes")


def test_a_nodes_data_error_carries_no_client_labels_to_the_server(loopback):  # noqa: F811
    """2 loopback SuperNodes reading the spec's folder of 3 client files; client ``alice``
    holds only labels 5..7. The server's spec names the folder with ``data.options.
    num_classes = 5`` (its choice). Expected: the node refuses with an error that says what
    failed, not what ``alice``'s data holds (error texts stay on the node). Found: the
    reply is ``ValueError: train_y of client 'alice' has labels in [5, 7], outside 0..4`` —
    the client's name and the range of its labels; with subsets of its choosing
    (``data.num_clients``, ``data.seed``) the server reads every client's range."""
    import tempfile
    from pathlib import Path

    from flwr.app import ConfigRecord, Message, RecordDict

    from partialfl.flower.config import parse_run_config

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, labels in (("alice", (5, 8)), ("bob", (0, 5)), ("carol", (0, 5))):
            np.savez(folder / f"{name}.npz",
                     train_x=rng.random((6, 28, 28)).astype(np.float32),
                     train_y=np.resize(np.arange(*labels), 6),
                     test_x=rng.random((3, 28, 28)).astype(np.float32),
                     test_y=np.resize(np.arange(*labels), 3))
        spec = {"seed": 1, "model": {"name": "emnist_cnn"},
                "data": {"source": "folder", "path": str(folder),
                         "options": {"num_classes": 5}},
                "method": {"algorithm": "ffgg"}, "pretrain": {"rounds": 0},
                "personalize": {"rounds": 1, "eval_every": 0}}
        grid = loopback(2)
        content = RecordDict({
            "request": ConfigRecord({"init-partition": 0}),
            "run-config": ConfigRecord(parse_run_config(
                {"spec": spec, "stage": "personalize"}).to_run_config())})
        mid, = grid.push_messages([Message(content, dst_node_id=1000,
                                           message_type="query.describe")])
        reply, = grid.pull_messages([mid])
    assert reply.has_error()  # the spec does not fit the data: refused, fine
    reason = str(reply.error.reason)
    assert "[5, 7]" not in reason and "alice" not in reason, reason
