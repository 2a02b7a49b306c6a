"""``memory_format = "channels_last"`` (one client's passes run 4-D inputs and weights
channels-last, faster on CPU) and the CNNs' pool-then-ReLU (bit for bit ReLU-then-pool)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _nn_toy import max_diff, one_thread, toy_bn_model, toy_data
from test_nn_algorithms import ALGOS, _problem

from partialfl.config import ConfigError
from partialfl.models.cnn import EmnistCNN, relu_pool
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.runtime.threads import ThreadBackend
from partialfl.spec import RunSpec
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_pool_then_relu_is_relu_then_pool_bit_for_bit_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 8, generator=g)
    x[0, 0, :2, :2] = 0.0  # a window of ties at 0
    x[1, 1, 2:4, :2] = -1.0  # a window of equal negatives
    x[2, 2, :2, 2:4] = torch.tensor([[0.0, 0.0], [-1.0, 0.0]])  # zeros and a negative
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    ya, yb = relu_pool(a), F.max_pool2d(F.relu(b), 2)
    assert torch.equal(ya, yb)
    up = torch.randn(ya.shape, generator=g)
    (ga,), (gb,) = torch.autograd.grad(ya, a, up), torch.autograd.grad(yb, b, up)
    assert torch.equal(ga, gb)
    # and the whole EMNIST CNN against the textbook order
    net = EmnistCNN(10)
    img = torch.randn(5, 1, 28, 28, generator=g)
    ref = net.fc(torch.flatten(F.max_pool2d(F.relu(net.conv2(
        F.max_pool2d(F.relu(net.conv1(img)), 2))), 2), 1))
    assert torch.equal(net(img), ref)


def _cl_problem(kind, data, vectorize=False, bn=False):
    if bn:
        return ModelProblem(make_split(toy_bn_model(0), kind), data, vectorize=vectorize,
                            memory_format="channels_last")
    p = _problem(kind, vectorize, data)
    p.memory_format = "channels_last"
    return p


@pytest.mark.parametrize("name", ["fedavg", "ffgg-adapter", "bn"])
def test_channels_last_is_the_same_theta_on_every_one_client_backend(name):
    """Sequential, threads and worker processes take bit for bit the same steps
    channels-last; the steps agree with contiguous ones to float rounding; the conv really
    ran channels-last."""
    make, kind = ALGOS["fedavg" if name == "bn" else name]
    data = toy_data(8)
    bn = name == "bn"
    seen = []
    prob = _cl_problem(kind, data, bn=bn)
    conv = prob.module.c1
    # channels innermost (stride 1), also for the one-channel input whose layout is ambiguous
    h = conv.register_forward_pre_hook(lambda m, a: seen.append(a[0].stride(1) == 1))
    runs = {}
    # worker processes fork before the thread pool exists: once, under a loaded full suite,
    # workers forked beside idle pool threads never answered (not reproduced alone)
    for label, backend in (("seq", SequentialBackend()), ("processes", ProcessBackend(2)),
                           ("threads", ThreadBackend(2))):
        p = prob if label == "seq" else _cl_problem(kind, data, bn=bn)
        runs[label] = run_rounds(p, make(), 2, clients_per_round=5, seed=1, backend=backend)
        getattr(backend, "close", lambda: None)()
    h.remove()
    assert seen and all(seen)
    for label in ("threads", "processes"):
        assert max_diff(runs["seq"].state.theta, runs[label].state.theta) == 0, label
    plain = (ModelProblem(make_split(toy_bn_model(0), kind), data, vectorize=False) if bn
             else _problem(kind, False, data))
    ref = run_rounds(plain, make(), 2, clients_per_round=5, seed=1, backend=SequentialBackend())
    assert max_diff(runs["seq"].state.theta, ref.state.theta) < 1e-5
    assert max_diff(ref.state.theta, plain.init_theta()) > 1e-3  # the rounds moved θ


def test_vmap_passes_stay_contiguous_and_evaluation_runs_channels_last():
    make, kind = ALGOS["ffgg"]
    data = toy_data(6)
    a = run_rounds(_cl_problem(kind, data, vectorize=True), make(), 2, clients_per_round=4,
                   seed=0, backend=BatchedBackend())
    b = run_rounds(_problem(kind, True, data), make(), 2, clients_per_round=4, seed=0,
                   backend=BatchedBackend())
    assert max_diff(a.state.theta, b.state.theta) == 0  # vmap ignores the layout
    cl, plain = _cl_problem(kind, data), _problem(kind, False, data)
    theta, cohort = plain.init_theta(), torch.arange(6).numpy()
    w = plain.init_w(cohort, "pretrained", 0, 0)
    assert cl.loss(cohort, theta, w) == pytest.approx(plain.loss(cohort, theta, w), rel=1e-5)


def test_a_bad_memory_format_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="memory_format must be one of contiguous, "
                                         "channels_last, got 'nhwc'"):
        ModelProblem(make_split(toy_bn_model(0), "none"), toy_data(2), memory_format="nhwc")
    with pytest.raises(ConfigError, match="memory_format"):
        RunSpec.from_dict({"memory_format": "nhwc"})
