"""Differential privacy on Flower (issue 24 item 3): a spec with ``[privacy]`` runs the same
code path as in process — the ClientApps clip (and in local mode noise) in the DP wrapper's
``client_update``, the ServerApp draws the cohorts with the wrapper's sampling and adds the
central noise in its ``server_update`` — so θ, ε and the clip norm equal the in-process run's.
With SecAgg+ the clients clip before their node combines them and the server noises the
unmasked sum (fixed clipping, central or local mode); adaptive clipping is refused. In one
process (the loopback grid: the real ServerApp and ClientApps, no Ray); the simulation engine
runs DP in tests/test_flower.py."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_sims import in_process, ls_run

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")
pytest.importorskip("dp_accounting", reason="pip install 'partialfl[dp]'")

from partialfl.flower.config import ConfigError, parse_run_config  # noqa: E402
from partialfl.flower.secagg import quantisation_bound  # noqa: E402

CENTRAL = {"name": "dp", "clip_norm": 1.0, "noise_multiplier": 0.5}


def _dp(rounds=3, k=4, secagg=False, **privacy):
    return ls_run(rounds, k, eval_every=1, spec={"privacy": {**CENTRAL, **privacy}},
                  **({"secagg": True, "secagg_clip": 16.0} if secagg else {}))


def _records(history):
    keys = ("round", "dp_epsilon", "dp_delta", "dp_noise_multiplier", "dp_clip_norm",
            "rel_dist2")
    return [{k: h[k] for k in keys} for h in history]


@pytest.mark.parametrize("privacy", [
    {},
    {"sampling": "fixed"},
    {"adaptive_clipping": True, "clip_count_std": 2.0, "clip_norm": 0.5},
    {"mode": "local"},
], ids=["central-poisson", "central-fixed", "central-adaptive", "local"])
def test_dp_on_flower_is_the_in_process_run(loopback, privacy):
    """θ, ε, δ, z and the clip norm of every evaluated round equal the in-process run's (to
    1e-6; the same noise seeds), and the clients each node was asked for are the wrapper's
    draws — Poisson cohorts of varying size, as the accountant assumes."""
    from partialfl.flower.server import run_server
    from partialfl.sampling import draw_cohort

    run = _dp(**privacy)
    grid = loopback(2, node_config={"dp-noise-key": "seed"})  # local DP: the run's noise
    rep = run_server(grid, run)
    built, ref = in_process(run)
    np.testing.assert_allclose(rep.theta["theta"], ref.state.theta["theta"], rtol=0, atol=1e-6)
    got, want = _records(rep.history), _records(ref.history)
    assert [g["round"] for g in got] == [w["round"] for w in want] == [0, 1, 2, 3]
    for g, w in zip(got, want):
        for key in g:
            assert g[key] == pytest.approx(w[key], rel=0, abs=1e-6), (key, g, w)
    assert got[-1]["dp_epsilon"] > 0
    if privacy.get("adaptive_clipping"):  # the nodes clipped with the server's current C
        assert len({g["dp_clip_norm"] for g in got}) == 4
    asked = {}
    for m in grid.sent:
        if m.metadata.message_type == "train":
            task = m.content["task"]
            asked.setdefault(int(task["round"]), []).extend(int(c) for c in task["clients"])
    opts = built.algorithm.options
    draws = {r: draw_cohort(opts.sampling, 3, r, 8, 4).tolist() for r in range(3)}
    assert {r: sorted(c) for r, c in asked.items()} == {r: c for r, c in draws.items() if c}
    if opts.sampling == "poisson":
        assert len({len(c) for c in draws.values()}) > 1


def _received(seen: list):
    """The spec's algorithm, its server step recording (round, cohort, θ rows)."""
    def factory(cfg, problem):
        from partialfl.build import build

        alg = build(cfg.run).algorithm
        step = alg.server_update

        def server_update(state, updates, ctx):
            seen.append((ctx.round, np.asarray(updates.cohort).copy(),
                         np.asarray(updates.vectors["theta"], np.float64).copy()))
            return step(state, updates, ctx)

        alg.server_update = server_update
        return alg

    return factory


@pytest.mark.parametrize("key", [None, 12345])
def test_the_server_cannot_strip_a_nodes_local_dp_noise(loopback, key):
    """Local DP's noise was drawn from (run seed, round, client), and the server holds the run
    seed: it regenerated each client's noise and subtracted it, recovering every clipped
    update exactly. Now a SuperNode draws the noise from its own key (node config
    ``dp-noise-key``; unset: a fresh secret): the server's subtraction misses by the noise's
    scale, while with the key ``seed`` (what a simulation uses) it recovers the update — so
    the check below is the attack that used to work."""
    from partialfl import rng as prng
    from partialfl.flower.server import run_server

    z, C = 2.0, 1.0
    run = _dp(1, 4, mode="local", sampling="fixed", noise_multiplier=z, clip_norm=C)
    clean: list = []
    run_server(loopback(2), _dp(1, 4, mode="local", sampling="fixed", noise_multiplier=0.0,
                                clip_norm=C), algorithm_factory=_received(clean))
    (_, cohort, clipped), = clean

    def stripped(node_config):
        seen: list = []
        run_server(loopback(2, node_config=node_config), run, algorithm_factory=_received(seen))
        (r, got_cohort, rows), = seen
        assert got_cohort.tolist() == cohort.tolist()  # the same clients, clipped the same
        noise = np.stack([prng.generator(3, "dp-noise", r, int(m)).standard_normal(
            rows.shape[1]) * z * C for m in got_cohort])
        return np.abs(rows - noise - clipped).max(), rows

    err, rows = stripped({} if key is None else {"dp-noise-key": key})
    assert err > 0.5 * z * C  # the clients' updates stay hidden under the noise
    assert stripped({"dp-noise-key": "seed"})[0] < 1e-9  # the attack itself is right
    # neither key repeats its noise in one node process: a node answers each (key, round)
    # once, later asks draw fresh secrets (test_adversarial6: a server that rebuilt the
    # node's runtime with another run config replayed an operator key's noise)
    again = stripped({} if key is None else {"dp-noise-key": key})
    assert again[0] > 0.5 * z * C and np.abs(again[1] - rows).max() > 0.1


@pytest.mark.parametrize("bad", ["-1", "x", "1.5", 2**63])
def test_a_bad_node_noise_key_is_one_config_error(bad):
    from partialfl.flower.node import node_options

    with pytest.raises(ConfigError, match="dp-noise-key.*expected an integer"):
        node_options({"partition-id": 0, "num-partitions": 1, "dp-noise-key": bad})
    with pytest.raises(ConfigError, match="PARTIALFL_NODE_DP_NOISE_KEY"):
        node_options({"partition-id": 0, "num-partitions": 1},
                     {"PARTIALFL_NODE_DP_NOISE_KEY": str(bad)})


def _mean_rows(rows: list):
    """The spec's algorithm, its server step recording (rows, distinct rows)."""
    def factory(cfg, problem):
        from partialfl.build import build

        alg = build(cfg.run).algorithm
        step = alg.server_update

        def server_update(state, updates, ctx):
            v = np.concatenate([np.asarray(x).reshape(len(updates.cohort), -1)
                                for x in updates.vectors.values()], 1)
            rows.append((len(updates.cohort), len(np.unique(v, axis=0))))
            return step(state, updates, ctx)

        alg.server_update = server_update
        return alg

    return factory


@pytest.mark.parametrize("mode", ["central", "local"])
def test_dp_with_secagg_is_the_plain_dp_run_within_the_quantisation_error(loopback, mode):
    """SecAgg+ with DP (fixed clipping, fixed-size sampling so the cohort has k clients):
    the server's step sees only the round's mean (k identical rows), adds the central noise
    to it (central mode; local: the clients noised) and θ after one round is the plain DP
    run's within γ · N · 2c/2^bits (N = 3 nodes); ε is the same."""
    from partialfl.flower.server import run_server

    run = _dp(1, 4, secagg=True, mode=mode, sampling="fixed")
    rows: list = []
    seed_key = {"node_config": {"dp-noise-key": "seed"}}
    rep = run_server(loopback(3, **seed_key), run, algorithm_factory=_mean_rows(rows))
    plain = run_server(loopback(3, **seed_key), {**run, "secagg": False})
    built, ref = in_process(run)
    np.testing.assert_allclose(plain.theta["theta"], ref.state.theta["theta"], rtol=0,
                               atol=1e-12)
    assert rows == [(4, 1)] and rep.server_steps == 1 and not rep.failures
    lr = built.algorithm.server_opt.lr
    diff = float(np.abs(rep.theta["theta"] - plain.theta["theta"]).max())
    assert 0 < diff <= lr * quantisation_bound(parse_run_config(run), 3), diff
    assert rep.history[-1]["dp_epsilon"] == plain.history[-1]["dp_epsilon"] > 0
    noiseless = run_server(loopback(3), _dp(1, 4, secagg=True, mode=mode, sampling="fixed",
                                            noise_multiplier=0.0))
    assert float(np.abs(noiseless.theta["theta"] - rep.theta["theta"]).max()) > 10 * diff


def test_adaptive_clipping_with_secagg_is_refused_in_one_line(loopback, tmp_path, capsys,
                                                                monkeypatch):
    """Adaptive clipping reads each client's clipping bit, which SecAgg+ would reveal: the
    ServerApp refuses it, and `partialfl run --engine flower-sim` does before Flower starts
    (exit 2, one line, nothing written)."""
    import subprocess

    from partialfl.cli import main
    from partialfl.flower.server import run_server

    run = _dp(1, 4, secagg=True, adaptive_clipping=True, clip_count_std=2.0)
    with pytest.raises(ConfigError, match="adaptive clipping: give a fixed clip_norm") as e:
        run_server(loopback(3), run)
    assert "\n" not in str(e.value)
    cfg = tmp_path / "dp.toml"
    cfg.write_text('seed = 3\n[problem]\nname = "least-squares"\nnum_clients = 8\n'
                   '[privacy]\nname = "dp"\nclip_norm = 1.0\nnoise_multiplier = 0.5\n'
                   'adaptive_clipping = true\nclip_count_std = 2.0\n[personalize]\nrounds = 2\n'
                   'clients_per_round = 4\n')
    def no_process(*args, **kw):
        raise AssertionError(f"a process was started: {args[0] if args else kw}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    rc = main(["run", str(cfg), "--engine", "flower-sim", "--flower", "secagg=true",
               "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "adaptive clipping" in err, err
    assert not (tmp_path / "out").exists()


DP_TOML = """seed = 3
[problem]
name = "least-squares"
num_clients = 8
n = 200
d_theta = 10
d_w = 5
seed = 3
[method]
algorithm = "ffgg"
w_init = "zero"
[privacy]
name = "dp"
clip_norm = 1.0
noise_multiplier = 0.5
[personalize]
rounds = 3
clients_per_round = 4
eval_every = 1
client = { name = "cg", tau = 5 }
"""


@pytest.mark.slow  # ~20 s: a simulation SuperLink and `flwr run` (Ray inside flwr-simulation)
def test_partialfl_run_with_privacy_on_flower_sim_is_the_in_process_run(tmp_path):
    """`partialfl run dp.toml --engine flower-sim` (central DP, fixed clipping): θ and ε
    of every record equal `partialfl run dp.toml` to 1e-6, and the summary states the same
    privacy guarantee."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs 'flwr[simulation]'")
    from partialfl.cli import main
    from partialfl.pipeline.train import load_run_spec
    from partialfl.runtime.logging import read_jsonl

    cfg = tmp_path / "dp.toml"
    cfg.write_text(DP_TOML)
    for out, engine in (("local", []), ("sim", ["--engine", "flower-sim"])):
        assert main(["run", str(cfg), "--out", str(tmp_path / out), "--no-progress",
                     *engine]) == 0
    local, sim = (read_jsonl(tmp_path / out / "dp.jsonl") for out in ("local", "sim"))
    assert [h["round"] for h in sim] == [h["round"] for h in local] == [0, 1, 2, 3]
    for a, b in zip(sim, local):
        for key in ("dp_epsilon", "dp_clip_norm", "rel_dist2", "loss_gap"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-6), key
    assert sim[-1]["dp_epsilon"] > 0
    _, res = in_process({"spec": load_run_spec(cfg, [])})
    with np.load(tmp_path / "sim" / "flower" / "theta.npz") as z:
        np.testing.assert_allclose(z["theta"], res.state.theta["theta"], rtol=0, atol=1e-6)
    privacy = [[line for line in (tmp_path / out / "summary.md").read_text().splitlines()
                if line.startswith("Privacy:")] for out in ("local", "sim")]
    assert privacy[0] == privacy[1] and "ε = 7.16" in privacy[0][0]
