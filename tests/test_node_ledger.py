"""A SuperNode's release ledger (``dp-ledger``, ``dp-max-releases``; issue 21, round 9's
design finding): a real deployment runs each ClientApp message in a new process, so the
node's in-memory replay memory was empty for every message — a server replaying round r at
another θ under an operator's fixed ``dp-noise-key`` got the same local-DP noise twice and
subtracted it — and nothing bounded how many noisy releases of a client a hostile server
collected and averaged. The ledger, on the node's disk, fixes both."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - fixture
from test_adversarial5 import _ask, _local_dp, _train_message

from partialfl.config import ConfigError
from partialfl.flower.ledger import ReleaseLedger
from partialfl.flower.node import node_options

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")


def test_the_ledger_counts_releases_across_processes_and_caps_them(tmp_path):
    path = tmp_path / "node" / "ledger.json"
    assert ReleaseLedger(path, 2).request(7, 0, [1, 2]) == 0
    assert ReleaseLedger(path, 2).request(7, 0, [1]) == 1  # a new object: a new process
    with pytest.raises(ConfigError, match=r"client\(s\) \[1\] already had 2 .*dp-max-releases"):
        ReleaseLedger(path, 2).request(7, 1, [2, 1])
    assert ReleaseLedger(path).releases() == {1: 2, 2: 1}  # the refused request counted none
    assert ReleaseLedger(path, 2).request(8, 0, [2]) == 0  # another key: another count
    assert "7" not in path.read_text().replace('"', " ").split()  # the key is not written


@pytest.mark.parametrize("content", ["not json", '{"format": "x"}',
                                     '{"format": "partialfl-node-ledger-1", "releases": '
                                     '{"1": -3}, "answered": {}}',
                                     '{"format": "partialfl-node-ledger-1", "releases": '
                                     '{"abc": 1}, "answered": {}}',
                                     '[' * 100000 + ']' * 100000])
def test_a_damaged_ledger_stops_releases_in_one_line(tmp_path, content):
    path = tmp_path / "ledger.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="dp-ledger.*refuses to release") as e:
        ReleaseLedger(path, 3).request(1, 0, [0])
    assert "\n" not in str(e.value)


def test_node_options_of_the_ledger(tmp_path):
    base = {"partition-id": 0, "num-partitions": 1}
    with pytest.raises(ConfigError, match="'dp-max-releases' needs 'dp-ledger'"):
        node_options({**base, "dp-max-releases": 3}, {})
    for bad in (0, -1, "x", 1.5, True):
        with pytest.raises(ConfigError, match="dp-max-releases.*integer >= 1"):
            node_options({**base, "dp-ledger": "l.json", "dp-max-releases": bad}, {})
    env = {"PARTIALFL_NODE_DP_LEDGER": str(tmp_path / "l.json"),
           "PARTIALFL_NODE_DP_MAX_RELEASES": "4"}
    opts = node_options(base, env)
    assert opts.max_releases == 4 and opts.release_ledger().path == tmp_path / "l.json"


def _fresh_process(monkeypatch):
    """What a deployment's next message sees: no cached runtime, no replay memory."""
    from partialfl.flower import client

    monkeypatch.setattr(client, "_CACHE", {})
    monkeypatch.setattr(client, "_ANSWERED", {})


def test_a_replay_in_a_new_process_gets_fresh_noise_with_a_ledger(loopback, monkeypatch,  # noqa: F811
                                                                  tmp_path):
    """With an operator's integer noise key, a round asked again in a new process (every
    message, in a deployment) drew the same noise: the server subtracted two replies at θ_a
    and θ_b and read the exact difference of the clipped updates. With the node's ledger the
    second ask draws fresh noise, so the difference misses by the noise's scale."""
    z = 2.0
    grid = loopback(1, node_config={"dp-noise-key": 12345,
                                    "dp-ledger": str(tmp_path / "ledger.json")})
    sent = _train_message(grid, _local_dp(z))
    theta_a = {n: a.numpy() for n, a in sent.content["theta"].items()}
    theta_b = {n: v + 0.5 for n, v in theta_a.items()}
    _fresh_process(monkeypatch)
    reply_a = _ask(grid, sent, theta_a)
    _fresh_process(monkeypatch)
    reply_b = _ask(grid, sent, theta_b)
    clean = loopback(1)
    no_noise = _train_message(clean, _local_dp(0.0)).content["run-config"]
    clip_a, clip_b = (_ask(clean, sent, t, no_noise) for t in (theta_a, theta_b))
    leak = np.abs((reply_a - reply_b) - (clip_a - clip_b)).max()
    assert leak > 0.5 * z


def test_without_a_ledger_a_new_process_forgets(loopback, monkeypatch):  # noqa: F811
    """Why the ledger exists (documented): the same replay without it repeats the noise."""
    grid = loopback(1, node_config={"dp-noise-key": 12345})
    sent = _train_message(grid, _local_dp(2.0))
    theta = {n: a.numpy() for n, a in sent.content["theta"].items()}
    _fresh_process(monkeypatch)
    first = _ask(grid, sent, theta)
    _fresh_process(monkeypatch)
    np.testing.assert_array_equal(first, _ask(grid, sent, theta))


def test_a_node_stops_releasing_a_client_past_its_cap(loopback, tmp_path):  # noqa: F811
    """A hostile server asking the same round again and again to average the noise away gets
    at most ``dp-max-releases`` updates per client, across processes; then error replies."""
    from flwr.app import Message, RecordDict

    from partialfl.flower.server import run_server

    ledger = tmp_path / "ledger.json"
    grid = loopback(1, node_config={"dp-min-noise": 2.0, "dp-ledger": str(ledger),
                                    "dp-max-releases": 2})
    rep = run_server(grid, _local_dp(2.0))  # the honest round: one release per client
    assert rep.server_steps == 1 and not rep.failures
    sent = next(m for m in grid.sent if m.metadata.message_type == "train")
    cohort = [int(c) for c in sent.content["task"]["clients"]]
    replies = []
    for _ in range(3):
        mid, = grid.push_messages([Message(RecordDict(dict(sent.content.items())),
                                           dst_node_id=sent.metadata.dst_node_id,
                                           message_type="train")])
        replies.append(grid.pull_messages([mid])[0])
    assert not replies[0].has_error()  # the second release of each client
    for r in replies[1:]:
        assert r.has_error() and "dp-max-releases" in r.error.reason
    assert ReleaseLedger(ledger).releases() == {c: 2 for c in cohort}
