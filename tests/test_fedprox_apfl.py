"""FedProx and APFL, each one module plus its registration: both checked against a
hand-written torch loop over the same minibatches, and runnable by name from a spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl.algorithms.apfl import APFL
from partialfl.algorithms.fedprox import FedProx
from partialfl.algorithms.model import FedAvg
from partialfl.build import build_algorithm
from partialfl.config import ConfigError, from_dict
from partialfl.local.sgd import SGDConfig, batch_plan
from partialfl.problems.model import ModelProblem
from partialfl.rng import generator
from partialfl.runtime import run_rounds
from partialfl.spec import MethodConfig, RunSpec, StageConfig
from partialfl.split import make_split

SGD = SGDConfig(lr=0.1, batch_size=4, epochs=2)


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _problem():
    return ModelProblem(make_split(toy_model(0), "none"), toy_data())


def _grad(model, params, x, y):
    p = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    loss = F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)
    return dict(zip(p, torch.autograd.grad(loss, list(p.values())))), float(loss.detach())


def _plan(problem, m, seed, r):
    n = len(problem.data.train_y[m])
    return batch_plan(n, SGD.batch_size, SGD.epochs, None, generator(seed, "local", r, m))


# -------------------------------------------------------------------------------- FedProx
def _fedprox_reference(problem, theta0, mu, rounds, seed):
    """Full participation: per client, proximal SGD x ← x − η∇f(x; b), then
    x ← (x + ημ θʳ)/(1 + ημ); θ ← mean of the clients' x."""
    model, data = toy_model(0), problem.data
    theta = {n: t.clone() for n, t in theta0.items()}
    for r in range(rounds):
        xs = []
        for m in range(problem.num_clients):
            x = {n: t.clone() for n, t in theta.items()}
            for b in _plan(problem, m, seed, r):
                g, _ = _grad(model, x, data.train_x[m][b], data.train_y[m][b])
                x = {n: x[n] - SGD.lr * g[n] for n in x}
                x = {n: (x[n] + SGD.lr * mu * theta[n]) / (1 + SGD.lr * mu) for n in x}
            xs.append(x)
        theta = {n: theta[n] + torch.stack([x[n] - theta[n] for x in xs]).mean(0)
                 for n in theta}
    return theta


@pytest.mark.parametrize("mu", [0.5, 5.0])
def test_fedprox_matches_the_hand_written_loop(mu):
    p = _problem()
    theta0 = p.init_theta()
    got = run_rounds(p, FedProx(SGD, mu), 2, seed=3, theta0=theta0).state.theta
    ref = _fedprox_reference(p, theta0, mu, 2, 3)
    assert max_diff(got, ref) < 1e-5


def test_fedprox_with_mu_zero_is_fedavg_bit_for_bit_and_mu_pulls_to_theta():
    p = _problem()
    a = run_rounds(p, FedProx(SGD, 0.0), 2, seed=1).state.theta
    b = run_rounds(p, FedAvg(SGD), 2, seed=1).state.theta
    assert max_diff(a, b) == 0.0
    theta0 = p.init_theta()
    moved = {mu: max_diff(run_rounds(p, FedProx(SGD, mu), 1, seed=1, theta0=theta0)
                          .state.theta, theta0) for mu in (0.0, 10.0, 1e6)}
    assert moved[0.0] > moved[10.0] > moved[1e6] and moved[1e6] < 1e-4


# -------------------------------------------------------------------------------- APFL
def _apfl_reference(problem, theta0, alpha0, rounds, seed):
    """Full participation: per client and minibatch, θ_m ← θ_m − η∇f(θ_m),
    v ← v − ηα∇f(v̄), α ← clip(α − η⟨v − θ_m, ∇f(v̄)⟩) with v̄ = αv + (1 − α)θ_m (all from the
    values before the step); θ ← θ + mean(θ_m − θ). Returns θ, every v and α."""
    model, data = toy_model(0), problem.data
    M = problem.num_clients
    theta = {n: t.clone() for n, t in theta0.items()}
    v = [None] * M
    alpha = [alpha0] * M
    for r in range(rounds):
        deltas = []
        for m in range(M):
            th = {n: t.clone() for n, t in theta.items()}
            vm = {n: t.clone() for n, t in (v[m] or theta).items()}
            a = alpha[m]
            for b in _plan(problem, m, seed, r):
                x, y = data.train_x[m][b], data.train_y[m][b]
                g_th, _ = _grad(model, th, x, y)
                mix = {n: a * vm[n] + (1 - a) * th[n] for n in th}
                g, _ = _grad(model, mix, x, y)
                inner = sum(float(((vm[n] - th[n]) * g[n]).sum()) for n in g)
                vm = {n: vm[n] - SGD.lr * a * g[n] for n in vm}
                th = {n: th[n] - SGD.lr * g_th[n] for n in th}
                a = min(1.0, max(0.0, a - SGD.lr * inner))
            v[m], alpha[m] = vm, a
            deltas.append({n: th[n] - theta[n] for n in th})
        theta = {n: theta[n] + torch.stack([d[n] for d in deltas]).mean(0) for n in theta}
    return theta, v, alpha


def test_apfl_matches_the_hand_written_loop():
    p = _problem()
    theta0 = p.init_theta()
    res = run_rounds(p, APFL(SGD, alpha=0.5), 2, seed=2, theta0=theta0)
    theta, v, alpha = _apfl_reference(p, theta0, 0.5, 2, 2)
    assert max_diff(res.state.theta, theta) < 1e-5
    cs = res.client_state
    assert np.allclose(cs["alpha"].numpy(), alpha, atol=1e-5)
    for m in range(p.num_clients):
        assert max_diff({n: cs["v/" + n][m] for n in theta}, v[m]) < 1e-5
    # the deployed model is each client's mixture, and α moved away from its start
    dep = APFL(SGD).deployed(res.state, p, cs, None).theta
    n0 = next(iter(theta))
    a0 = alpha[0]
    assert torch.allclose(dep[n0][0], a0 * v[0][n0] + (1 - a0) * res.state.theta[n0],
                          atol=1e-5)
    assert any(abs(a - 0.5) > 1e-3 for a in alpha)


def test_apfl_with_alpha_fixed_at_zero_deploys_the_fedavg_model():
    p = _problem()
    res = run_rounds(p, APFL(SGD, alpha=0.0, adaptive=False), 2, seed=2)
    ref = run_rounds(p, FedAvg(SGD), 2, seed=2)
    assert max_diff(res.state.theta, ref.state.theta) == 0.0
    dep = APFL(SGD).deployed(res.state, p, res.client_state, None).theta
    assert all(torch.equal(dep[n][m], ref.state.theta[n]) for n in dep
               for m in range(p.num_clients))


# -------------------------------------------------------------------------------- by name
@pytest.mark.parametrize("name, options, cls", [("fedprox", {"mu": 0.3}, FedProx),
                                                ("apfl", {"alpha": 0.25}, APFL)])
def test_registered_and_built_from_a_spec(name, options, cls):
    spec = from_dict(RunSpec, {"method": {"algorithm": name, **options}})
    alg = build_algorithm(spec, StageConfig(client=SGD))
    assert type(alg) is cls
    assert getattr(alg, next(iter(options))) == next(iter(options.values()))
    with pytest.raises(ConfigError, match="method"):
        MethodConfig(algorithm=name, split="output")
    with pytest.raises(ConfigError, match=f"unknown key 'method.bogus'.*{next(iter(options))}"):
        from_dict(MethodConfig, {"algorithm": name, "bogus": 1})
