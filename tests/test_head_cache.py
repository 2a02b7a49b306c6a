"""FFGG's one-pass client (``problems/model/head.py``): with w the output layer, fine-tuning on
the body's features kept from one forward pass gives bit for bit the two-pass client (SGD
through the whole model, then the full-data ∇_θ), does fewer forward passes through the
model, and falls back to the two passes wherever the shortcut would be wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data, toy_model

import partialfl.problems.model.head as head
from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.model import model_ffgg
from partialfl.batching import Loop, Vmap
from partialfl.build import make_model
from partialfl.data.federated import FederatedDataset
from partialfl.local.sgd import SGDConfig, SGDFineTuner
from partialfl.problems.model import ModelProblem
from partialfl.runtime import run_rounds
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _emnist_data(sizes=(40, 75, 9, 130)) -> FederatedDataset:
    g = torch.Generator().manual_seed(3)
    tx = [torch.rand(n, 1, 28, 28, generator=g) for n in sizes]
    ty = [torch.randint(0, 62, (n,), generator=g) for n in sizes]
    vx = [torch.rand(5, 1, 28, 28, generator=g) for _ in sizes]
    vy = [torch.randint(0, 62, (5,), generator=g) for _ in sizes]
    return FederatedDataset(tx, ty, vx, vy, [f"w{m}" for m in range(len(sizes))], 62)


def _emnist_problem(memory_format="contiguous", chunk=32):
    split = make_split(make_model("emnist_cnn", 62, seed=0), "output", seed=0)
    return ModelProblem(split, _emnist_data(), mode=Loop(), chunk=chunk,
                        memory_format=memory_format)


def _client(problem, cfg, *, fused: bool, init="pretrained", rounds_seed=(4, 2)):
    """One FFGG client_update on the whole federation, with or without the one-pass path."""
    alg = model_ffgg(cfg, init=init)
    if not fused:
        alg.solver = _TwoPass(alg.solver.cfg, alg.solver.init)
    theta = problem.init_theta()
    state = alg.init(problem, theta)
    seed, r = rounds_seed
    ctx = RoundContext(seed=seed, round=r, mode=Loop())
    cohort = np.arange(problem.num_clients)
    return alg.client_update(state, problem, cohort, ctx).updates


class _TwoPass(SGDFineTuner):
    """The fine-tuner without the one-pass path: fine-tuning, then ``grad_theta``."""

    def with_gradient(self, *a, **k):
        return None


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_one_pass_client_is_bit_for_bit_the_two_pass_client_on_the_emnist_cnn(memory_format):
    problem = _emnist_problem(memory_format)
    cfg = SGDConfig(lr=0.3, epochs=2, batch_size=16)
    assert problem.head_cache_ok()
    one = _client(problem, cfg, fused=True)
    two = _client(problem, cfg, fused=False)
    assert problem._head_checked is True  # the one-pass path ran
    assert _equal(one.vectors, two.vectors)
    np.testing.assert_array_equal(one.weights, two.weights)
    assert one.grad_evals == two.grad_evals
    np.testing.assert_array_equal(one.metrics["train_loss"], two.metrics["train_loss"])
    assert all(torch.isfinite(v).all() for v in one.vectors.values())


def test_one_pass_client_runs_the_model_once_per_chunk(monkeypatch):
    problem = _emnist_problem(chunk=32)
    cfg = SGDConfig(lr=0.3, epochs=1, batch_size=16)
    calls = {"n": 0}
    fwd = type(problem.module).forward

    def counting(self, x):
        calls["n"] += 1
        return fwd(self, x)

    _client(problem, cfg, fused=True)  # the first client served checks the one pass
    assert problem._head_checked is True
    monkeypatch.setattr(type(problem.module), "forward", counting)
    sizes = problem.num_examples(np.arange(problem.num_clients))
    chunks = int(sum(-(-n // 32) for n in sizes))
    steps = int(sum(-(-n // 16) for n in sizes))
    _client(problem, cfg, fused=True)
    assert calls["n"] == chunks  # the forward pass of ∇_θ only
    calls["n"] = 0
    _client(problem, cfg, fused=False)
    assert calls["n"] == chunks + steps


def test_a_client_over_the_size_limit_takes_the_two_passes_with_the_same_result(monkeypatch):
    problem = _emnist_problem()
    cfg = SGDConfig(lr=0.3, epochs=1, batch_size=16)
    monkeypatch.setattr(head, "HEAD_CACHE_EXAMPLES", 50)  # clients 2 and 3 of 4 exceed it
    seen = []
    orig = ModelProblem._two_passes
    monkeypatch.setattr(ModelProblem, "_two_passes",
                        lambda self, c, *a: seen.append(c) or orig(self, c, *a))
    one = _client(problem, cfg, fused=True)
    assert seen == [0, 1, 3]  # client 0: the check of the one pass on the first client
    assert _equal(one.vectors, _client(problem, cfg, fused=False).vectors)


@pytest.mark.parametrize("init", ["zero", "random"])
def test_other_initialisations_agree(init):
    problem = _emnist_problem()
    cfg = SGDConfig(lr=0.2, epochs=1, batch_size=32)
    assert _equal(_client(problem, cfg, fused=True, init=init).vectors,
                  _client(problem, cfg, fused=False, init=init).vectors)


def test_a_personal_layer_inside_the_model_is_detected_and_falls_back():
    """w = a middle layer (2-D, so the static check passes): the forward check sees that its
    output is not the model's, and the problem takes the two passes from then on."""
    problem = ModelProblem(make_split(toy_model(0), "pattern", personal=[r"^mid\."]),
                           toy_data(), mode=Loop(), chunk=8)
    cfg = SGDConfig(lr=0.1, epochs=1, batch_size=4)
    assert problem.head_cache_ok()
    one = _client(problem, cfg, fused=True)
    assert problem._head_checked is False and not problem.head_cache_ok()
    assert _equal(one.vectors, _client(problem, cfg, fused=False).vectors)


def test_the_shortcut_is_not_taken_where_it_does_not_apply():
    problem = _emnist_problem()
    sgd = SGDConfig(lr=0.1, epochs=1, batch_size=8)
    theta = problem.init_theta()
    args = (problem, np.arange(2), theta, 0, 0)
    assert SGDFineTuner(sgd).with_gradient(*args, mode=Loop()) is not None
    # clipping changes the steps; a vectorised mode batches the clients
    assert SGDFineTuner(SGDConfig(lr=0.1, clip_norm=1.0)).with_gradient(*args, mode=Loop()) \
        is None
    assert SGDFineTuner(sgd).with_gradient(*args, mode=Vmap()) is None
    # input personalization (a 4-D convolution weight) and running statistics: no head
    inp = ModelProblem(make_split(make_model("emnist_cnn", 62, seed=0), "input", seed=0),
                       _emnist_data(), mode=Loop())
    assert not inp.head_cache_ok()
    from _nn_toy import toy_bn_model

    bn = ModelProblem(make_split(toy_bn_model(0), "output", seed=0), toy_data(), mode=Loop())
    assert not bn.head_cache_ok()


def test_an_ffgg_run_gives_the_same_theta_with_and_without_the_shortcut():
    problem = _emnist_problem("channels_last")
    cfg = SGDConfig(lr=0.2, epochs=1, batch_size=16)
    out = []
    for fused in (True, False):
        alg = model_ffgg(cfg, weighting="examples")
        if not fused:
            alg.solver = _TwoPass(alg.solver.cfg, alg.solver.init)
        res = run_rounds(problem, alg, 3, clients_per_round=3, seed=5)
        out.append(res.state.theta)
    assert _equal(*out)
