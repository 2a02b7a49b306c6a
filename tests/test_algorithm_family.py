"""One algorithm family over any problem: FedAvg = Local GD on least squares and on a model
problem, Scaffold on a model problem (against a hand-written loop), FedAlt and Local FFGG on
least squares (against θ*, w*(θ*) and a brute-force loop on the raw matrices)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model
from conftest import SMALL, rel
from torch.func import functional_call

from partialfl.algorithms import L2GD, FedAlt, FedAvg, LocalFFGG, LocalGD, Scaffold
from partialfl.algorithms.base import RoundContext
from partialfl.data.federated import FederatedDataset
from partialfl.local import GradientDescent
from partialfl.local.gd import GDConfig
from partialfl.local.sgd import SGDConfig, SGDFineTuner, client_plans
from partialfl.problems import GeneralizedLinearProblem, GLMSpec
from partialfl.problems.least_squares import LeastSquaresProblem, generate_raw
from partialfl.problems.model import ModelProblem
from partialfl.runtime import run_rounds
from partialfl.runtime.sync import sample_cohort
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def std():
    return LeastSquaresProblem(SMALL, basis="standard")


def _double_problem(num_clients=4, vectorize=True):
    """The toy CNN and data in float64 (so hand-written loops agree to 1e-10), split none."""
    d = toy_data(num_clients)
    dd = FederatedDataset([x.double() for x in d.train_x], d.train_y,
                          [x.double() for x in d.test_x], d.test_y, d.client_ids, d.num_classes)
    return ModelProblem(make_split(toy_model(0).double(), "none"), dd, vectorize=vectorize)


def _client_loss(pb, m):
    """f_m as a function of the parameters, written directly on the module (mean
    cross-entropy over client m's training examples)."""
    x, y = pb.data.train_x[m], pb.data.train_y[m]

    def f(params):
        out = functional_call(pb.module, params, (x,))
        return torch.nn.functional.cross_entropy(out, y)

    return f


def _grad(f, params):
    p = {n: v.detach().clone().requires_grad_(True) for n, v in params.items()}
    gs = torch.autograd.grad(f(p), list(p.values()))
    return dict(zip(p, gs, strict=True))


def test_local_gd_is_fedavg_with_full_gradient_steps(std):
    """The same class: LocalGD is FedAvg with GDConfig and a shared w; both give the same
    iterates, and the step-by-step path equals the closed form."""
    alg = LocalGD(tau=4)
    assert isinstance(alg, FedAvg)
    a = run_rounds(std, alg, 6, clients_per_round=3, seed=4)
    b = run_rounds(std, FedAvg(GDConfig(4), share_w=True), 6, clients_per_round=3, seed=4)
    c = run_rounds(std, FedAvg(GDConfig(4, fast=False), share_w=True), 6, clients_per_round=3,
                   seed=4)
    for n in ("theta", "w"):
        assert np.array_equal(a.state.theta[n], b.state.theta[n])
        assert rel(c.state.theta[n], a.state.theta[n]) < 1e-10
    with pytest.raises(ValueError, match="split 'none'"):
        FedAvg(GDConfig(1)).init(std, std.init_theta())


def test_fedavg_full_gradient_and_full_batch_sgd_agree_on_a_model():
    """FedAvg with one GD step and FedAvg with one full-batch SGD epoch are the same update."""
    pb = _double_problem(3, vectorize=False)
    n = int(pb.num_examples(np.arange(3)).max())
    th0 = pb.init_theta()
    res = {}
    for name, local in (("gd", GDConfig(1, lr=0.3)), ("sgd", SGDConfig(lr=0.3, batch_size=n))):
        res[name] = run_rounds(pb, FedAvg(local), 2, seed=0, theta0=th0).state.theta
    assert max_diff(res["gd"], th0) > 1e-3
    assert max_diff(res["gd"], res["sgd"]) < 1e-7


@pytest.mark.parametrize("vectorize", [True, False])
def test_scaffold_on_a_cnn_matches_a_hand_written_loop(vectorize):
    M, tau, eta, R = 4, 3, 0.05, 4
    pb = _double_problem(M, vectorize)
    th0 = pb.init_theta()
    res = run_rounds(pb, Scaffold(tau, lr=eta), R, seed=0, theta0=th0)
    # brute force: Karimireddy et al.'s option II, full participation, global step 1
    fs = [_client_loss(pb, m) for m in range(M)]
    x = {n: v.clone() for n, v in th0.items()}
    c = {n: torch.zeros_like(v) for n, v in x.items()}
    cm = [{n: torch.zeros_like(v) for n, v in x.items()} for _ in range(M)]
    losses = [float(np.mean([fs[m](x).item() for m in range(M)]))]
    for _ in range(R):
        dys, dcs = [], []
        for m in range(M):
            y = {n: v.clone() for n, v in x.items()}
            for _ in range(tau):
                g = _grad(fs[m], y)
                y = {n: y[n] - eta * (g[n] - cm[m][n] + c[n]) for n in y}
            new = {n: cm[m][n] - c[n] + (x[n] - y[n]) / (tau * eta) for n in x}
            dys.append({n: y[n] - x[n] for n in x})
            dcs.append({n: new[n] - cm[m][n] for n in x})
            cm[m] = new
        x = {n: x[n] + sum(d[n] for d in dys) / M for n in x}
        c = {n: c[n] + sum(d[n] for d in dcs) / M for n in x}
        losses.append(float(np.mean([fs[m](x).item() for m in range(M)])))
    assert max_diff(res.state.theta, x) < 1e-6
    for m in range(M):
        assert max_diff({n: res.client_state[f"c_{n}"][m] for n in x}, cm[m]) < 1e-6
    assert max_diff(res.state.extra["c"], c) < 1e-6
    allc = np.arange(M)
    f0, fR = pb.loss(allc, th0, {}).mean(), pb.loss(allc, res.state.theta, {}).mean()
    assert fR < f0 and fR == pytest.approx(losses[-1], rel=1e-8)


def test_scaffold_with_minibatch_sgd_on_a_cnn_matches_a_hand_written_loop():
    """Scaffold with SGD local steps: the same minibatches (the library's plan), each step
    corrected by c − c_m; τ_m = the steps client m took (uneven client sizes)."""
    M, R, cfg = 3, 2, SGDConfig(lr=0.05, batch_size=4, epochs=1)
    pb = _double_problem(M)
    th0 = pb.init_theta()
    res = run_rounds(pb, Scaffold(local=cfg), R, seed=3, theta0=th0)
    x = {n: v.clone() for n, v in th0.items()}
    c = {n: torch.zeros_like(v) for n, v in x.items()}
    cm = [{n: torch.zeros_like(v) for n, v in x.items()} for _ in range(M)]
    for r in range(R):
        dys, dcs = [], []
        for m in range(M):
            xs, ys = pb.data.train_x[m], pb.data.train_y[m]
            plan = client_plans(pb, np.array([m]), cfg, 3, r, "local")[0]
            y = {n: v.clone() for n, v in x.items()}
            for idx in plan:
                idx = torch.as_tensor(idx)

                def f(p, idx=idx, xs=xs, ys=ys):
                    out = functional_call(pb.module, p, (xs[idx],))
                    return torch.nn.functional.cross_entropy(out, ys[idx])

                g = _grad(f, y)
                y = {n: y[n] - cfg.lr * (g[n] - cm[m][n] + c[n]) for n in y}
            new = {n: cm[m][n] - c[n] + (x[n] - y[n]) / (len(plan) * cfg.lr) for n in x}
            dys.append({n: y[n] - x[n] for n in x})
            dcs.append({n: new[n] - cm[m][n] for n in x})
            cm[m] = new
        x = {n: x[n] + sum(d[n] for d in dys) / M for n in x}
        c = {n: c[n] + sum(d[n] for d in dcs) / M for n in x}
    assert max_diff(res.state.theta, x) < 1e-6
    assert max_diff(res.state.extra["c"], c) < 1e-6
    assert max_diff(res.state.theta, th0) > 1e-3


def test_fedalt_on_least_squares_converges_to_theta_star_and_w_star():
    """FedAlt with full-gradient phases (w: 5 steps, θ: 1 step, one stepsize for all clients)
    is block coordinate descent on Σ_m f_m(θ, w_m): it converges to θ* and w*_m(θ*)."""
    pb = LeastSquaresProblem(SMALL, basis="eigen")
    lr = 1.0 / float(pb.L_joint_clients.max())
    res = run_rounds(pb, FedAlt(GDConfig(5, lr), w_init="zero", local_theta=GDConfig(1, lr)),
                     1200)
    star = pb.theta_star()
    assert rel(res.state.theta["theta"], star["theta"]) < 1e-7
    ws = pb.w_star(np.arange(SMALL.num_clients), star)["w"]
    assert np.abs(res.client_state["w"] - ws).max() < 1e-6


def test_fedalt_on_a_glm_converges_to_its_theta_star():
    """The same FedAlt on a problem that is not quadratic (Example 3, softplus link): θ* and
    w*_m(θ*) from the problem's own Newton solves."""
    pb = GeneralizedLinearProblem(GLMSpec(num_clients=4, n=30, d_theta=5, d_w=3, seed=0))
    lr = 1.0 / (pb.L + float(pb.lipschitz_w(np.arange(4)).max()))
    res = run_rounds(pb, FedAlt(GDConfig(5, lr), w_init="zero", local_theta=GDConfig(1, lr)),
                     800)
    star = pb.theta_star()
    assert rel(res.state.theta["theta"], star["theta"]) < 1e-8
    assert np.abs(res.client_state["w"] - pb.w_star(np.arange(4), star)["w"]).max() < 1e-8


def _raw_grads(raw, theta, w):
    """∇₁f_m, ∇₂f_m of f_m = ½‖Hθ − b‖² + ½‖Aθ + Bw − y‖² from the raw matrices."""
    H, b, A, B, y = raw
    r = A @ theta + B @ w - y
    return H.T @ (H @ theta - b) + A.T @ r, B.T @ r


def test_fedalt_and_local_ffgg_on_least_squares_match_brute_force(std):
    """Partial participation, several θ-steps: the library's rounds equal a loop on the raw
    data, round by round (the runtime's sampled cohorts)."""
    raw = list(generate_raw(SMALL))
    eta, tw, tt, R = 0.02, 3, 2, 5
    alg = FedAlt(GDConfig(tw, eta), w_init="zero", local_theta=GDConfig(tt, eta))
    res = run_rounds(std, alg, R, clients_per_round=3, seed=5)
    theta = np.zeros(SMALL.d_theta)
    W = np.zeros((SMALL.num_clients, SMALL.d_w))
    for r in range(R):
        deltas = []
        for m in sample_cohort(5, r, SMALL.num_clients, 3):
            for _ in range(tw):
                W[m] = W[m] - eta * _raw_grads(raw[m], theta, W[m])[1]
            t = theta.copy()
            for _ in range(tt):
                t = t - eta * _raw_grads(raw[m], t, W[m])[0]
            deltas.append(t - theta)
        theta = theta + np.mean(deltas, 0)
    assert rel(res.state.theta["theta"], theta) < 1e-10
    assert rel(res.client_state["w"], W) < 1e-10
    # Local FFGG (Algorithm 4) with full gradients: w-run, then alternating steps
    lf = run_rounds(std, LocalFFGG(GDConfig(2, eta), GDConfig(3, eta), w_init="zero"), 1,
                    seed=0)
    deltas = []
    for m in range(SMALL.num_clients):
        w = np.zeros(SMALL.d_w)
        for _ in range(2):
            w = w - eta * _raw_grads(raw[m], np.zeros(SMALL.d_theta), w)[1]
        t = np.zeros(SMALL.d_theta)
        for _ in range(3):
            w = w - eta * _raw_grads(raw[m], t, w)[1]
            t = t - eta * _raw_grads(raw[m], t, w)[0]
        deltas.append(t)
    assert rel(lf.state.theta["theta"], np.mean(deltas, 0)) < 1e-10


def test_gd_fine_tuner_runs_on_a_model_like_full_batch_sgd():
    """FFGG's GD fine-tuner (Algorithm 2) on a model problem: τ full-gradient w-steps from 0
    equal τ full-batch SGD epochs from 0."""
    d = toy_data(3)
    dd = FederatedDataset([x.double() for x in d.train_x], d.train_y,
                          [x.double() for x in d.test_x], d.test_y, d.client_ids, d.num_classes)
    pb = ModelProblem(make_split(toy_model(0).double(), "output"), dd, vectorize=False)
    c, th = np.arange(3), pb.init_theta()
    n = int(pb.num_examples(c).max())
    gd = GradientDescent(3, lr=0.2, init="zero")(pb, c, th).w
    sgd = SGDFineTuner(SGDConfig(lr=0.2, epochs=3, batch_size=n), "zero")(pb, c, th).w
    assert max_diff(gd, sgd) < 1e-7 and max(v.abs().max().item() for v in gd.values()) > 1e-3


def test_bad_arguments_are_named():
    pb = _double_problem(2)
    alg = FedAvg(GDConfig(1))  # lr None: 1/L_m, unknown for a network
    state = alg.init(pb, pb.init_theta())
    with pytest.raises(TypeError, match="explicit lr"):
        alg.client_update(state, pb, np.array([0]), RoundContext(0, 0))
    for kw in ({}, {"tau": 2, "local": GDConfig(2)}):
        with pytest.raises(ValueError, match="either tau"):
            Scaffold(**kw)
    with pytest.raises(ValueError, match="tau must be an integer"):
        GDConfig(0)


@pytest.mark.parametrize("make", [lambda: LocalGD(3), lambda: Scaffold(2),
                                  lambda: FedAlt(GDConfig(2, 0.02), w_init="zero"),
                                  lambda: FedAlt(GDConfig(2, 0.02), w_init="zero",
                                                 stateless=True),
                                  lambda: LocalFFGG(GDConfig(2, 0.02), GDConfig(1, 0.02),
                                                    w_init="zero"),
                                  lambda: L2GD(4)])
def test_deploy_on_a_cohort_is_its_rows_of_deployed(std, make):
    alg = make()
    res = run_rounds(std, alg, 3, seed=1)
    ctx, cohort = RoundContext(1, 3), np.array([4, 1])
    cs = None if res.client_state is None else {n: v[cohort] for n, v in
                                                res.client_state.items()}
    part = alg.deploy(res.state, std, cohort, cs, ctx)
    full = alg.deployed(res.state, std, res.client_state, ctx)
    for n in full.w:
        assert np.array_equal(part.w[n], full.w[n][cohort])
    for n in full.theta:
        want = full.theta[n][cohort] if full.personalized_theta else full.theta[n]
        assert np.array_equal(part.theta[n], want)
