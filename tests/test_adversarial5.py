"""Issue 21, fifth adversarial round (a reviewer who did not write the fixes): what failed,
each as a regression test — a server replaying a round to cancel a SuperNode's local-DP
noise, MoNNA's trusted client beside fault injection or without an ``[attack]`` block, and
careless inputs that ended in a traceback instead of one line."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - fixture
from _flower_sims import in_process, ls_run

from partialfl.config import ConfigError

MONNA = {"name": "monna", "delta": 0.25, "trusted": 0}


# ------------------------------------------------------------------ local DP: replayed rounds
def _local_dp(z: float) -> dict:
    return ls_run(1, 4, spec={"privacy": {"name": "dp", "clip_norm": 1.0, "noise_multiplier": z,
                                          "mode": "local", "sampling": "fixed"}})


def _ask(grid, sent, theta, run_config=None) -> np.ndarray:
    """The θ rows a node replies to ``sent`` (a train message of the run) at ``theta``."""
    from flwr.app import Message, RecordDict

    from partialfl.flower.codec import params_to_record

    content = RecordDict(dict(sent.content.items()))
    content["theta"] = params_to_record(theta)
    if run_config is not None:
        content["run-config"] = run_config
    mid, = grid.push_messages([Message(content, dst_node_id=sent.metadata.dst_node_id,
                                       message_type="train")])
    reply, = grid.pull_messages([mid])
    assert not reply.has_error(), reply.error
    return reply.content["vectors"]["theta"].numpy().astype(np.float64)


def _train_message(grid, run):
    from partialfl.flower.server import run_server

    run_server(grid, run)
    return next(m for m in grid.sent if m.metadata.message_type == "train")


def test_a_replayed_round_gets_fresh_local_dp_noise(loopback):  # noqa: F811
    """A SuperNode drew a round's local-DP noise from (its secret key, round, client) every
    time it was asked: a server that sent round r twice, at θ_a and θ_b, got the same noise
    in both replies and their difference was the exact, noise-free difference of the clipped
    updates (to 4e-16). Now a round asked again draws from a fresh secret: the difference
    misses by the noise's scale z·C."""
    z = 2.0
    grid = loopback(1)  # the node's key: a fresh secret
    sent = _train_message(grid, _local_dp(z))
    theta_a = {n: a.numpy() for n, a in sent.content["theta"].items()}
    theta_b = {n: v + 0.5 for n, v in theta_a.items()}
    reply_a, reply_b = _ask(grid, sent, theta_a), _ask(grid, sent, theta_b)
    clean = loopback(1)  # the same node without noise: the clipped updates themselves
    no_noise = _train_message(clean, _local_dp(0.0)).content["run-config"]
    clip_a, clip_b = (_ask(clean, sent, t, no_noise) for t in (theta_a, theta_b))
    assert np.abs(reply_a - clip_a).max() > 0.5 * z  # the replies are noised
    leak = np.abs((reply_a - reply_b) - (clip_a - clip_b)).max()
    assert leak > 0.5 * z  # the server learns the difference only under noise


def test_a_replayed_round_repeats_the_run_seed_noise_of_a_simulation(loopback):  # noqa: F811
    """With the key ``seed`` (partialfl's own SuperNodes: nothing secret) a resent round
    repeats the in-process run's noise, so a resumed simulation still equals it."""
    grid = loopback(1, node_config={"dp-noise-key": "seed"})
    sent = _train_message(grid, _local_dp(2.0))
    theta = {n: a.numpy() for n, a in sent.content["theta"].items()}
    np.testing.assert_array_equal(_ask(grid, sent, theta), _ask(grid, sent, theta))


def test_a_node_refuses_a_server_that_turns_its_local_dp_noise_off(loopback):  # noqa: F811
    """A hostile server sent a local-DP run config with noise_multiplier = 0 (or central mode,
    or no privacy): the node clipped but added no noise, so each client's clipped update
    reached the server exactly. A node with the floor ``dp-min-noise`` (its own node config)
    now refuses every such run — an error reply naming the floor, never an update — and
    still answers the honest one."""
    from partialfl.flower.server import run_server

    floor = {"dp-min-noise": 2.0}
    grid = loopback(1, node_config=floor)
    sent = _train_message(grid, _local_dp(2.0))  # the honest run: answered
    theta = {n: a.numpy() for n, a in sent.content["theta"].items()}
    assert _ask(grid, sent, theta).shape[0] == 4
    hostile = [_local_dp(0.0), _local_dp(1.0), ls_run(1, 4), ls_run(1, 4, spec={"privacy": {
        "name": "dp", "clip_norm": 1.0, "noise_multiplier": 2.0, "sampling": "fixed"}})]
    for run in hostile:  # z = 0, z below the floor, no privacy, central mode
        config = _train_message(loopback(1), run).content["run-config"]
        with pytest.raises(AssertionError, match="below this node's floor dp-min-noise = 2"):
            _ask(grid, sent, theta, config)
    # a whole run asked of floored nodes fails at their refusal, naming it
    with pytest.raises(Exception, match="dp-min-noise"):
        run_server(loopback(2, node_config=floor), _local_dp(0.0))


@pytest.mark.parametrize("bad", ["-1", "x", "nan", True])
def test_a_bad_noise_floor_is_one_config_error(bad):
    from partialfl.flower.node import node_options

    with pytest.raises(ConfigError, match="dp-min-noise.*expected a finite number >= 0"):
        node_options({"partition-id": 0, "num-partitions": 1, "dp-min-noise": bad})


# ------------------------------------------------------------------ MoNNA's trusted client
def _monna(spec: dict, rounds: int = 4):
    return in_process(ls_run(rounds, 4, eval_every=1, spec={"aggregation": MONNA, **spec}))


def test_monna_trusted_runs_inside_fault_injection():
    """``[faults]`` wraps the algorithm before ``[attack]``: ByzantineRobust set the round's
    rule (MoNNA mapped to the trusted client's row, or bucketing bound to the round) on a copy
    of FaultInjector, whose server step delegated to FFGG's own rule as built — MoNNA with a
    client id — so the run stopped at round 0 with 'its row is known only to the runtime'.
    The rule now reaches the innermost algorithm: with no fault drawn, the run is the one
    without ``[faults]``."""
    attack = {"attack": {"name": "byzantine", "fraction": 0.25,
                         "attack": {"name": "gaussian", "sigma": 1e6}}}
    built, res = _monna({**attack, "faults": {"rate": 0.0}})
    _, ref = _monna(attack)
    assert type(built.algorithm.base).__name__ == "FaultInjector"
    assert res.history[-1]["rel_dist2"] == ref.history[-1]["rel_dist2"] < 1.0


def test_monna_trusted_without_an_attack_block_is_the_robust_server():
    """A spec with ``aggregation = {name = "monna", trusted = 0}`` and no ``[attack]`` (a
    deployment, whose attackers are real) built FFGG with the rule as is: nothing put client 0
    in the cohorts or found its row, and the run stopped after round 0's training with a
    ValueError. It now runs under the robust server (no simulated attacker): client 0 in every
    cohort, θ moved."""
    built, res = _monna({})
    alg = built.algorithm
    assert type(alg).__name__ == "ByzantineRobust" and alg.byzantine.clients == ()
    assert all(0 in alg.sample_cohort(3, r, 8, 4) for r in range(4))
    assert res.state.extra["byz_no_reference"] == 0
    assert res.history[-1]["rel_dist2"] < 0.9


def test_monna_trusted_on_flower_without_an_attack_block(loopback):  # noqa: F811
    """The same spec on the Flower ServerApp (two SuperNodes): it trains as in process."""
    from partialfl.flower.server import run_server

    run = ls_run(3, 4, eval_every=1, spec={"aggregation": MONNA})
    rep = run_server(loopback(2), run)
    _, ref = in_process(run)
    np.testing.assert_allclose(rep.theta["theta"], ref.state.theta["theta"], atol=1e-6)


def test_monna_trusted_client_out_of_range_is_one_config_error():
    """``trusted = 99`` among 8 clients with an ``[attack]`` block ended in numpy's IndexError
    ('index 99 is out of bounds') while drawing the Byzantine clients: a traceback from
    ``partialfl run``. Now one ConfigError naming the client and the range."""
    with pytest.raises(ConfigError, match=r"trusted client 99 is outside \[0, 8\)"):
        in_process(ls_run(2, 4, spec={"aggregation": {**MONNA, "trusted": 99},
                                      "attack": {"name": "byzantine", "fraction": 0.25}}))


# ------------------------------------------------------------------ careless inputs
def test_a_closed_form_run_with_the_default_sgd_client_is_one_line(tmp_path, capsys):
    """A least-squares spec without ``[personalize.client]`` gets the default client, SGD on
    minibatches, which needs a model: ``partialfl run`` ended in a traceback
    (AttributeError: 'LeastSquaresProblem' object has no attribute 'call_mode', exit 1)
    after building the problem. Now one line naming the clients to give, exit 2."""
    from partialfl.cli import main

    cfg = tmp_path / "ls.toml"
    cfg.write_text('seed = 3\n[problem]\nname = "least-squares"\nnum_clients = 4\nn = 40\n'
                   'd_theta = 3\nd_w = 2\n[method]\nalgorithm = "ffgg"\n[personalize]\n'
                   'rounds = 1\n')
    rc = main(["run", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "give the stage's client gd, cg or exact" in err[0]


@pytest.mark.parametrize("config", [
    {"partition-id": "x", "num-partitions": 2},
    {"partition-id": 1.7, "num-partitions": 2},
    {"partition-id": True, "num-partitions": 2},
    {"partition-id": 0, "num-partitions": 1, "dp-noise-key": "\u00b2"},
])
def test_a_node_config_integer_is_parsed_strictly(config):
    """A SuperNode's ``partition-id`` 'x' raised a bare ValueError, 1.7 and true were read as
    partition 1, and ``dp-noise-key`` '²' (a str.isdigit() digit int() refuses) raised a
    bare ValueError. Each is now one ConfigError naming the key."""
    from partialfl.flower.node import node_options

    with pytest.raises(ConfigError, match="node-config '(partition-id|dp-noise-key)'"):
        node_options(config, {})
