"""Ditto: its limits (λ = ∞: the global FedAvg model; λ = 0: local training, checked against a
direct torch SGD loop) and a finite-λ step against the proximal-gradient formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl.algorithms.ditto import Ditto, local_only
from partialfl.algorithms.model import FedAvg
from partialfl.local.sgd import SGDConfig, batch_plan, run_sgd
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.rng import generator
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.split import make_split

LOCAL = SGDConfig(lr=0.1, batch_size=4)
PERS = SGDConfig(lr=0.1, batch_size=4, epochs=2)


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _problem(vectorize=False):
    return ModelProblem(make_split(toy_model(0), "none"), toy_data(), vectorize=vectorize)


def _reference(problem, theta0, lam, rounds, seed):
    """Each client's v after ``rounds`` full-participation rounds, by a direct torch loop:
    per round, PERS epochs of v ← v − η∇f(v; batch), then v ← (v + ηλθʳ)/(1 + ηλ), with
    the minibatch plan of generator(seed, "personal", round, client) and θʳ from FedAvg."""
    fedavg = FedAvg(LOCAL)
    thetas = [theta0]
    # θʳ for every r: r rounds of FedAvg from θ⁰
    for r in range(1, rounds):
        thetas.append(run_rounds(problem, fedavg, r, seed=seed, theta0=theta0).state.theta)
    model = toy_model(0)
    out = []
    data = problem.data
    for m in range(problem.num_clients):
        v = {n: t.clone() for n, t in theta0.items()}
        x, y = data.train_x[m], data.train_y[m]
        for r in range(rounds):
            plan = batch_plan(len(y), PERS.batch_size, PERS.epochs, None,
                              generator(seed, "personal", r, m))
            for b in plan:
                params = {n: t.clone().requires_grad_(True) for n, t in v.items()}
                loss = F.cross_entropy(torch.func.functional_call(model, params, (x[b],)), y[b])
                g = torch.autograd.grad(loss, list(params.values()))
                v = {n: (params[n] - PERS.lr * gi).detach() for n, gi in zip(params, g)}
                if math.isinf(lam):
                    v = {n: thetas[r][n].clone() for n in v}
                else:
                    v = {n: (v[n] + PERS.lr * lam * thetas[r][n]) / (1 + PERS.lr * lam)
                         for n in v}
        out.append(v)
    return {n: torch.stack([o[n] for o in out]) for n in theta0}


def _theta0(problem):
    return {n: t.detach().clone() for n, t in problem.split.model.named_parameters()}


@pytest.mark.parametrize("lam", [0.0, 0.7, math.inf])
def test_personal_models_match_the_direct_reference(lam):
    pb = _problem()
    th0 = _theta0(pb)
    res = run_rounds(pb, Ditto(LOCAL, PERS, lam), 3, seed=1, theta0=th0)
    v = Ditto.personal_v(res.state.theta, res.client_state)
    ref = _reference(pb, th0, lam, 3, seed=1)
    assert max_diff(v, ref) < 1e-5


def test_global_model_is_fedavg_and_lambda_inf_deploys_it():
    pb = _problem()
    th0 = _theta0(pb)
    d = run_rounds(pb, Ditto(LOCAL, PERS, math.inf), 4, seed=3, theta0=th0)
    f3 = run_rounds(pb, FedAvg(LOCAL), 3, seed=3, theta0=th0)
    f4 = run_rounds(pb, FedAvg(LOCAL), 4, seed=3, theta0=th0)
    assert max_diff(d.state.theta, f4.state.theta) < 1e-6  # θ is trained by FedAvg
    v = Ditto.personal_v(d.state.theta, d.client_state)
    for m in range(pb.num_clients):  # v_m = the global model the client last received
        assert max_diff({n: t[m] for n, t in v.items()}, f3.state.theta) < 1e-6
    # λ = 0 gives personal models that differ from it
    d0 = run_rounds(pb, Ditto(LOCAL, PERS, 0.0), 4, seed=3, theta0=th0)
    assert max_diff(Ditto.personal_v(d0.state.theta, d0.client_state), v) > 1e-2


def test_partial_participation_unjoined_clients_deploy_theta_and_backends_agree():
    out = {}
    for vec, be in ((True, BatchedBackend()), (False, SequentialBackend())):
        pb = _problem(vec)
        out[vec] = run_rounds(pb, Ditto(LOCAL, PERS, 0.5), 1, clients_per_round=2, seed=0,
                              theta0=_theta0(pb), backend=be, evaluate=round_evaluator(),
                              eval_every=1)
    a, b = out[True], out[False]
    assert max_diff(a.client_state, b.client_state) < 1e-5
    joined = a.client_state["joined"].numpy()
    assert joined.sum() == 2
    v = Ditto.personal_v(a.state.theta, a.client_state)
    for m in np.flatnonzero(joined == 0):
        assert max_diff({n: t[m] for n, t in v.items()}, a.state.theta) == 0
    assert a.history[-1]["test_acc"] == pytest.approx(b.history[-1]["test_acc"], abs=1e-9)


def test_local_only_keeps_theta_and_trains_each_client_alone():
    pb = _problem()
    th0 = _theta0(pb)
    res = run_rounds(pb, local_only(PERS), 2, seed=0, theta0=th0)
    assert max_diff(res.state.theta, th0) == 0
    ref = _reference(pb, th0, 0.0, 2, seed=0)
    assert max_diff(Ditto.personal_v(res.state.theta, res.client_state), ref) < 1e-5


def test_bad_arguments():
    with pytest.raises(ValueError, match="lambda must be >= 0"):
        Ditto(LOCAL, PERS, -1.0)
    pb = ModelProblem(make_split(toy_model(0), "output"), toy_data())
    with pytest.raises(ValueError, match="split 'none'"):
        Ditto(LOCAL, PERS, 1.0).init_client_state(pb)
    with pytest.raises(ValueError, match="train='theta'"):
        run_sgd(pb, [0], *make_split(toy_model(0), "output").params(), train="w", cfg=PERS,
                seed=0, round_=0, stream="x", prox=(1.0, {}))
