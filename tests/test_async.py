"""Asynchronous FFGG (Algorithm 3): runtimes, delays, baselines, Theorem 3's stepsize."""

from __future__ import annotations

import math

import numpy as np
import pytest

from partialfl import rng as prng
from partialfl.algorithms import FFGG, LocalGD, Scaffold
from partialfl.algorithms.asynchronous import FedAsync, FedBuff, joint_sgd, staleness_weight
from partialfl.algorithms.base import RoundContext, ServerState
from partialfl.build import make_solver
from partialfl.metrics import closed_form_metrics
from partialfl.problems.overpersonalized import OverpersonalizedLeastSquares
from partialfl.runtime import run_rounds, sample_cohort
from partialfl.runtime.asynchronous import (
    ComputeTimeModel,
    Distribution,
    device_speeds,
    recount_staleness,
    run_async,
    synchronous_round_times,
)
from partialfl.runtime.processes import run_processes
from partialfl.server import SGD
from partialfl.types import ClientUpdates

ZERO = ComputeTimeModel(Distribution("constant", 0.0))


@pytest.fixture(scope="module")
def problem():
    return OverpersonalizedLeastSquares(num_clients=8, n=200, d_theta=10, d_w=5, seed=0)


def metrics(alg, state, prob, cs, ctx):
    return closed_form_metrics(alg, state, prob, cs, ctx, with_loss=False)


def hetero_model(M=8, kind="exponential"):
    return ComputeTimeModel(Distribution(kind, 1.0, 1.5),
                            speed=np.geomspace(0.1, 2.0, M))


# ------------------------------------------------------------------ exact equivalence


@pytest.mark.parametrize("solver", [("cg", 3), ("gd", 5), ("exact", 1)])
def test_one_client_zero_delay_is_sequential_ffgg(problem, solver):
    alg = FFGG(make_solver(*solver), SGD(lr=1 / problem.L))
    sync = run_rounds(problem, alg, 150, clients_per_round=1, seed=7, evaluate=metrics,
                      eval_every=10)
    asyn = run_async(problem, alg, steps=150, concurrency=1, compute_time=ZERO, seed=7,
                     evaluate=metrics, eval_every=10)
    np.testing.assert_array_equal(asyn.state.theta["theta"], sync.state.theta["theta"])
    assert asyn.state.round == sync.state.round == 150
    assert [h["dist2"] for h in asyn.history] == [h["dist2"] for h in sync.history]
    np.testing.assert_array_equal(asyn.staleness, 0)
    # The same clients, in the same order.
    expected = [int(sample_cohort(7, r, problem.num_clients, 1)[0]) for r in range(150)]
    assert asyn.steps["client"].tolist() == expected


def test_one_client_positive_delay_is_still_sequential(problem):
    """With one active client there is never staleness, whatever the compute times."""
    alg = FFGG(make_solver("cg", 3), SGD(lr=1 / problem.L))
    sync = run_rounds(problem, alg, 60, clients_per_round=1, seed=1)
    asyn = run_async(problem, alg, steps=60, concurrency=1, compute_time=hetero_model(),
                     seed=1)
    np.testing.assert_array_equal(asyn.state.theta["theta"], sync.state.theta["theta"])
    assert (np.diff(asyn.steps["arrival_time"]) > 0).all()


# ------------------------------------------------------------------ delays and the event log


def replay(problem, alg, result, seed):
    """Recompute the run from its per-arrival records alone: every applied update must be
    the client's update at the θ version it received."""
    state = alg.init(problem, problem.init_theta())
    versions = {state.round: state}
    for i in range(len(result.steps["job"])):
        job, client, v = (int(result.steps[k][i]) for k in ("job", "client", "version"))
        res = alg.client_update(versions[v], problem, np.array([client]), RoundContext(seed, job))
        up = res.updates
        up = ClientUpdates(up.vectors, up.weights, up.cohort, up.grad_evals,
                           {"staleness": np.array([state.round - v])})
        state = alg.server_update(state, up, RoundContext(seed, i))
        versions[state.round] = state
    return state


@pytest.mark.parametrize("kind", ["exponential", "pareto", "log-normal", "half-normal"])
def test_staleness_matches_event_log_and_replay(problem, kind):
    alg = FFGG(make_solver("cg", 3), SGD(lr=0.5 / problem.L))
    res = run_async(problem, alg, steps=400, concurrency=4, compute_time=hetero_model(kind=kind),
                    seed=3)
    assert res.staleness.max() > 3  # fast and slow devices really overlap
    recount = recount_staleness(res.events)
    assert [recount[j] for j in res.steps["job"]] == res.staleness.tolist()
    # A second, naive recount: arrivals logged between a job's dispatch and its arrival.
    pos = {}
    arrivals_before = []
    n = 0
    for e in res.events:
        if e[0] == "dispatch":
            pos[e[2]] = n
        else:
            arrivals_before.append(n - pos[e[2]])
            n += 1
    assert arrivals_before == res.staleness.tolist()
    # Arrival times are non-decreasing and each job's duration is its model's draw.
    assert (np.diff(res.steps["arrival_time"]) >= 0).all()
    model = hetero_model(kind=kind)
    for i in range(0, 400, 37):
        d = model.job_duration(3, int(res.steps["job"][i]), int(res.steps["client"][i]), 200)
        assert res.steps["arrival_time"][i] - res.steps["dispatch_time"][i] == pytest.approx(d)
    # At most `concurrency` clients active, never the same client twice at once.
    active = set()
    for e in res.events:
        if e[0] == "dispatch":
            assert e[3] not in active
            active.add(e[3])
            assert len(active) <= 4
        else:
            active.remove(e[3])
    np.testing.assert_allclose(replay(problem, alg, res, 3).theta["theta"],
                               res.state.theta["theta"], rtol=0, atol=0)


def test_fedbuff_staleness_counts_server_steps(problem):
    alg = FedBuff(FFGG(make_solver("exact"), SGD(lr=0.5 / problem.L)), buffer_size=3)
    res = run_async(problem, alg, steps=90, concurrency=4, compute_time=hetero_model(), seed=2)
    assert res.state.round == 30  # θ changes every K = 3 arrivals
    changed = res.steps["round_after"] != res.steps["round_before"]
    assert changed.tolist() == [(i + 1) % 3 == 0 for i in range(90)]
    recount = recount_staleness(res.events)
    assert [recount[j] for j in res.steps["job"]] == res.staleness.tolist()


# ------------------------------------------------------------------ Theorem 3


def test_theorem3_stepsize_converges(problem):
    """γ = 1/(2L√(2Mτ_max)) (the paper's Theorem 3) converges to θ* under real delays.

    Compute times do not depend on θ, so τ_max is measured by a first run and is the same in
    the second one, which uses the theorem's stepsize."""
    model = ComputeTimeModel(Distribution("constant", 1.0), speed=np.geomspace(0.2, 1.0, 8))
    probe = run_async(problem, FFGG(make_solver("exact"), SGD(lr=1e-3)), steps=6000,
                      concurrency=4, compute_time=model, seed=0, record_events=False)
    tau_max = int(probe.staleness.max())
    assert tau_max >= 3
    M, L = problem.num_clients, problem.L
    gamma = 1 / (2 * L * math.sqrt(2 * M * tau_max))
    res = run_async(problem, FFGG(make_solver("exact"), SGD(lr=gamma)), steps=6000,
                    concurrency=4, compute_time=model, seed=0, evaluate=metrics,
                    eval_every=1000, record_events=False)
    assert int(res.staleness.max()) == tau_max
    errs = [h["rel_dist2"] for h in res.history]
    assert errs[-1] < 1e-6
    assert all(b < a for a, b in zip(errs, errs[1:]))


# ------------------------------------------------------------------ compute-time models


@pytest.mark.parametrize("dist", [Distribution("constant", 2.0), Distribution("exponential", 2.0),
                                  Distribution("half-normal", 2.0),
                                  Distribution("log-normal", 2.0, 0.5),
                                  Distribution("pareto", 2.0, 3.0)])
def test_distribution_means(dist):
    x = dist.sample(np.random.default_rng(0), 200_000)
    assert (x >= 0).all()
    assert x.mean() == pytest.approx(dist.mean(), rel=0.02)
    if dist.kind == "pareto":
        assert x.min() >= 2.0


def test_distributions_are_registered_components_of_the_spec():
    """Each duration distribution is one registry entry whose options are its own fields;
    [asynchronous] names one with its options, validated on load."""
    from partialfl.config import ConfigError, from_dict
    from partialfl.pipeline.closed_form import compute_time
    from partialfl.registry import names
    from partialfl.runtime.asynchronous import Exponential, LogNormal, Pareto
    from partialfl.spec import RunSpec

    assert names("distribution") == ("constant", "exponential", "half-normal", "log-normal",
                                     "pareto")
    assert Distribution("exponential", 2.0, 7.0) == Exponential(2.0)  # no shape: ignored
    assert Distribution("pareto", 2.0, 3.0) == Pareto(2.0, 3.0)

    def spec(duration):
        return from_dict(RunSpec, {"problem": {"name": "least-squares", "num_clients": 4},
                                   "asynchronous": {"duration": duration}})

    model = compute_time(spec({"name": "log-normal", "scale": 2.0, "shape": 0.5}), 4)
    assert model.per_job == LogNormal(2.0, 0.5)
    assert spec("constant").asynchronous.duration.build().deterministic
    assert from_dict(RunSpec, {"problem": {"name": "least-squares"}, "asynchronous": {}}
                     ).asynchronous.duration.build() == Exponential(1.0)
    with pytest.raises(ConfigError, match=r"unknown key 'asynchronous.duration.shape'"):
        spec({"name": "constant", "shape": 2.0})
    with pytest.raises(ConfigError, match="pareto distribution: shape must be finite and > 0"):
        spec({"name": "pareto", "shape": 0})
    with pytest.raises(ConfigError, match="'gamma' is not allowed; allowed: constant"):
        spec("gamma")


def test_compute_time_model():
    rng = np.random.default_rng(0)
    m = ComputeTimeModel(Distribution("constant", 1.0), Distribution("constant", 0.01),
                         speed=[1.0, 4.0])
    assert m.duration(0, 100, rng) == pytest.approx(2.0)
    assert m.duration(1, 100, rng) == pytest.approx(0.5)
    per_client = ComputeTimeModel((Distribution("constant", 3.0), Distribution("constant", 5.0)))
    assert per_client.duration(1, 10, rng) == 5.0
    with pytest.raises(ValueError, match="2 per_job entries for 3 clients"):
        per_client.check(3)
    # The per-example part really sums n draws.
    ex = ComputeTimeModel(Distribution("constant", 0.0), Distribution("exponential", 1.0))
    draws = [ex.duration(0, 400, np.random.default_rng(s)) for s in range(200)]
    assert np.mean(draws) == pytest.approx(400, rel=0.02)
    sp = device_speeds(64, Distribution("log-normal", 1.0, 1.0), seed=0)
    assert sp.max() / sp.min() > 10
    with pytest.raises(ValueError, match="unknown distribution 'gamma'"):
        Distribution("gamma")
    with pytest.raises(ValueError, match="scale must be"):
        Distribution("exponential", -1.0)
    with pytest.raises(ValueError, match="speeds must be positive"):
        ComputeTimeModel(speed=[1.0, 0.0])


def test_synchronous_round_times(problem):
    model = hetero_model()
    t = synchronous_round_times(model, problem, 20, 3, seed=4)
    assert t[0] == 0 and (np.diff(t) > 0).all()
    for r in (0, 7, 19):
        cohort = sample_cohort(4, r, problem.num_clients, 3)
        d = max(model.duration(int(m), 200, prng.generator(4, "compute-time-sync", r, int(m)))
                for m in cohort)
        assert t[r + 1] - t[r] == pytest.approx(d)


# ------------------------------------------------------------------ baselines


def test_joint_sgd_is_a_gradient_step_on_the_shared_model(problem):
    alg = joint_sgd(0.05)
    state = alg.init(problem, problem.init_theta())
    state.theta["w"] = np.linspace(-1, 1, problem.d_w)
    cohort = np.array([2, 5])
    up = alg.client_update(state, problem, cohort, RoundContext(0, 0)).updates
    new = alg.server_update(state, up, RoundContext(0, 0))
    th = {"theta": np.repeat(state.theta["theta"][None], 2, 0)}
    w = {"w": np.repeat(state.theta["w"][None], 2, 0)}
    gt = problem.grad_theta(cohort, th, w)["theta"].mean(0)
    gw = problem.grad_w(cohort, th, w)["w"].mean(0)
    np.testing.assert_allclose(new.theta["theta"], state.theta["theta"] - 0.05 * gt, atol=1e-12)
    np.testing.assert_allclose(new.theta["w"], state.theta["w"] - 0.05 * gw, atol=1e-12)


def _one(v, tau):
    return ClientUpdates({"theta": np.array([[v]])}, np.ones(1), np.array([0]),
                         metrics={"staleness": np.array([tau])})


def test_fedasync_and_fedbuff_by_hand():
    class Toy(FFGG):
        def init(self, problem, theta0):
            return ServerState({"theta": np.zeros(1)}, self.server_opt.init(theta0))

    ctx = RoundContext(0, 0)
    base = Toy(make_solver("exact"), SGD(lr=1.0))
    fa = FedAsync(base, "polynomial", a=0.5)
    s = fa.init(None, {"theta": np.zeros(1)})
    s = fa.server_update(s, _one(2.0, 3), ctx)  # θ − 1·(1+3)^-½·2 = −1
    np.testing.assert_allclose(s.theta["theta"], [-1.0])
    fb = FedBuff(base, buffer_size=2, staleness="polynomial", a=1.0)
    s = fb.init(None, {"theta": np.zeros(1)})
    s1 = fb.server_update(s, _one(4.0, 1), ctx)
    assert s1.round == 0 and s1.theta["theta"][0] == 0.0  # buffered
    s2 = fb.server_update(s1, _one(6.0, 2), ctx)  # mean(4/2, 6/3) = 2
    assert s2.round == 1 and s2.extra["buffer"] == ()
    np.testing.assert_allclose(s2.theta["theta"], [-2.0])
    np.testing.assert_allclose(staleness_weight([0, 1, 10], "hinge", a=0.5, b=4),
                               [1, 1, 1 / 4])
    with pytest.raises(ValueError, match="staleness of each update"):
        fa.server_update(s, ClientUpdates({"theta": np.ones((1, 1))}, np.ones(1),
                                          np.array([0])), ctx)
    with pytest.raises(ValueError, match="buffer size K"):
        FedBuff(base, 0)
    with pytest.raises(ValueError, match="unknown staleness function 'exp'"):
        FedAsync(base, "exp")


def test_async_baselines_run_and_stateful_clients(problem):
    for alg in (FedAsync(joint_sgd(0.5 / float(problem.L_joint_clients.max()))),
                FedBuff(LocalGD(tau=3), buffer_size=2)):
        res = run_async(problem, alg, steps=200, concurrency=3, compute_time=hetero_model(),
                        seed=0, evaluate=metrics, eval_every=50)
        assert np.isfinite(res.history[-1]["dist2"])
        assert res.history[-1]["dist2"] < res.history[0]["dist2"]
    sc = Scaffold(tau=2)
    res = run_async(problem, sc, steps=20, concurrency=2, compute_time=hetero_model(), seed=0)
    touched = np.unique(res.steps["client"])
    moved = np.abs(res.client_state["c_theta"]).sum(1) > 0
    assert set(np.flatnonzero(moved)) == set(touched.tolist())


def test_async_validation(problem):
    alg = FFGG(make_solver("exact"), SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"concurrency must be an integer in \[1, 8\]"):
        run_async(problem, alg, steps=5, concurrency=9)
    with pytest.raises(ValueError, match="steps .* and/or max_time"):
        run_async(problem, alg)
    res = run_async(problem, alg, max_time=5.0, concurrency=2, compute_time=hetero_model(),
                    seed=0)
    assert res.steps["arrival_time"].max() <= 5.0
    assert res.history[-1]["step"] == len(res.staleness)


# ------------------------------------------------------------------ real processes


def test_processes_one_worker_matches_sequential(problem):
    alg = FFGG(make_solver("cg", 3), SGD(lr=1 / problem.L))
    sync = run_rounds(problem, alg, 25, clients_per_round=1, seed=5)
    res = run_processes(problem, alg, steps=25, concurrency=1, compute_time=ZERO, seed=5)
    np.testing.assert_array_equal(res.state.theta["theta"], sync.state.theta["theta"])


def test_processes_really_run_concurrently_at_different_speeds(problem):
    alg = FFGG(make_solver("cg", 3), SGD(lr=0.5 / problem.L))
    # Clients 0-3 take 60 ms per job, clients 4-7 take 6 ms.
    model = ComputeTimeModel(Distribution("constant", 1.0), speed=[1, 1, 1, 1, 10, 10, 10, 10])
    res = run_processes(problem, alg, steps=60, concurrency=2, compute_time=model,
                        time_unit=0.06, seed=0)
    assert len(res.staleness) == 60
    recount = recount_staleness(res.events)
    assert [recount[j] for j in res.steps["job"]] == res.staleness.tolist()
    assert res.staleness.max() >= 2  # fast clients overtook slow ones
    durations = res.steps["arrival_time"] - res.steps["dispatch_time"]
    slow = res.steps["client"] < 4
    assert durations[slow].min() >= 0.06 * 0.95  # slow devices really took their time
    np.testing.assert_allclose(replay(problem, alg, res, 0).theta["theta"],
                               res.state.theta["theta"], rtol=0, atol=0)


@pytest.mark.slow
def test_reproduce_async_quick(tmp_path):
    from partialfl.reproductions.asynchronous import reproduce_async
    from partialfl.runtime import read_jsonl

    summary = reproduce_async(tmp_path, quick=True, progress=False)
    text = summary.read_text()
    assert "| async FFGG |" in text and "Real concurrency" in text
    # the paired comparison with async FFGG: one seed at the quick size, so no interval
    assert "orders of magnitude below async FFGG [95% CI]" in text
    assert "| sync FFGG |" in text and "(one seed: no interval)" in text
    from _summaries import check_standalone_summary

    check_standalone_summary(text, quick=True)
    for name in ("async_error_steps.png", "async_error_time.png", "async_delays.png"):
        assert (tmp_path / name).stat().st_size > 0
    recs = read_jsonl(tmp_path / "async_seed0.jsonl")
    best = {}
    for r in recs:
        if "dist2" in r:
            key = (r["method"], r["stepsize"])
            best[key] = r  # last record of each run
    by_method = {}
    for (m, _), r in best.items():
        by_method[m] = min(by_method.get(m, np.inf), r["rel_dist2"])
    # Within the same simulated time, async FFGG beats sync FFGG and both shared-model methods.
    assert by_method["async FFGG"] < 1e-3 * by_method["sync FFGG"]
    assert by_method["async FFGG"] < 1e-6 * by_method["async SGD (shared model)"]
    assert by_method["async FFGG"] < 1e-6 * by_method["FedBuff (shared model)"]


@pytest.mark.parametrize("private", [True, False])
def test_checkpoint_and_resume_give_the_uninterrupted_run(problem, tmp_path, private):
    """An asynchronous run stopped after 9 updates and resumed from its checkpoint (jobs in
    flight sent again with the θ they had received) is the uninterrupted run: θ, the clients'
    state (Scaffold's c_m, FedBuff's buffer), records and events, bit for bit."""
    from partialfl.runtime.checkpoint import CLIENT, Checkpoint
    from partialfl.runtime.sync import ResumeError

    for alg in (FFGG(make_solver("cg", 3), SGD(lr=0.5 / problem.L)),
                FedBuff(Scaffold(tau=2), buffer_size=2)):
        kw = dict(concurrency=3, compute_time=hetero_model(), seed=2, evaluate=metrics,
                  eval_every=4)
        full = run_async(problem, alg, steps=20, **kw)
        ck = tmp_path / f"{alg.name}-{private}.ckpt"
        ckw = dict(checkpoint=ck, checkpoint_every=4, private_checkpoints=private)
        first = run_async(problem, alg, steps=9, **ckw, **kw)
        assert first.steps["job"].size == 9
        assert (CLIENT in Checkpoint(ck, kind="async").files()) == private
        calls = []
        update = alg.client_update  # count the client computations of the resumed run
        alg.client_update = lambda *a, c=calls, u=update, **k: c.append(1) or u(*a, **k)
        try:
            res = run_async(problem, alg, steps=20, resume=True, **ckw, **kw)
        finally:
            del alg.client_update
        # the 2 jobs in flight at step 9 again, the freed slot's job, a job after each of
        # arrivals 10..19 (an uninterrupted run computes 3 + 19)
        assert len(calls) == 2 + 1 + 10
        for n in full.state.theta:
            np.testing.assert_array_equal(res.state.theta[n], full.state.theta[n])
        if full.client_state is not None:
            for n in full.client_state:
                np.testing.assert_array_equal(res.client_state[n], full.client_state[n])
        assert res.events == full.events
        assert [h["step"] for h in res.history] == [h["step"] for h in full.history]
        assert [h["dist2"] for h in res.history] == [h["dist2"] for h in full.history]
        with pytest.raises(ResumeError, match="seed"):
            run_async(problem, alg, steps=20, resume=True, **ckw, **{**kw, "seed": 3})


@pytest.mark.slow
def test_processes_with_theta_in_shared_memory_equal_the_simulated_run():
    """A model problem (θ of torch tensors, sent through each worker's shared copy of θ):
    the worker processes' θ is the simulated clock's bit for bit (one slot: same order)."""
    import torch
    from _nn_toy import max_diff, one_thread, toy_data, toy_model

    from partialfl.algorithms.model import FedAvg
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    p = ModelProblem(make_split(toy_model(), "none"), toy_data(6), vectorize=False)
    alg = FedAvg(SGDConfig(lr=0.1, batch_size=4))
    with one_thread():
        sim = run_async(p, alg, steps=6, concurrency=1, compute_time=ZERO, seed=2)
        real = run_processes(p, alg, steps=6, concurrency=1, compute_time=ZERO, seed=2)
    assert isinstance(next(iter(real.state.theta.values())), torch.Tensor)
    assert max_diff(sim.state.theta, real.state.theta) == 0 and real.faults.lost == 0
