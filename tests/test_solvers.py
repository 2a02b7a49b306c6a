"""Local solvers against SciPy / literal loops / the exact minimiser."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL, rel
from scipy.sparse.linalg import LinearOperator, cg

from partialfl.build import make_solver
from partialfl.local import ConjugateGradient, ExactSolver, GradientDescent
from partialfl.problems import GeneralizedLinearProblem, LeastSquaresProblem

THETA = {"theta": np.linspace(-0.5, 1.5, SMALL.d_theta)}


@pytest.mark.parametrize("tau", [1, 2, 3])
def test_cg_matches_scipy_on_raw_matrices(small_ls, small_raw, tau):
    c = np.arange(small_ls.num_clients)
    W = small_ls.to_standard_w(c, ConjugateGradient(tau)(small_ls, c, THETA).w)["w"]
    for m, (_, _, A, B, y) in enumerate(small_raw):
        op = LinearOperator((SMALL.d_w,) * 2, matvec=lambda v, B=B: B.T @ (B @ v))
        ref, _ = cg(op, B.T @ (y - A @ THETA["theta"]), x0=np.zeros(SMALL.d_w), rtol=0.0,
                    atol=0.0, maxiter=tau)
        assert rel(W[m], ref) < 1e-10


def test_cg_terminates_at_w_star_after_d_w_steps(small_ls):
    c = np.arange(small_ls.num_clients)
    w = ConjugateGradient(SMALL.d_w + 2)(small_ls, c, THETA).w["w"]
    assert rel(w, small_ls.w_star(c, THETA)["w"]) < 1e-8


def test_gd_closed_form_equals_loop_and_gd_converges(small_ls):
    c = np.arange(small_ls.num_clients)
    a = GradientDescent(37)(small_ls, c, THETA).w["w"]
    b = GradientDescent(37, closed_form=False)(small_ls, c, THETA).w["w"]
    assert rel(a, b) < 1e-12
    # literal Algorithm 2 through the generic grad_w path
    w = {"w": np.zeros_like(a)}
    eta = 1.0 / small_ls.lipschitz_w(c)
    for _ in range(37):
        w = {"w": w["w"] - eta[:, None] * small_ls.grad_w(c, THETA, w)["w"]}
    assert rel(a, w["w"]) < 1e-12
    far = GradientDescent(20000)(small_ls, c, THETA).w["w"]
    assert rel(far, small_ls.w_star(c, THETA)["w"]) < 1e-6


def test_gd_on_glm_uses_generic_gradient_and_decreases_loss():
    p = GeneralizedLinearProblem(num_clients=3, n=50, d_theta=4, d_w=3)
    c = np.arange(3)
    th = {"theta": np.ones(4)}
    zero = p.loss(c, th, {"w": np.zeros((3, 3))})
    res = GradientDescent(200)(p, c, th)
    assert res.grad_evals == 200
    assert np.all(p.loss(c, th, res.w) < zero)
    exact = ExactSolver()(p, c, th).w
    assert np.all(p.loss(c, th, exact) <= p.loss(c, th, res.w) + 1e-12)
    assert np.abs(p.grad_w(c, th, exact)["w"]).max() < 1e-9


def test_exact_solver_and_random_init_are_seeded(small_ls):
    c = np.arange(small_ls.num_clients)
    assert rel(ExactSolver()(small_ls, c, THETA).w["w"], small_ls.w_star(c, THETA)["w"]) == 0
    s = GradientDescent(2, init="random")
    a, b = s(small_ls, c, THETA, seed=3, round_=5), s(small_ls, c, THETA, seed=3, round_=5)
    d = s(small_ls, c, THETA, seed=3, round_=6)
    assert np.array_equal(a.w["w"], b.w["w"]) and not np.allclose(a.w["w"], d.w["w"])
    # a client's random start does not depend on who else is in the cohort
    one = s(small_ls, np.array([2]), THETA, seed=3, round_=5).w["w"][0]
    assert np.array_equal(one, a.w["w"][2])
    cr = ConjugateGradient(SMALL.d_w + 2, init="random")(small_ls, c, THETA, 3, 5).w["w"]
    assert rel(cr, small_ls.w_star(c, THETA)["w"]) < 1e-8


class _ZeroRHS:
    """A quadratic problem whose right-hand side is zero: CG must stay at 0, not NaN."""

    num_clients = 2

    def w_system(self, cohort, theta):
        return np.ones((len(cohort), 3)), np.zeros((len(cohort), 3))

    def init_w(self, cohort, how, seed, round_):
        return {"w": np.zeros((len(cohort), 3))}


def test_cg_with_zero_residual_stays_finite():
    w = ConjugateGradient(5)(_ZeroRHS(), np.arange(2), {}).w["w"]
    assert np.all(np.isfinite(w)) and np.all(w == 0)


@pytest.mark.parametrize("kw,match", [(dict(name="gd", tau=0), "tau"),
                                      (dict(name="cg", tau=-2), "tau"),
                                      (dict(name="newton"), "'newton' is not allowed"),
                                      (dict(name="gd", tau=3, init="ones"), "initialisation"),
                                      (dict(name="gd", tau=3, lr=-1.0), "positive")])
def test_bad_solver_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        make_solver(**kw)


def test_cg_refuses_non_quadratic_problem():
    p = GeneralizedLinearProblem(num_clients=2, n=20, d_theta=3, d_w=2)
    with pytest.raises(TypeError, match="quadratic"):
        ConjugateGradient(3)(p, np.arange(2), {"theta": np.zeros(3)})


def test_standard_and_eigen_bases_give_same_theta_gradients(small_raw):
    e, s = LeastSquaresProblem(SMALL, basis="eigen"), LeastSquaresProblem(SMALL, basis="standard")
    c = np.arange(SMALL.num_clients)
    for solver in (ConjugateGradient(3), GradientDescent(5), ExactSolver()):
        ge = e.grad_theta(c, THETA, solver(e, c, THETA).w)["theta"]
        gs = s.grad_theta(c, THETA, solver(s, c, THETA).w)["theta"]
        assert rel(ge, gs) < 1e-10
