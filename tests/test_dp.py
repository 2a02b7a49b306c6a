"""Client-level DP of θ (partialfl.algorithms.dp, partialfl.dp_accounting, partialfl.sampling):
the accountant against dp-accounting called directly, clipping, the noise and its seeding,
exact equality with the non-private run at z = 0 without clipping, personal parameters never
clipped/noised/sent, adaptive clipping, sampling, and the refusals."""

from __future__ import annotations

import math
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data, toy_model

from partialfl import rng as prng
from partialfl.aggregation import Mean
from partialfl.aggregation.robust import CoordinateMedian
from partialfl.algorithms import FFGG, Algorithm, ClientResult, FedAlt, LocalFFGG, Scaffold
from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.ditto import Ditto
from partialfl.algorithms.dp import (
    UNCLIPPED,
    DifferentiallyPrivate,
    DPOptions,
    PrivacyBudgetError,
    make_plan,
)
from partialfl.algorithms.model import FedAvg
from partialfl.dp_accounting import Mechanism, epsilon, solve_noise_multiplier
from partialfl.local.sgd import SGDConfig
from partialfl.local.solvers import ExactSolver
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.problems.model import ModelProblem
from partialfl.runtime import run_rounds
from partialfl.runtime.faults import ClientFaultError, FaultInjector
from partialfl.sampling import poisson_cohort
from partialfl.server import SGD
from partialfl.split import make_split
from partialfl.types import ClientUpdates

CFG = SGDConfig(lr=0.2, batch_size=4)


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def ls():
    return LeastSquaresProblem(LeastSquaresSpec(num_clients=12, n=40, d_theta=6, d_w=3, seed=1))


def _model_problem(kind):
    return ModelProblem(make_split(toy_model(0), kind), toy_data(), vectorize=False)


class Fixed(Algorithm):
    """A synthetic client: client m always sends ``rows[m]`` (θ-gradients), whatever θ."""

    name = "fixed"

    def __init__(self, rows: np.ndarray, lr: float = 1.0) -> None:
        super().__init__(SGD(lr))
        self.rows = np.asarray(rows, dtype=np.float64)

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        cohort = np.asarray(cohort)
        return ClientResult(ClientUpdates({"theta": self.rows[cohort].copy()},
                                          np.ones(len(cohort)), cohort, 1))


def _fixed_problem(M: int, d: int):
    return types.SimpleNamespace(num_clients=M, d=d)


class Spy(DifferentiallyPrivate):
    """Records every ClientUpdates the server receives."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def server_update(self, state, updates, ctx):
        self.seen.append((ctx.round, updates))
        return super().server_update(state, updates, ctx)


# ----------------------------------------------------------------------------- accounting

def test_accountant_epsilon_is_dp_accounting_called_directly():
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    rel = dpa.NeighboringRelation
    z, M, k, R, delta = 1.3, 200, 20, 30, 1e-4
    poisson = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(k / M, dpa.GaussianDpEvent(z)),
                                      R)
    direct = {
        ("poisson", False, "rdp"): RdpAccountant().compose(poisson).get_epsilon(delta),
        ("poisson", False, "pld"): PLDAccountant().compose(
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(k / M, dpa.GaussianDpEvent(z)),
                                    5)).get_epsilon(delta),
        # fixed-size sampling: replace-one neighbours, sum sensitivity 2C -> z/2
        ("fixed", False, "rdp"): RdpAccountant(neighboring_relation=rel.REPLACE_ONE).compose(
            dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(
                M, k, dpa.GaussianDpEvent(z / 2)), R)).get_epsilon(delta),
        # local DP: one client's message, sensitivity 2C, no amplification, every round
        ("poisson", True, "rdp"): RdpAccountant().compose(
            dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z / 2), R)).get_epsilon(delta),
    }
    for (sampling, local, acc), want in direct.items():
        rounds = 5 if acc == "pld" else R
        got = epsilon(Mechanism(z, M, k, sampling, local), rounds, delta, acc)
        assert got == pytest.approx(want, rel=1e-12), (sampling, local, acc)
    # full participation is the Gaussian mechanism with z/√R: the analytic ε (Balle & Wang)
    exact = dpa.get_epsilon_gaussian(z / math.sqrt(R), delta)
    assert epsilon(Mechanism(z, M, M, "poisson"), R, delta, "pld") == pytest.approx(exact,
                                                                                     rel=2e-3)
    assert epsilon(Mechanism(0.0, M, k), R, delta) == math.inf
    assert epsilon(Mechanism(z, M, k), 0, delta) == 0.0


def test_solved_noise_multiplier_meets_the_target_epsilon_tightly():
    pytest.importorskip("dp_accounting")
    mech, R, delta = Mechanism(0.0, 500, 25), 100, 1e-5
    for target in (1.0, 4.0):
        z = solve_noise_multiplier(mech, target, R, delta)
        at = Mechanism(z, 500, 25)
        assert epsilon(at, R, delta) <= target
        assert epsilon(Mechanism(z - 2e-3, 500, 25), R, delta) > target  # near the optimum
    plan = make_plan(DPOptions(target_epsilon=2.0, rounds=R, clients_per_round=25,
                               delta=delta), 500)
    assert 2.0 - 1e-3 < plan.epsilon_budget <= 2.0


def test_a_config_that_cannot_meet_its_target_refuses_to_start(ls):
    pytest.importorskip("dp_accounting")
    opts = DPOptions(noise_multiplier=0.3, target_epsilon=1.0, rounds=50, clients_per_round=4)
    alg = DifferentiallyPrivate(FFGG(ExactSolver(), SGD(0.1)), opts)
    with pytest.raises(PrivacyBudgetError, match=r"target_epsilon=1: .*z=0\.3.*k=4 of M=12.*"
                                                 r"rounds=50 at delta=0\.0833"):
        run_rounds(ls, alg, 5, seed=0)
    # adaptive clipping: the count noise must leave room for the update noise
    bad = DPOptions(noise_multiplier=1.0, clients_per_round=4, adaptive_clipping=True,
                    clip_count_std=0.4)
    with pytest.raises(PrivacyBudgetError, match="clip_count_std=0.4 must exceed z/2=0.5"):
        make_plan(bad, 12)
    # the budget's rounds bound the run
    ok = DPOptions(target_epsilon=5.0, rounds=3, clients_per_round=4)
    with pytest.raises(PrivacyBudgetError, match="rounds=3; round 3"):
        run_rounds(ls, DifferentiallyPrivate(FFGG(ExactSolver(), SGD(0.1)), ok), 4, seed=0)


# ----------------------------------------------------------------------------- clipping, noise

def test_clipping_bounds_every_clients_contribution_even_a_huge_one():
    M, d, C = 8, 5, 1.0
    g = np.random.default_rng(0)
    rows = 0.1 * g.standard_normal((M, d))
    rows[3] *= 1e7  # one huge client
    opts = DPOptions(clip_norm=C, noise_multiplier=0.0, sampling="fixed", clients_per_round=M)
    alg = Spy(Fixed(rows, lr=1.0), opts)
    res = run_rounds(_fixed_problem(M, d), alg, 1, theta0={"theta": np.zeros(d)}, seed=0)
    (_, up), = alg.seen
    sent = up.vectors["theta"]
    norms = np.linalg.norm(sent, axis=1)
    assert norms.max() <= C * (1 + 1e-12)
    assert norms[3] == pytest.approx(C)  # the huge client is clipped to exactly C
    small = np.arange(M) != 3
    assert np.array_equal(sent[small], rows[small])  # the others pass unchanged
    # the server's step: -(Σ ũ_m)/k, so the huge client moves θ by at most C/k
    without = -(sent[small].sum(0)) / M
    assert np.linalg.norm(res.state.theta["theta"] - without) == pytest.approx(C / M)


def test_central_noise_is_drawn_from_seed_dp_noise_round_with_std_zC_over_k():
    M, d, C, z, k = 10, 7, 0.5, 2.0, 5
    alg = DifferentiallyPrivate(Fixed(np.zeros((M, d)), lr=1.0),
                                DPOptions(clip_norm=C, noise_multiplier=z, sampling="fixed",
                                          clients_per_round=k))
    res = run_rounds(_fixed_problem(M, d), alg, 3, theta0={"theta": np.zeros(d)}, seed=11)
    want = -sum(prng.generator(11, "dp-noise", r).standard_normal(d) for r in range(3)) * z * C / k
    np.testing.assert_allclose(res.state.theta["theta"], want, rtol=1e-12, atol=1e-15)
    again = run_rounds(_fixed_problem(M, d), alg, 3, theta0={"theta": np.zeros(d)}, seed=11)
    assert np.array_equal(again.state.theta["theta"], res.state.theta["theta"])


def test_local_dp_each_client_noises_its_own_clipped_update():
    M, d, C, z = 6, 4, 1.0, 0.7
    rows = 5 * np.random.default_rng(1).standard_normal((M, d))
    alg = Spy(Fixed(rows), DPOptions(clip_norm=C, noise_multiplier=z, mode="local",
                                     sampling="fixed", clients_per_round=3))
    res = run_rounds(_fixed_problem(M, d), alg, 1, theta0={"theta": np.zeros(d)}, seed=4)
    (_, up), = alg.seen
    for i, m in enumerate(up.cohort):
        clipped = rows[m] * min(1.0, C / np.linalg.norm(rows[m]))
        noise = prng.generator(4, "dp-noise", 0, int(m)).standard_normal(d) * z * C
        np.testing.assert_allclose(up.vectors["theta"][i], clipped + noise, rtol=1e-12)
    # no server noise in local mode: θ = −mean of what was sent
    np.testing.assert_allclose(res.state.theta["theta"], -up.vectors["theta"].mean(0),
                               rtol=1e-12)


# ----------------------------------------------------------------------------- equivalence

NONPRIVATE = dict(clip_norm=None, noise_multiplier=0.0)


@pytest.mark.parametrize("sampling,k", [("fixed", 5), ("poisson", None)])
def test_noise_zero_without_clipping_is_the_non_private_run_bit_for_bit_least_squares(
        ls, sampling, k):
    def make():
        return FFGG(ExactSolver(), SGD(1.0 / ls.L))

    ref = run_rounds(ls, make(), 6, clients_per_round=k, seed=3)
    dp = run_rounds(ls, DifferentiallyPrivate(make(), DPOptions(**NONPRIVATE, sampling=sampling,
                                                                clients_per_round=k)),
                    6, seed=3)
    assert np.array_equal(dp.state.theta["theta"], ref.state.theta["theta"])
    assert dp.history[-1]["dp_epsilon"] == math.inf


@pytest.mark.parametrize("name", ["fedalt", "local-ffgg", "fedavg"])
def test_noise_zero_without_clipping_is_the_non_private_run_bit_for_bit_model(name):
    make, kind = {"fedalt": (lambda: FedAlt(CFG), "output"),
                  "local-ffgg": (lambda: LocalFFGG(CFG, SGDConfig(lr=0.2, batch_size=4,
                                                                  steps=2)), "output"),
                  "fedavg": (lambda: FedAvg(CFG), "none")}[name]
    pb = _model_problem(kind)
    ref = run_rounds(pb, make(), 3, clients_per_round=3, seed=2)
    dp = run_rounds(pb, DifferentiallyPrivate(make(), DPOptions(**NONPRIVATE, sampling="fixed",
                                                                clients_per_round=3)),
                    3, seed=2)
    for n, v in ref.state.theta.items():
        assert torch.equal(dp.state.theta[n], v), n
    if ref.client_state is not None:
        for n, v in ref.client_state.items():
            assert torch.equal(dp.client_state[n], v), n


# ----------------------------------------------------------------------------- personal part

@pytest.mark.parametrize("mode", ["central", "local"])
@pytest.mark.parametrize("name", ["fedalt", "ditto"])
def test_personal_parameters_are_never_clipped_noised_or_sent(name, mode):
    if name == "fedalt":
        pb, make = _model_problem("output"), lambda: FedAlt(CFG)
    else:
        pb = _model_problem("none")
        make = lambda: Ditto(CFG, SGDConfig(lr=0.1, batch_size=4), 0.5)  # noqa: E731
    personal = set(pb.w_names) | {n for n in (make().init_client_state(pb) or {})}
    opts = DPOptions(clip_norm=1e-3, noise_multiplier=1.0, mode=mode, sampling="fixed",
                     clients_per_round=3)
    alg = Spy(make(), opts)
    res = run_rounds(pb, alg, 2, seed=5)
    for _, up in alg.seen:  # what the server received: clipped θ only, nothing personal
        assert set(up.vectors) == set(res.state.theta) and not set(up.vectors) & personal
        assert not up.extra and set(up.metrics) <= set(alg.server_metrics)
        if mode == "central":
            flat = torch.cat([v.reshape(v.shape[0], -1) for v in up.vectors.values()], 1)
            assert flat.double().norm(dim=1).max() <= 1e-3 * (1 + 1e-5)
    # one client update, DP vs the base on the same inputs: the personal state is the same
    state = alg.init(pb, pb.init_theta())
    cohort = alg.sample_cohort(5, 0, pb.num_clients)
    cs0 = make().init_client_state(pb)
    rows = None if cs0 is None else {n: v[cohort] for n, v in cs0.items()}
    ctx = RoundContext(5, 0)
    ours = alg.client_update(state, pb, cohort, ctx, rows)
    base = make().client_update(state, pb, cohort, ctx, rows)
    for n, v in base.client_state.items():
        assert torch.equal(ours.client_state[n], v), n
    assert any(not torch.equal(ours.updates.vectors[n], v)  # the θ message was clipped
               for n, v in base.updates.vectors.items())


# ----------------------------------------------------------------------------- adaptive clipping

@pytest.mark.parametrize("gamma", [0.2, 0.5, 0.8])
def test_adaptive_clipping_follows_the_target_quantile(gamma):
    M, d = 200, 3
    g = np.random.default_rng(2)
    norms = np.exp(g.normal(0.0, 1.0, M))  # lognormal update norms
    dirs = g.standard_normal((M, d))
    rows = dirs / np.linalg.norm(dirs, axis=1, keepdims=True) * norms[:, None]
    opts = DPOptions(clip_norm=0.1, noise_multiplier=0.0, adaptive_clipping=True,
                     target_quantile=gamma, clients_per_round=M)
    res = run_rounds(_fixed_problem(M, d), DifferentiallyPrivate(Fixed(rows), opts),
                     120, theta0={"theta": np.zeros(d)}, seed=0)
    clips = np.array([h["dp_clip_norm"] for h in res.history])
    tail = clips[-20:]
    unclipped = np.array([(norms <= c).mean() for c in tail])
    assert np.all(np.abs(unclipped - gamma) <= 0.02)
    assert np.quantile(norms, gamma) == pytest.approx(np.median(tail), rel=0.1)
    assert clips[0] == 0.1 and abs((norms <= 0.1).mean() - gamma) > 0.1  # it had to move


def test_adaptive_clipping_with_noise_still_tracks_the_quantile():
    pytest.importorskip("dp_accounting")
    M, d, gamma = 400, 3, 0.5
    g = np.random.default_rng(3)
    norms = np.exp(g.normal(0.0, 1.0, M))
    dirs = g.standard_normal((M, d))
    rows = dirs / np.linalg.norm(dirs, axis=1, keepdims=True) * norms[:, None]
    opts = DPOptions(clip_norm=0.1, noise_multiplier=1.0, adaptive_clipping=True,
                     clients_per_round=100, target_quantile=gamma)
    alg = DifferentiallyPrivate(Fixed(rows), opts)
    plan = make_plan(opts, M)
    assert plan.clip_count_std == 5.0 and plan.update_noise > 1.0  # k/20; z_Δ > z
    assert plan.update_noise == pytest.approx((1.0 - (2 * 5.0) ** -2) ** -0.5)
    res = run_rounds(_fixed_problem(M, d), alg, 150, theta0={"theta": np.zeros(d)}, seed=0,
                     eval_every=150)
    clip = res.state.extra["dp_clip_norm"]
    assert abs((norms <= clip).mean() - gamma) < 0.1


# ----------------------------------------------------------------------------- sampling

def test_poisson_sampling_is_reproducible_with_binomial_sizes_and_used_by_the_run():
    M, q = 50, 0.2
    sizes = [len(poisson_cohort(0, r, M, q)) for r in range(400)]
    assert abs(np.mean(sizes) - M * q) < 0.5 and np.var(sizes) == pytest.approx(
        M * q * (1 - q), rel=0.25)
    assert np.array_equal(poisson_cohort(0, 7, M, q), poisson_cohort(0, 7, M, q))
    alg = Spy(Fixed(np.ones((M, 2))), DPOptions(clip_norm=1.0, noise_multiplier=0.0,
                                                 clients_per_round=10))
    run_rounds(_fixed_problem(M, 2), alg, 5, theta0={"theta": np.zeros(2)}, seed=9)
    for r, up in alg.seen:
        assert np.array_equal(up.cohort, poisson_cohort(9, r, M, q))
        assert np.all(up.weights == 1.0)


def test_a_round_with_nobody_sampled_still_releases_the_noise():
    M, d, C, z = 100, 3, 1.0, 1.5
    opts = DPOptions(clip_norm=C, noise_multiplier=z, clients_per_round=1)  # q = 0.01
    empty = [r for r in range(20) if len(poisson_cohort(1, r, M, 0.01)) == 0]
    assert empty  # P(empty) = 0.99^100 ≈ 0.37
    alg = Spy(Fixed(np.zeros((M, d))), opts)
    theta = {"theta": np.zeros(d)}
    steps = []
    run_rounds(_fixed_problem(M, d), alg, 20, theta0=theta, seed=1,
               on_round=lambda r, s: steps.append(s.theta["theta"].copy()))
    r = empty[0]
    before = steps[r - 1] if r else np.zeros(d)
    noise = prng.generator(1, "dp-noise", r).standard_normal(d) * z * C / 1
    np.testing.assert_allclose(steps[r] - before, -noise, rtol=1e-12)
    assert all(len(up.cohort) for _, up in alg.seen if _ not in empty)


# ----------------------------------------------------------------------------- refusals

def test_refusals_name_the_problem(ls):
    opts = DPOptions(noise_multiplier=0.0, clients_per_round=4)
    with pytest.raises(ValueError, match="uniform weighting"):
        DifferentiallyPrivate(FFGG(ExactSolver(), weighting="examples"), opts)
    with pytest.raises(ValueError, match="not Mean"):
        DifferentiallyPrivate(FFGG(ExactSolver(), aggregator=CoordinateMedian()), opts)
    with pytest.raises(ValueError, match="own server step"):
        DifferentiallyPrivate(Scaffold(tau=1), opts)
    with pytest.raises(ValueError, match="plain algorithm"):
        DifferentiallyPrivate(FaultInjector(FFGG(ExactSolver())), opts)
    with pytest.raises(ValueError, match="noise_multiplier or target_epsilon"):
        DPOptions()
    with pytest.raises(ValueError, match="no guarantee"):
        DPOptions(clip_norm=None, noise_multiplier=1.0)
    for z in (None, 1.0):  # a finite target is checked (or solved for) over the rounds
        with pytest.raises(ValueError, match="target_epsilon needs rounds"):
            make_plan(DPOptions(target_epsilon=1.0, noise_multiplier=z), 10)
    with pytest.raises(ValueError, match="sampling='uniform'; allowed: poisson, fixed"):
        DPOptions(noise_multiplier=1.0, sampling="uniform")
    for bad, msg in ((dict(delta=1.0), "delta must be in"), (dict(delta="x"), "delta must be a "
                      "number"), (dict(clip_norm=0.0), "clip_norm must be > 0"),
                     (dict(noise_multiplier=-1.0), "noise_multiplier must be >= 0"),
                     (dict(target_quantile=1.0), "target_quantile must be in"),
                     (dict(adaptive_clipping="yes"), "adaptive_clipping must be true or false")):
        with pytest.raises(ValueError, match=msg):
            DPOptions(**{"noise_multiplier": 1.0, **bad})
    with pytest.raises(ValueError, match="adaptive clipping needs mode 'central'"):
        DPOptions(noise_multiplier=1.0, mode="local", adaptive_clipping=True)
    with pytest.raises(ValueError, match="clients_per_round=20 exceeds the 12 clients"):
        make_plan(DPOptions(noise_multiplier=0.0, clients_per_round=20), 12)
    alg = DifferentiallyPrivate(FFGG(ExactSolver(), SGD(0.1)), opts)
    with pytest.raises(ValueError, match="clients_per_round=4 in its options.*asked "
                                         "clients_per_round=3"):
        run_rounds(ls, alg, 1, clients_per_round=3)
    # under another wrapper the runtime cannot ask DP for its cohorts: every client DP did
    # not sample refuses (skipped as a failed client), and the run aborts naming why
    hidden = FaultInjector(DifferentiallyPrivate(FFGG(ExactSolver(), SGD(0.1)), opts))
    with pytest.raises(ClientFaultError, match="not drawn by its poisson sampling"):
        run_rounds(ls, hidden, 4)
    # an asynchronous runtime's update
    state = alg.init(ls, ls.init_theta(None))
    up = ClientUpdates({"theta": np.zeros((1, ls.d_theta))}, np.ones(1), np.array([0]),
                       metrics={"staleness": np.zeros(1)})
    with pytest.raises(ValueError, match="synchronous rounds"):
        alg.server_update(state, up, RoundContext(0, 0))


def test_adaptive_bit_is_a_server_metric_and_train_loss_stays_on_the_client():
    pb = _model_problem("output")
    alg = Spy(FedAlt(CFG), DPOptions(clip_norm=0.5, noise_multiplier=0.0, sampling="fixed",
                                     clients_per_round=3, adaptive_clipping=True))
    run_rounds(pb, alg, 1, seed=0)
    (_, up), = alg.seen
    assert set(up.metrics) == {UNCLIPPED} and set(np.unique(up.metrics[UNCLIPPED])) <= {0, 1}
    assert Mean in {type(alg.base.aggregator)}


# ----------------------------------------------------------------------------- resume, docs

def test_a_dp_run_resumes_exactly_from_its_checkpoint(tmp_path, ls):
    pytest.importorskip("dp_accounting")
    opts = DPOptions(clip_norm=0.05, noise_multiplier=1.0, adaptive_clipping=True,
                     clip_count_std=1.0, clients_per_round=4)

    def make():
        return DifferentiallyPrivate(FFGG(ExactSolver(), SGD(1.0 / ls.L)), opts)

    full = run_rounds(ls, make(), 6, seed=2, eval_every=3)
    ck = tmp_path / "run.ckpt"
    run_rounds(ls, make(), 3, seed=2, checkpoint=ck, checkpoint_every=3, eval_every=3)
    res = run_rounds(ls, make(), 6, seed=2, checkpoint=ck, checkpoint_every=3, resume=True,
                     eval_every=3)
    assert np.array_equal(res.state.theta["theta"], full.state.theta["theta"])
    assert res.state.extra["dp_clip_norm"] == full.state.extra["dp_clip_norm"] != 0.05
    assert res.history == [{**h, "time": r["time"]} for h, r in zip(full.history, res.history)]


def test_the_docs_example_runs_and_meets_its_target():
    pytest.importorskip("dp_accounting")
    root = Path(__file__).resolve().parents[1]
    (block,) = re.findall(r"```python\n(.*?)```", (root / "docs" / "dp.md").read_text(), re.S)
    ns: dict = {}
    exec(compile(block, "docs/dp.md python block", "exec"), ns)
    last = ns["last"]
    assert last["round"] == 100 and 7.99 < last["dp_epsilon"] <= 8.0
    assert last["dp_noise_multiplier"] == pytest.approx(1.28, abs=0.01)
    assert last["rel_dist2"] == pytest.approx(0.0026, abs=1e-4)  # the value the page states


_SPEC = ('seed = 0\n[problem]\nname = "least-squares"\nnum_clients = 50\nn = 20\nd_theta = 5\n'
         'd_w = 2\n[method]\nalgorithm = "ffgg"\n{privacy}[personalize]\nrounds = 30\n'
         'clients_per_round = 10\neval_every = 10\nclient = {{ name = "gd", tau = 3 }}\n')


def _run_spec(tmp_path, name, privacy):
    import json

    from partialfl.cli import main

    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(_SPEC.format(privacy=privacy))
    assert main(["run", str(cfg), "--no-progress", "--out", str(tmp_path / name)]) == 0
    lines = (tmp_path / name / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], (tmp_path / name / "summary.md").read_text()


def test_privacy_block_in_a_toml_spec(tmp_path):
    """``[privacy]`` from TOML: rounds and cohort size come from the stage, z is solved for
    the target ε (reached, not exceeded, at the last round), ε is in every record and in the
    summary; with z = 0 and no clipping the run equals the non-private one bit for bit."""
    dp, summary = _run_spec(tmp_path, "dp", '[privacy]\nname = "dp"\nclip_norm = 1.0\n'
                            'target_epsilon = 3.0\n')
    assert [r["round"] for r in dp] == [0, 10, 20, 30]
    eps = [r["dp_epsilon"] for r in dp[1:]]
    assert dp[0]["dp_epsilon"] == 0 and eps[0] < eps[1] < eps[2] <= 3.0 and eps[2] > 2.9
    direct = epsilon(Mechanism(dp[-1]["dp_noise_multiplier"], 50, 10, "poisson", False), 30,
                     1 / 50, "rdp")
    assert eps[2] == pytest.approx(direct, rel=1e-9)
    assert "ε = 3.00" in summary and "δ = 0.02" in summary
    plain, _ = _run_spec(tmp_path, "plain", "")
    off, _ = _run_spec(tmp_path, "off", '[privacy]\nname = "dp"\nclip_norm = "none"\n'
                       'noise_multiplier = 0.0\nsampling = "fixed"\n')  # k of M, as without DP
    for a, b in zip(plain, off, strict=True):
        assert a["rel_dist2"] == b["rel_dist2"] and a["F_norm2"] == b["F_norm2"]
    assert dp[-1]["rel_dist2"] > plain[-1]["rel_dist2"]  # the noise costs accuracy
