"""The paper's theory as numerical checks on random instances (Examples 1 and 3)."""

from __future__ import annotations

import numpy as np
import pytest

from partialfl.problems import GeneralizedLinearProblem, LeastSquaresProblem

PROBLEMS = [
    lambda s: LeastSquaresProblem(num_clients=4, n=40, d_theta=6, d_w=3, seed=s),
    lambda s: GeneralizedLinearProblem(num_clients=3, n=40, d_theta=5, d_w=3, psi="logcosh",
                                       seed=s),
    lambda s: GeneralizedLinearProblem(num_clients=3, n=40, d_theta=5, d_w=3, psi="softplus",
                                       seed=s),
    lambda s: GeneralizedLinearProblem(num_clients=3, n=40, d_theta=5, d_w=3, psi="huber",
                                       ridge=1e-2, seed=s),
]


@pytest.mark.parametrize("make", PROBLEMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_F_m_is_cocoercive_with_the_stated_constant(make, seed):
    """⟨F_m(x) − F_m(y), x − y⟩ ≥ (1/L)‖F_m(x) − F_m(y)‖² (Examples 1 and 3)."""
    p = make(seed)
    g = np.random.default_rng(seed)
    c = np.arange(p.num_clients)
    for _ in range(20):
        x = {"theta": 3 * g.standard_normal(p.d_theta)}
        y = {"theta": 3 * g.standard_normal(p.d_theta)}
        dF = p.F_clients(c, x) - p.F_clients(c, y)
        inner = dF @ (x["theta"] - y["theta"])
        assert np.all(inner >= (dF * dF).sum(1) / p.L - 1e-9 * (1 + np.abs(inner)))


@pytest.mark.parametrize("make", PROBLEMS)
def test_theorem_4_theta_star_minimises_the_personalized_risk(make):
    """θ* (F(θ*) = 0) is stationary for (1/M)Σ_m f_m(θ, w*_m(θ)) and, numerically, its
    minimiser; F is the gradient of that risk (envelope theorem)."""
    p = make(0)
    c = np.arange(p.num_clients)

    def risk(t):
        th = {"theta": t}
        return float(p.loss(c, th, p.w_star(c, th)).mean())

    ts = p.theta_star()["theta"]
    assert np.linalg.norm(p.F({"theta": ts})) < 1e-8
    g = np.random.default_rng(0)
    t = g.standard_normal(p.d_theta)
    h = 1e-5
    fd = np.array([(risk(t + h * e) - risk(t - h * e)) / (2 * h) for e in np.eye(p.d_theta)])
    assert np.allclose(fd, p.F({"theta": t}), rtol=1e-5, atol=1e-6)
    r0 = risk(ts)
    for _ in range(20):
        assert risk(ts + 0.1 * g.standard_normal(p.d_theta)) >= r0 - 1e-12
