"""The one-client fast path of local SGD (``ModelProblem.plain_sgd``: leaves kept across
steps, updated in place) is bit for bit the reference loop of ``local.sgd.run_sgd``, and is
taken exactly where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_bn_model, toy_data
from test_nn_algorithms import _problem

import partialfl.local.sgd as sgd
from partialfl.batching import Loop
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.problems.model import ModelProblem
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _run(problem, train, cfg, reference: bool, monkeypatch, clients=None, **kw):
    """run_sgd on ``clients`` (default: each client alone, its rows freshly allocated, so that
    BLAS kernels see aligned leaves in both paths); ``reference``: the general loop."""
    theta = problem.init_theta()
    every = np.arange(problem.num_clients)
    w = problem.init_w(every, "random", 3, 0) if problem.w_names else {}
    groups = [every] if clients == "together" else [every[i:i + 1] for i in every]
    outs = []
    with monkeypatch.context() as m:
        if reference:
            m.setattr(sgd, "_plain", lambda *a: False)
        for c in groups:
            wc = {n: v[c].clone() for n, v in w.items()}
            outs.append(run_sgd(problem, c, theta, wc, train=train, cfg=cfg, seed=1,
                                round_=2, stream="local", mode=Loop(), **kw))
    stacked = train != "w"  # θ per client when trained, else the θ that was given

    def cat(trees):
        return {n: torch.cat([t[n] for t in trees]) for n in trees[0]}

    return sgd.LocalResult(cat([o.theta for o in outs]) if stacked else outs[0].theta,
                           cat([o.w for o in outs]), max(o.steps for o in outs),
                           np.concatenate([o.loss for o in outs]),
                           np.concatenate([o.client_steps for o in outs]))


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
@pytest.mark.parametrize("kind,train", [("none", "theta"), ("output", "w"),
                                        ("output", "theta"), ("adapter", "both"),
                                        ("input", "w")])
def test_the_fast_path_is_the_reference_loop_bit_for_bit(kind, train, memory_format,
                                                          monkeypatch):
    problem = _problem(kind, False, toy_data(4))
    problem.memory_format = memory_format
    cfg = SGDConfig(lr=0.37, epochs=2, batch_size=4)  # η not a power of two: η·g rounds
    calls = []
    plain = problem.plain_sgd
    monkeypatch.setattr(problem, "plain_sgd", lambda *a: calls.append(a[0]) or plain(*a))
    fast = _run(problem, train, cfg, False, monkeypatch)
    ref = _run(problem, train, cfg, True, monkeypatch)
    assert calls == [0, 1, 2, 3]  # every client took the fast path, the reference none
    assert _same(fast.theta, ref.theta) and _same(fast.w, ref.w)
    assert np.array_equal(fast.loss, ref.loss) and fast.steps == ref.steps
    assert np.array_equal(fast.client_steps, ref.client_steps)
    moved = fast.theta if train in ("theta", "both") else fast.w
    start = problem.init_theta() if train in ("theta", "both") else None
    if start is not None:  # the steps did move the trained leaves
        assert any(not torch.equal(moved[n][0], start[n]) for n in start)
    assert all(v.is_contiguous() for v in {**fast.theta, **fast.w}.values())


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_a_clients_steps_do_not_depend_on_its_row_in_the_cohort(memory_format, monkeypatch):
    """The fast path trains fresh leaves: client m's result is the same alone or at any row
    of a stacked cohort (the reference loop trains views into the stack, where a BLAS kernel
    may round differently on a row that is not aligned: the adapter case differs by an ulp)."""
    problem = _problem("adapter", False, toy_data(4))
    problem.memory_format = memory_format
    cfg = SGDConfig(lr=0.37, epochs=2, batch_size=4)
    alone = _run(problem, "both", cfg, False, monkeypatch)
    together = _run(problem, "both", cfg, False, monkeypatch, clients="together")
    assert _same(alone.theta, together.theta) and _same(alone.w, together.w)
    assert np.array_equal(alone.loss, together.loss)


class _Unused(torch.nn.Module):
    """A head that is never called: its gradient is None (no step, as the reference's zero
    gradient gives)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 2, 3)
        self.fc = torch.nn.Linear(2 * 6 * 6, 5)
        self.spare = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.c1(x)), 1))


def test_a_leaf_without_gradient_is_left_as_the_reference_leaves_it(monkeypatch):
    torch.manual_seed(0)
    problem = ModelProblem(make_split(_Unused(), "none"), toy_data(3), vectorize=False)
    cfg = SGDConfig(lr=0.3, epochs=1, batch_size=5)
    fast = _run(problem, "theta", cfg, False, monkeypatch)
    ref = _run(problem, "theta", cfg, True, monkeypatch)
    assert _same(fast.theta, ref.theta)
    assert torch.equal(fast.theta["spare.weight"][1], problem.init_theta()["spare.weight"])


@pytest.mark.parametrize("case", ["running statistics", "clipping", "prox", "shift",
                                  "alternate"])
def test_the_fast_path_is_not_taken_where_it_would_differ(case, monkeypatch):
    data = toy_data(3)
    problem = (ModelProblem(make_split(toy_bn_model(0), "output"), data, vectorize=False)
               if case == "running statistics" else _problem("output", False, data))
    monkeypatch.setattr(problem, "plain_sgd", lambda *a: pytest.fail("fast path taken"))
    cfg = SGDConfig(lr=0.3, epochs=1, batch_size=4,
                    clip_norm=1.0 if case == "clipping" else None)
    train = {"prox": "theta", "shift": "theta", "alternate": "alternate"}.get(case, "w")
    kw = {}
    if case == "prox":
        kw["prox"] = (0.1, problem.init_theta())
    if case == "shift":
        kw["shift"] = {n: torch.zeros((3, *s)) for n, s in problem.theta_shapes.items()}
    out = _run(problem, train, cfg, False, monkeypatch, **kw)
    assert out.steps > 0


def test_plain_sgd_refuses_a_problem_it_does_not_cover():
    problem = ModelProblem(make_split(toy_bn_model(0), "output"), toy_data(2), vectorize=False)
    assert not problem.plain_sgd_ok
    with pytest.raises(ValueError, match="running statistics"):
        problem.plain_sgd(0, problem.init_theta(), {}, [np.arange(2)], "w", 0.1)
