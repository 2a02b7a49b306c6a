"""partialfl on Flower: the simulation reproduces the in-process run of the same spec (FFGG,
robust FFGG, Adam, FedAvg, Local FFGG, async), `partialfl run --engine flower-sim`, no
personal parameter in any message the server receives, failure handling. Live SuperNodes:
test_flower_live.py.

Skipped (with the reason) when the optional extra is missing: ``pip install
'partialfl[flower]'`` (flwr >= 1.42; the simulation tests also need ``flwr[simulation]``).
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

from partialfl.flower.env import apply_flower_env

apply_flower_env()  # before flwr is imported: no telemetry, no update check, no `uv sync`
flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from _flower_sims import in_process, ls_run  # noqa: E402
from flwr.app import Message  # noqa: E402

from partialfl.algorithms.base import RoundContext  # noqa: E402
from partialfl.flower.codec import (  # noqa: E402
    PrivacyError,
    WireFormatError,
    decode_updates,
    encode_updates,
)
from partialfl.flower.config import parse_run_config  # noqa: E402
from partialfl.runtime.sync import sample_cohort  # noqa: E402
from partialfl.types import ClientUpdates  # noqa: E402


def _registered(kind: str, name: str) -> bool:
    from partialfl.registry import canonical

    return canonical(kind, name) is not None


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
FFGG_RUN = ls_run(3, 5, eval_every=1)
BR_RUN = ls_run(3, 6, spec={"aggregation": {"name": "cm"},
                            "attack": {"name": "byzantine", "fraction": 0.25,
                                       "attack": "sign-flip"}})
ASYNC_RUN = ls_run(5, spec={"asynchronous": {"rule": "fedasync", "concurrency": 1}})
# rounds count applied updates, as in process: 8 = 4 server steps of K = 2
BUFFER_RUN = ls_run(8, spec={"asynchronous": {"rule": {"name": "fedbuff", "buffer": 2},
                                              "concurrency": 3}})
ADAM_RUN = ls_run(3, 4, spec={"personalize": {"server": {
    "optimizer": "adam", "lr": 0.05, "schedule": {"name": "warmup-linear", "warmup": 1}}}})
FEDAVG_RUN = ls_run(2, eval_every=1, spec={"method": {"algorithm": "fedavg"},
                                           "personalize": {"client": {"name": "gd", "tau": 5}}})
LOCAL_FFGG_RUN = ls_run(3, 4, spec={"method": {"algorithm": "local-ffgg", "local_steps": 3},
                                    "personalize": {"client": {"name": "gd", "tau": 5},
                                                    "server": {"lr": 0.5}}})
# client-level DP (central, fixed clipping, Poisson sampling): the same noise seeds
DP_RUN = ls_run(3, 4, eval_every=1, spec={"privacy": {"name": "dp", "clip_norm": 1.0,
                                                      "noise_multiplier": 0.5}})
# partition 1 crashes in round 1; partition 0 is too slow in round 3 (last: it keeps an actor
# busy after the run)
FAULT_RUN = ls_run(4, round_timeout=2.5, fault_injection="crash:partition=1,round=1; "
                   "slow:partition=0,round=3,seconds=5")


@pytest.fixture(scope="module")
def sims():
    """The runs above, one after the other on one simulated federation of 2 SuperNodes (one
    Ray start-up); every message the server receives is captured per run. Ray is shut down
    after this module."""
    ray = pytest.importorskip("ray", reason="Flower's simulation engine needs "
                              "'flwr[simulation]' (ray)")
    from partialfl.flower.simulation import run_simulations

    runs = {"ffgg": FFGG_RUN, "async": ASYNC_RUN, "buffer": BUFFER_RUN, "adam": ADAM_RUN,
            "fedavg": FEDAVG_RUN, "local-ffgg": LOCAL_FFGG_RUN, "faults": FAULT_RUN}
    if importlib.util.find_spec("dp_accounting") is not None:  # the [dp] extra
        runs["dp"] = DP_RUN
    if _registered("aggregator", "cm") and _registered("wrapper", "byzantine"):
        runs["br"] = BR_RUN
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


def _thetas(run_config):
    """θ after every round of the in-process run."""
    out = []
    from partialfl.build import build
    from partialfl.runtime.sync import run_rounds

    spec = parse_run_config(run_config).run
    built = build(spec)
    st = spec.personalize
    run_rounds(built.problem, built.algorithm, st.rounds, clients_per_round=st.clients_per_round,
               seed=spec.seed, on_round=lambda r, s: out.append(s.theta["theta"]))
    return built, out


def test_simulation_reproduces_in_process_ffgg(ffgg_sim):
    run_config, report, _ = ffgg_sim
    _, res = in_process(run_config)
    assert report.server_steps == 3 and not report.failures
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    assert np.abs(report.theta["theta"]).max() > 0.1  # θ moved from θ⁰ = 0
    # per-round metrics: the in-process run's ‖θ − θ*‖² and loss gap, evaluation from nodes
    assert [h["round"] for h in report.history] == [0, 1, 2, 3]
    ref = {h["round"]: h for h in res.history}
    for h in report.history:
        assert h["rel_dist2"] == pytest.approx(ref[h["round"]]["rel_dist2"], rel=1e-9)
        assert h["eval_clients"] == 8
        assert h["eval_loss_gap"] == pytest.approx(ref[h["round"]]["loss_gap"], rel=1e-9)
    assert all(h["clients"] == 5 for h in report.history[1:])
    gaps = [h["eval_loss_gap"] for h in report.history]
    assert gaps[-1] < gaps[0]


def test_no_personal_parameter_in_any_message_the_server_receives(ffgg_sim):
    run_config, report, received = ffgg_sim
    built, thetas = _thetas(run_config)
    problem, algorithm = built.problem, built.algorithm
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


def test_simulation_reproduces_in_process_robust_ffgg(sims):
    """BR-FFGG (Algorithm 5): the spec's [aggregation] (coordinate median) and [attack]
    (2 of 8 clients Byzantine, sign flip) blocks on Flower."""
    if "br" not in sims:
        pytest.skip("the registry has no 'cm' aggregator / 'byzantine' wrapper entries")
    run_config, report, _ = sims["br"]
    built, res = in_process(run_config)
    assert type(built.algorithm).__name__ == "ByzantineRobust"
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("run", ["adam", "fedavg", "local-ffgg"])
def test_server_optimizer_and_other_algorithms_match_in_process(sims, run):
    """Adam with a warm-up/decay schedule keeps its moments on the server across rounds;
    FedAvg (Local GD) sends and averages the shared model (θ, w); Local FFGG (Algorithm 4):
    all built from the spec, as in process."""
    run_config, report, _ = sims[run]
    built, res = in_process(run_config)
    assert set(report.theta) == set(res.state.theta)
    for n in res.state.theta:
        np.testing.assert_allclose(report.theta[n], res.state.theta[n], rtol=0, atol=1e-6)
    assert max(np.abs(v).max() for v in report.theta.values()) > 0.1
    if run == "adam":
        assert type(built.algorithm.server_opt).__name__ == "Adam"
    elif run == "fedavg":
        assert set(report.theta) == {"theta", "w"}  # FedAvg: no personal parameters
        assert report.history[-1]["eval_loss_gap"] < report.history[0]["eval_loss_gap"]
    else:
        assert type(built.algorithm).__name__ == "LocalFFGG"


def test_dp_on_the_simulation_engine_is_the_in_process_run(sims):
    """The spec's [privacy] block on Flower's simulation engine: the ClientApps clip in the DP
    wrapper's client update, the ServerApp samples Poisson cohorts and noises the sum with the
    same seeds, so θ and ε equal the in-process run's (tests/test_dp_flower.py has the modes,
    adaptive clipping and SecAgg+)."""
    if "dp" not in sims:
        pytest.skip("DP needs dp-accounting: pip install 'partialfl[dp]'")
    run_config, report, _ = sims["dp"]
    built, res = in_process(run_config)
    assert type(built.algorithm).__name__ == "DifferentiallyPrivate"
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    eps = [h["dp_epsilon"] for h in report.history]
    assert eps == pytest.approx([h["dp_epsilon"] for h in res.history], rel=0, abs=1e-6)
    assert [h["round"] for h in report.history] == [0, 1, 2, 3] and eps[-1] > eps[1] > 0


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
    built, _ = in_process(run_config)
    problem, alg = built.problem, built.algorithm
    state = alg.init(problem, problem.init_theta())
    for r, alive in enumerate([np.arange(8), np.arange(4), np.arange(8), np.arange(4, 8)]):
        ctx = RoundContext(3, r)
        state = alg.server_update(state, alg.client_update(state, problem, alive, ctx).updates,
                                  ctx)
    np.testing.assert_allclose(report.theta["theta"], state.theta["theta"], rtol=0, atol=1e-6)


def test_async_one_in_flight_is_sequential_ffgg(sims):
    """Algorithm 3 with one client in flight applies every update at zero staleness
    (FedAsync's weight s(0) = 1): it is FFGG with one sampled client per round."""
    run_config, report, _ = sims["async"]
    _, res = in_process(ls_run(5, 1))
    np.testing.assert_allclose(report.theta["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)
    assert [h["staleness"] for h in report.history[1:]] == [[0]] * 5


def test_async_buffered_records_staleness(sims):
    """FedBuff K = 2 with 3 clients in flight: every server step applies exactly 2 updates,
    each with its recorded staleness (server steps since its θ was sent)."""
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


# -- the command line: `partialfl run CONFIG --engine flower-sim` ------------------------------
@pytest.mark.slow  # ~1 min: a simulation SuperLink and `flwr run` (Ray inside flwr-simulation)
def test_partialfl_run_on_flower_sim_gives_the_in_process_run(tmp_path):
    """configs/ls-ffgg.toml (small) through `flower-superlink --simulation` and `flwr run`:
    θ equals the in-process run's, and the run folder has the in-process files (JSONL with
    the same evaluated rounds and ‖θ − θ*‖², plot, summary)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs 'flwr[simulation]'")
    import json
    from pathlib import Path

    from partialfl.cli import main
    from partialfl.pipeline.train import load_run_spec
    from partialfl.runtime.logging import read_jsonl

    config = Path(__file__).resolve().parents[1] / "configs" / "ls-ffgg.toml"
    sets = ["problem.num_clients=8", "problem.n=200", "problem.d_theta=10", "problem.d_w=5",
            "personalize.rounds=3", "personalize.clients_per_round=4",
            "personalize.eval_every=1"]
    argv = [a for o in sets for a in ("--set", o)]
    assert main(["run", str(config), "--out", str(tmp_path / "local"), "--no-progress",
                 *argv]) == 0
    assert main(["run", str(config), "--engine", "flower-sim", "--out", str(tmp_path / "sim"),
                 "--no-progress", *argv]) == 0
    local = read_jsonl(tmp_path / "local" / "ls-ffgg.jsonl")
    sim = read_jsonl(tmp_path / "sim" / "ls-ffgg.jsonl")
    assert [h["round"] for h in sim] == [h["round"] for h in local] == [0, 1, 2, 3]
    for a, b in zip(sim, local):
        assert a["rel_dist2"] == pytest.approx(b["rel_dist2"], rel=1e-9)
        assert a["loss_gap"] == pytest.approx(b["loss_gap"], rel=1e-9)
    spec = load_run_spec(config, sets)
    _, res = in_process({"spec": spec})
    with np.load(tmp_path / "sim" / "flower" / "theta.npz") as z:
        np.testing.assert_allclose(z["theta"], res.state.theta["theta"], rtol=0, atol=1e-6)
    files = {p.name for p in (tmp_path / "sim").iterdir()}
    assert {p.name for p in (tmp_path / "local").iterdir()} <= files
    result = json.loads((tmp_path / "sim" / "flower" / "result.json").read_text())
    assert result["config"]["spec"]["problem"]["num_clients"] == 8


@pytest.mark.parametrize("name", ["fedavg", "ffgg", "fedalt"])
def test_a_server_without_data_initialises_every_model_algorithm(name):
    """A ServerApp holding no data sees only θ's names and shapes and the example counts
    (no personal names): model algorithms must initialise and report θ from that alone."""
    from partialfl.build import stage_algorithm
    from partialfl.flower.federation import ServerProblem as _ServerProblem
    from partialfl.spec import RunSpec

    theta0 = {"fc.weight": np.ones((3, 4), np.float32), "fc.bias": np.zeros(3, np.float32)}
    stub = _ServerProblem(5, np.arange(1, 6), theta0)
    assert stub.w_names == () and stub.theta_shapes["fc.weight"] == (3, 4)
    split = "none" if name == "fedavg" else "output"  # the split lives on the clients
    spec = RunSpec.from_dict({"method": {"algorithm": name, "split": split}})
    alg = stage_algorithm(spec, "personalize", num_clients=5)
    state = alg.init(stub, theta0)
    got = alg.global_theta(state, stub)
    assert set(got) == set(theta0)
    np.testing.assert_array_equal(np.asarray(got["fc.weight"]), theta0["fc.weight"])
    np.testing.assert_array_equal(stub.num_examples(np.array([0, 4])), [1.0, 5.0])
