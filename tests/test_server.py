"""Server optimizers and schedules against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from partialfl.build import make_optimizer
from partialfl.registry import component
from partialfl.server import SGD, Adam, Exponential, WarmupLinear


def test_sgd_and_momentum():
    th = {"a": np.array([1.0, 2.0])}
    g = {"a": np.array([0.5, -1.0])}
    new, _ = SGD(0.1).step(th, g, None, 0)
    assert np.allclose(new["a"], [0.95, 2.1])
    opt = SGD(0.1, momentum=0.5)
    s = opt.init(th)
    t1, s = opt.step(th, g, s, 0)
    t2, s = opt.step(t1, g, s, 1)
    assert np.allclose(t2["a"], t1["a"] - 0.1 * 1.5 * g["a"])


def test_adam_first_step_is_sign_times_lr():
    th = {"a": np.array([1.0, -1.0, 0.0])}
    g = {"a": np.array([3.0, -0.2, 1e-3])}
    opt = Adam(0.01, eps=0.0)
    new, st = opt.step(th, g, opt.init(th), 0)
    assert np.allclose(new["a"], th["a"] - 0.01 * np.sign(g["a"]))
    assert st["t"] == 1


def test_schedules():
    s = WarmupLinear(total=10, warmup=2)
    assert [round(s.factor(r), 6) for r in range(10)] == [0.5, 1.0, 1.0, 0.875, 0.75, 0.625,
                                                         0.5, 0.375, 0.25, 0.125]
    e = Exponential(halve_every=3)
    assert [e.factor(r) for r in (0, 2, 3, 6)] == [1.0, 1.0, 0.5, 0.25]
    opt = SGD(1.0, schedule=e)
    new, _ = opt.step({"a": np.zeros(1)}, {"a": np.ones(1)}, None, 3)
    assert new["a"][0] == -0.5


@pytest.mark.parametrize("bad", [lambda: component("schedule", "cosine"),
                                 lambda: WarmupLinear(total=0),
                                 lambda: Exponential(halve_every=0),
                                 lambda: component("schedule", {"name": "exponential",
                                                                "halve_every": 0}),
                                 lambda: Adam(1.0, beta1=1.0),
                                 lambda: make_optimizer("lion", 1.0), lambda: SGD(float("inf")),
                                 lambda: SGD(0.1, momentum=1.0)])
def test_bad_server_arguments(bad):
    with pytest.raises(ValueError):
        bad()
