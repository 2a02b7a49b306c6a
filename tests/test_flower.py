"""partialfl on Flower: simulation reproduces the in-process simulator, deployment smoke test,
no personal parameter in any message the server receives, failure handling, async.

Skipped (with the reason) when the optional extra is missing: ``pip install
'partialfl[flower]'`` (flwr >= 1.42; the simulation tests also need ``flwr[simulation]``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from partialfl.flower.env import apply_flower_env

apply_flower_env()  # before flwr is imported: no telemetry, no update check, no `uv sync`
flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from flwr.app import Message  # noqa: E402

from partialfl.algorithms.base import RoundContext  # noqa: E402
from partialfl.flower.builders import build_algorithm, build_problem  # noqa: E402
from partialfl.flower.codec import (  # noqa: E402
    PrivacyError,
    WireFormatError,
    decode_updates,
    encode_updates,
)
from partialfl.flower.config import parse_run_config  # noqa: E402
from partialfl.runtime.sync import run_rounds, sample_cohort  # noqa: E402
from partialfl.types import ClientUpdates  # noqa: E402

SMALL = {"ls-clients": 8, "ls-n": 200, "ls-d-theta": 10, "ls-d-w": 5, "local-steps": 5,
         "seed": 3}


def _in_process(run_config: dict, rounds: int, clients_per_round: int | None, **kw):
    cfg = parse_run_config(run_config)
    problem = build_problem(cfg)
    algorithm = build_algorithm(cfg, problem, **kw)
    thetas = []
    res = run_rounds(problem, algorithm, rounds, clients_per_round=clients_per_round,
                     seed=cfg.seed, on_round=lambda r, s: thetas.append(s.theta["theta"]))
    return problem, algorithm, res, thetas


# -- wire format (no Ray, no processes) -----------------------------------------------------
def _updates(k=3, d=4, names=("theta",)):
    rng = np.random.default_rng(0)
    return ClientUpdates({n: rng.standard_normal((k, d)) for n in names}, np.ones(k),
                         np.arange(k), 5, {"loss": rng.random(k)})


def test_codec_round_trip_is_exact():
    up = _updates()
    theta = {"theta": np.zeros(4)}
    back, sums = decode_updates(encode_updates(up, theta), theta, up.cohort)
    assert np.array_equal(back.vectors["theta"], up.vectors["theta"])
    assert np.array_equal(back.cohort, up.cohort) and back.grad_evals == 5
    assert sums["loss"] == (float(up.metrics["loss"].sum()), 3.0)  # aggregated on the node


def test_codec_refuses_personal_leaves_and_checks_replies():
    with pytest.raises(PrivacyError, match=r"leaves \['w'\].*only θ leaves \(\['theta'\]\)"):
        encode_updates(_updates(names=("theta", "w")), ["theta"])
    theta = {"theta": np.zeros(4)}
    content = encode_updates(_updates(), theta)
    with pytest.raises(WireFormatError, match=r"for clients \[0, 1, 2\], asked for \[0, 1, 5\]"):
        decode_updates(content, theta, np.array([0, 1, 5]))
    with pytest.raises(WireFormatError, match="has shape"):
        decode_updates(content, {"theta": np.zeros(5)}, np.arange(3))
    bad = _updates()
    bad.vectors["theta"][1, 2] = np.nan
    with pytest.raises(WireFormatError, match="not finite"):
        decode_updates(encode_updates(bad, theta), theta, np.arange(3))


# -- the personal-parameter detector used below ---------------------------------------------
def _wire_bytes(msg: Message) -> bytes:
    """Everything of ``msg`` that travels: the message and all nested records/arrays."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return b"".join(obj.deflate() for obj in get_all_nested_objects(msg).values())


def _record_keys(msg: Message) -> set[str]:
    keys = set()
    if msg.has_content():
        for name, rec in msg.content.items():
            keys.add(name)
            keys.update(rec.keys())
    return keys


def _leaks(msg: Message, personal_names: set[str], personal_values: np.ndarray) -> list[str]:
    """Personal names among the record keys, and personal values (bit patterns of every
    float64 entry, and of its float32 rounding) anywhere in the wire bytes."""
    found = [f"name {k!r}" for k in _record_keys(msg) if k in personal_names]
    blob = _wire_bytes(msg)
    for v in personal_values:
        for pattern in (np.float64(v).tobytes(), np.float32(v).tobytes()):
            if pattern in blob:
                found.append(f"value {v!r}")
                break
    return found


# -- Flower simulation ---------------------------------------------------------------------
FFGG_RUN = {**SMALL, "num-rounds": 3, "clients-per-round": 5}
BR_RUN = {**SMALL, "algorithm": "br-ffgg", "aggregator": "cm", "bucket-size": 2,
          "byzantine-fraction": 0.25, "attack": "sign-flip", "num-rounds": 3,
          "clients-per-round": 6, "eval-every": 0}
ASYNC_RUN = {**SMALL, "mode": "async", "buffer-size": 1, "concurrency": 1, "num-rounds": 5,
             "eval-every": 0}
BUFFER_RUN = {**SMALL, "mode": "async", "buffer-size": 2, "concurrency": 3, "num-rounds": 4,
              "eval-every": 0}
ADAM_RUN = {**SMALL, "server-opt": "adam", "server-lr": 0.05, "schedule": "warmup-linear",
            "warmup-rounds": 1, "num-rounds": 3, "clients-per-round": 4, "eval-every": 0}
FEDAVG_RUN = {**SMALL, "algorithm": "fedavg", "num-rounds": 2, "eval-every": 1}
# partition 1 crashes in round 1; partition 0 is too slow in round 3 (last: it keeps an actor
# busy after the run)
FAULT_RUN = {**SMALL, "num-rounds": 4, "eval-every": 0, "round-timeout": 2.5,
             "fault-injection": "crash:partition=1,round=1; slow:partition=0,round=3,seconds=5"}


@pytest.fixture(scope="module")
def sims():
    """The four runs above, one after the other on one simulated federation of 2 SuperNodes
    (one Ray start-up); every message the server receives is captured per run. Ray is shut
    down after this module."""
    ray = pytest.importorskip("ray", reason="Flower's simulation engine needs "
                              "'flwr[simulation]' (ray)")
    from partialfl.flower.simulation import run_simulations

    runs = {"ffgg": FFGG_RUN, "br": BR_RUN, "async": ASYNC_RUN, "buffer": BUFFER_RUN,
            "adam": ADAM_RUN,
            "fedavg": FEDAVG_RUN, "faults": FAULT_RUN}
    received: dict[str, list[Message]] = {k: [] for k in runs}
    t0 = time.perf_counter()
    reports = run_simulations(list(runs.values()), num_supernodes=2, num_cpus=2,
                              message_hooks=[received[k].append for k in runs])
    seconds = time.perf_counter() - t0
    yield {k: (runs[k], rep, received[k]) for k, rep in zip(runs, reports)} | {
        "seconds": seconds}
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ffgg_sim(sims):
    return sims["ffgg"]


def test_simulation_reproduces_in_process_ffgg(ffgg_sim):
    run_config, report, _ = ffgg_sim
    problem, algorithm, res, _ = _in_process(run_config, 3, 5)
    assert report.server_steps == 3 and not report.failures
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    assert np.abs(report.theta["theta"]).max() > 0.1  # θ moved from θ⁰ = 0
    # per-round metrics: the same ‖θ − θ*‖² trajectory as the simulator, evaluation from nodes
    assert [h["round"] for h in report.history] == [0, 1, 2, 3]
    ref = {h["round"]: h for h in run_rounds(
        problem, algorithm, 3, clients_per_round=5, seed=run_config["seed"],
        evaluate=lambda a, s, p, c, x: {"rel": float(np.sum((s.theta["theta"] - p.theta_star()[
            "theta"]) ** 2) / np.sum(p.theta_star()["theta"] ** 2))}).history}
    for h in report.history:
        assert h["rel_dist2"] == pytest.approx(ref[h["round"]]["rel"], rel=1e-9)
        assert h["eval_clients"] == 8 and np.isfinite(h["eval_loss_gap"])
    assert all(h["clients"] == 5 for h in report.history[1:])
    gaps = [h["eval_loss_gap"] for h in report.history]
    assert gaps[-1] < gaps[0]


def test_no_personal_parameter_in_any_message_the_server_receives(ffgg_sim):
    run_config, report, received = ffgg_sim
    problem, algorithm, _, thetas = _in_process(run_config, 3, 5)
    cfg = parse_run_config(run_config)
    theta_hist = [problem.init_theta()["theta"], *thetas]
    solver = algorithm.solver
    # every w any client computed: training (round r, its cohort) and evaluation (round -1)
    values = []
    for r in range(4):
        th = {"theta": theta_hist[r]}
        if r < 3:
            cohort = sample_cohort(cfg.seed, r, problem.num_clients, 5)
            values.append(solver(problem, cohort, th, cfg.seed, r).w["w"].ravel())
        values.append(solver(problem, np.arange(problem.num_clients), th, cfg.seed, -1)
                      .w["w"].ravel())
    values = np.concatenate(values)
    values = values[values != 0]
    assert values.size > 100
    kinds = {m.metadata.message_type for m in received}
    assert {"query.describe", "train", "evaluate"} <= kinds
    assert len(received) == 2 + 2 * 4 + sum(  # describe + evaluate ×4 rounds + train replies
        len({int(c) * 2 // 8 for c in sample_cohort(cfg.seed, r, 8, 5)}) for r in range(3))
    for m in received:
        assert not m.has_error()
        assert _leaks(m, {"w"}, values) == [], m.metadata.message_type
    # the detector has teeth: a reply carrying w is caught by name and by value
    w = solver(problem, np.arange(3), {"theta": theta_hist[1]}, cfg.seed, 0).w
    leaky = ClientUpdates({"theta": np.zeros((3, problem.d_theta))}, np.ones(3), np.arange(3),
                          extra={"personal": w})
    msg = Message(encode_updates(leaky, ["theta"] + ["w"]), reply_to=received[-1])
    assert any(s.startswith("name") for s in _leaks(msg, {"w"}, values))
    assert any(s.startswith("value") for s in _leaks(msg, {"w"}, values))


def test_simulation_reproduces_in_process_br_ffgg(sims):
    """BR-FFGG (Algorithm 5): bucketed coordinate median, 2 of 8 clients Byzantine
    (sign flip), with the run-config keys of the Flower app."""
    run_config, report, _ = sims["br"]
    _, algorithm, res, _ = _in_process(run_config, 3, 6)
    assert type(algorithm).__name__ == "ByzantineRobust" and len(algorithm.byzantine.clients) == 2
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    # under the same attack, mean aggregation ends farther from θ* than the robust rule
    problem, _, mean_res, _ = _in_process({**SMALL, "byzantine-fraction": 0.25,
                                           "attack": "sign-flip"}, 3, 6)
    star = problem.theta_star()["theta"]
    assert np.sum((report.theta["theta"] - star) ** 2) < np.sum(
        (mean_res.state.theta["theta"] - star) ** 2)


@pytest.mark.parametrize("run", ["adam", "fedavg"])
def test_server_optimizer_and_fedavg_match_in_process(sims, run):
    """Adam with a warm-up/decay schedule keeps its moments on the server across rounds;
    FedAvg (Local GD) sends and averages the shared model (θ, w)."""
    run_config, report, _ = sims[run]
    rounds = run_config["num-rounds"]
    _, algorithm, res, _ = _in_process(run_config, rounds,
                                       run_config.get("clients-per-round") or None)
    assert set(report.theta) == set(res.state.theta)
    for n in res.state.theta:
        np.testing.assert_allclose(report.theta[n], res.state.theta[n], rtol=0, atol=1e-6)
    if run == "adam":
        assert type(algorithm.server_opt).__name__ == "Adam"
    else:
        assert set(report.theta) == {"theta", "w"}  # FedAvg: no personal parameters
        assert report.history[-1]["eval_loss_gap"] < report.history[0]["eval_loss_gap"]


def test_failures_do_not_stop_training(sims):
    """Partition 1 crashes in round 1 and partition 0 is too slow in round 3: each of those
    rounds aggregates the other node's clients; the report counts both failures."""
    run_config, report, _ = sims["faults"]
    assert report.server_steps == 4 and report.skipped_rounds == 0
    assert report.failure_counts == {"error": 1, "timeout": 1}
    assert report.failed_client_updates == 8
    (crash,) = [f for f in report.failures if f.kind == "error"]
    (slow,) = [f for f in report.failures if f.kind == "timeout"]
    assert (crash.round, crash.partition, crash.clients) == (1, 1, [4, 5, 6, 7])
    assert "injected crash" in crash.reason
    assert (slow.round, slow.partition, slow.clients) == (3, 0, [0, 1, 2, 3])
    assert [h.get("clients") for h in report.history] == [None, 8, 4, 8, 4]
    assert report.summary()["failed_client_updates"] == 8
    # θ is what the server update gives on exactly the surviving clients
    cfg = parse_run_config(run_config)
    problem = build_problem(cfg)
    alg = build_algorithm(cfg, problem)
    state = alg.init(problem, problem.init_theta())
    for r, alive in enumerate([np.arange(8), np.arange(4), np.arange(8), np.arange(4, 8)]):
        ctx = RoundContext(cfg.seed, r)
        state = alg.server_update(state, alg.client_update(state, problem, alive, ctx).updates,
                                  ctx)
    np.testing.assert_allclose(report.theta["theta"], state.theta["theta"], rtol=0, atol=1e-6)


def test_async_one_in_flight_is_sequential_ffgg(sims):
    """Algorithm 3 with one client in flight and buffer K = 1 applies every update at zero
    staleness: it is FFGG with one sampled client per round."""
    run_config, report, _ = sims["async"]
    _, _, res, _ = _in_process(run_config, 5, 1)
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    assert [h["staleness"] for h in report.history[1:]] == [[0]] * 5


def test_async_buffered_records_staleness(sims):
    """FedBuff-style K = 2 with 3 clients in flight: every server step applies exactly 2
    updates, each with its recorded staleness (server steps since its θ was sent)."""
    run_config, report, received = sims["buffer"]
    assert report.server_steps == 4 and not report.failures
    steps = report.history[1:]
    assert [h["round"] for h in steps] == [1, 2, 3, 4]
    assert all(h["clients"] == 2 and len(h["staleness"]) == 2 for h in steps)
    # staleness counts steps applied since the task was sent (applied at step r: < r); the
    # third task sent at version 0 cannot be in the first buffer, so some update is stale
    assert all(0 <= s < h["round"] for h in steps for s in h["staleness"])
    assert any(s > 0 for h in steps for s in h["staleness"])
    assert sum(m.metadata.message_type == "train" for m in received) >= 8
    assert steps[-1]["rel_dist2"] < report.history[0]["rel_dist2"]


# -- deployment: a SuperLink and two SuperNodes on 127.0.0.1 --------------------------------
@pytest.mark.slow  # ~1 min: real SuperLink and SuperNode processes (CI runs `pytest -m slow`)
def test_deployment_smoke():
    """`flwr run` against flower-superlink + 2 flower-supernode processes (insecure, loopback,
    free ports): two FFGG rounds give the simulator's θ and per-round metrics; every process
    started is stopped, also when the run fails."""
    import shutil
    import sys
    from pathlib import Path

    from partialfl.flower.project import LocalFederation

    if not (Path(sys.executable).parent / "flwr").exists() and shutil.which("flwr") is None:
        pytest.skip("the flwr command line is not installed")
    run_config = {**SMALL, "num-rounds": 2, "clients-per-round": 6, "eval-every": 2,
                  "round-timeout": 60.0}
    t0 = time.perf_counter()
    fed = LocalFederation(2)
    with fed:
        rep = fed.run(run_config, timeout=120)
    assert fed.alive_groups() == []
    assert time.perf_counter() - t0 < 90
    _, _, res, _ = _in_process(run_config, 2, 6)
    np.testing.assert_allclose(rep["theta"]["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    s = rep["summary"]
    assert s["server_steps"] == 2 and s["failures"] == 0
    hist = rep["history"]
    assert [h["round"] for h in hist] == [0, 1, 2]
    assert [h.get("clients") for h in hist] == [None, 6, 6]
    assert hist[2]["rel_dist2"] < hist[1]["rel_dist2"] < hist[0]["rel_dist2"] == 1.0
    assert "eval_loss_gap" in hist[0] and "eval_loss_gap" in hist[2]
    assert hist[2]["eval_loss_gap"] < hist[0]["eval_loss_gap"]
    assert sorted(n["partition-id"] for n in rep["nodes"]) == [0, 1]


@pytest.mark.slow
def test_flwr_run_against_a_simulation_superlink():
    """The command-line path of Flower's simulation: `flower-superlink --simulation` and
    `flwr run APP local --federation-config num-supernodes=2` (Ray inside flwr-simulation)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs 'flwr[simulation]'")
    from partialfl.flower.project import LocalFederation

    run_config = {**SMALL, "num-rounds": 2, "clients-per-round": 4, "eval-every": 0}
    fed = LocalFederation(2, simulation=True)
    with fed:
        rep = fed.run(run_config, timeout=240)
    assert fed.alive_groups() == []
    _, _, res, _ = _in_process(run_config, 2, 4)
    np.testing.assert_allclose(rep["theta"]["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    assert rep["summary"]["failures"] == 0 and len(rep["nodes"]) == 2


@pytest.mark.slow
@pytest.mark.data
def test_femnist_ffgg_and_local_ffgg_over_flower_match_in_process():
    """FEMNIST (output-layer split): one FFGG round and one Local FFGG (Algorithm 4) round of 4
    writers on 2 simulated SuperNodes give the in-process θ (float32, clients batched
    differently: 1e-5), and no personal parameter (the output layer) is in any message the
    server receives, by name or by value."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs 'flwr[simulation]'")
    from partialfl.data.paths import DataNotFoundError, resolve_data_file

    try:
        resolve_data_file("femnist_leaf_subset.npz")
    except DataNotFoundError as e:
        pytest.skip(f"FEMNIST data not available: {e}")
    from partialfl.flower.simulation import run_simulations

    ffgg = {"problem": "femnist", "algorithm": "ffgg", "local-lr": 0.01, "server-lr": 0.2,
            "clients-per-round": 4, "num-rounds": 1, "eval-every": 0}
    local = {**ffgg, "algorithm": "local-ffgg", "local-steps": 3, "server-lr": 1.0}
    received: list[Message] = []
    try:
        reports = run_simulations([ffgg, local], num_supernodes=2, num_cpus=2,
                                  message_hooks=[received.append, None])
    finally:
        import ray

        ray.shutdown()
    for run_config, report in zip([ffgg, local], reports):
        cfg = parse_run_config(run_config)
        problem = build_problem(cfg)
        algorithm = build_algorithm(cfg, problem)
        res = run_rounds(problem, algorithm, 1, clients_per_round=4, seed=cfg.seed)
        assert set(report.theta) == set(problem.theta_names)
        for n in problem.theta_names:
            np.testing.assert_allclose(report.theta[n], res.state.theta[n].numpy(), rtol=0,
                                       atol=1e-5)
        moved = max(float(np.abs(report.theta[n] - problem.init_theta()[n].numpy()).max())
                    for n in problem.theta_names)
        assert moved > 1e-4
    cfg = parse_run_config(ffgg)
    problem = build_problem(cfg)
    algorithm = build_algorithm(cfg, problem)
    # by name: no record key is a personal parameter's name
    personal = set(problem.w_names)
    assert personal and all(not (_record_keys(m) & personal) for m in received)
    # by value: no run of 16 values of any sampled client's fine-tuned personal rows (float32:
    # single values would collide by chance in megabytes of gradients) is in any message
    cohort = sample_cohort(cfg.seed, 0, problem.num_clients, 4)
    w = algorithm.solver(problem, cohort, problem.init_theta(), cfg.seed, 0).w
    rows = [r for v in w.values() for r in v.numpy().reshape(-1, v.shape[-1])]
    chunks = [r[:16].astype(np.float32).tobytes() for r in rows
              if r.size >= 16 and np.abs(r[:16]).sum() > 0]
    assert len(chunks) > 10
    for m in received:
        blob = _wire_bytes(m)
        assert not any(c in blob for c in chunks)


@pytest.mark.parametrize("name", ["fedavg", "ffgg", "fedalt"])
def test_a_server_without_data_initialises_every_model_algorithm(name):
    """A ServerApp holding no data sees only θ's names and shapes and the example counts
    (no personal names): model algorithms must initialise and report θ from that alone."""
    from partialfl.build import build_algorithm as build_model_algorithm
    from partialfl.flower.federation import ServerProblem as _ServerProblem
    from partialfl.spec import MethodConfig, StageConfig

    theta0 = {"fc.weight": np.ones((3, 4), np.float32), "fc.bias": np.zeros(3, np.float32)}
    stub = _ServerProblem(5, np.arange(1, 6), theta0)
    assert stub.w_names == () and stub.theta_shapes["fc.weight"] == (3, 4)
    split = "none" if name == "fedavg" else "output"  # the split lives on the clients
    alg = build_model_algorithm(MethodConfig(algorithm=name, split=split), StageConfig())
    state = alg.init(stub, theta0)
    got = alg.global_theta(state, stub)
    assert set(got) == set(theta0)
    np.testing.assert_array_equal(np.asarray(got["fc.weight"]), theta0["fc.weight"])
    np.testing.assert_array_equal(stub.num_examples(np.array([0, 4])), [1.0, 5.0])
