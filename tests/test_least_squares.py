"""Example 1's closed forms against brute force on the raw matrices."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL, rel

from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec


def raw_loss(raw_m, theta, w):
    H, b, A, B, y = raw_m
    return 0.5 * np.sum((H @ theta - b) ** 2) + 0.5 * np.sum((A @ theta + B @ w - y) ** 2)


def std_w(problem, cohort, w):
    return problem.to_standard_w(cohort, w)["w"]


def test_loss_and_gradients_match_raw_formulas(small_ls, small_raw):
    g = np.random.default_rng(0)
    M = small_ls.num_clients
    cohort = np.arange(M)
    theta = {"theta": g.standard_normal(SMALL.d_theta)}
    w = {"w": g.standard_normal((M, SMALL.d_w))}
    W = std_w(small_ls, cohort, w)  # the same personal point in the standard basis
    f = small_ls.loss(cohort, theta, w)
    gt = small_ls.grad_theta(cohort, theta, w)["theta"]
    gw = small_ls.to_standard_w(cohort, small_ls.grad_w(cohort, theta, w))["w"]
    for m, (H, b, A, B, y) in enumerate(small_raw):
        r2 = A @ theta["theta"] + B @ W[m] - y
        assert f[m] == pytest.approx(raw_loss(small_raw[m], theta["theta"], W[m]), rel=1e-10)
        assert rel(gt[m], H.T @ (H @ theta["theta"] - b) + A.T @ r2) < 1e-10
        assert rel(gw[m], B.T @ r2) < 1e-10


def test_w_star_is_least_squares_solution(small_ls, small_raw):
    theta = {"theta": np.linspace(-1, 1, SMALL.d_theta)}
    cohort = np.arange(small_ls.num_clients)
    W = std_w(small_ls, cohort, small_ls.w_star(cohort, theta))
    for m, (_, _, A, B, y) in enumerate(small_raw):
        ref = np.linalg.lstsq(B, y - A @ theta["theta"], rcond=None)[0]
        assert rel(W[m], ref) < 1e-9


def test_theta_star_solves_the_stacked_personalized_problem(small_ls, small_raw):
    """θ* is the θ-block of argmin over (θ, w_1..w_M) of Σ_m f_m: one big least squares."""
    M, n, dt, dw = SMALL.num_clients, SMALL.n, SMALL.d_theta, SMALL.d_w
    rows, rhs = [], []
    for m, (H, b, A, B, y) in enumerate(small_raw):
        top = np.zeros((n, dt + M * dw))
        top[:, :dt] = H
        bot = np.zeros((n, dt + M * dw))
        bot[:, :dt] = A
        bot[:, dt + m * dw: dt + (m + 1) * dw] = B
        rows += [top, bot]
        rhs += [b, y]
    z = np.linalg.lstsq(np.vstack(rows), np.concatenate(rhs), rcond=None)[0]
    assert rel(small_ls.theta_star()["theta"], z[:dt]) < 1e-8
    assert np.linalg.norm(small_ls.F(small_ls.theta_star())) < 1e-9


def test_F_is_grad_theta_at_w_star(small_ls):
    g = np.random.default_rng(1)
    theta = {"theta": g.standard_normal(SMALL.d_theta)}
    c = np.arange(small_ls.num_clients)
    direct = small_ls.grad_theta(c, theta, small_ls.w_star(c, theta))["theta"]
    assert rel(small_ls.F_clients(c, theta), direct) < 1e-9
    assert rel(small_ls.F(theta), direct.mean(0)) < 1e-9


def test_f_star_is_joint_minimum(small_ls, small_raw):
    for m, (H, b, A, B, y) in enumerate(small_raw):
        X = np.block([[H, np.zeros((SMALL.n, SMALL.d_w))], [A, B]])
        z = np.linalg.lstsq(X, np.concatenate([b, y]), rcond=None)[0]
        ref = raw_loss(small_raw[m], z[: SMALL.d_theta], z[SMALL.d_theta:])
        assert small_ls.f_star()[m] == pytest.approx(ref, rel=1e-9, abs=1e-9)


def test_L_is_example_1_constant(small_ls, small_raw):
    ref = max(np.linalg.eigvalsh(H.T @ H + A.T @ A)[-1] for H, _, A, _, _ in small_raw)
    assert small_ls.L == pytest.approx(ref, rel=1e-12)
    assert small_ls.L >= small_ls.L_F_clients.max()


def test_subset_cohort_matches_full(small_ls):
    g = np.random.default_rng(2)
    theta = {"theta": g.standard_normal(SMALL.d_theta)}
    full = np.arange(small_ls.num_clients)
    w = {"w": g.standard_normal((len(full), SMALL.d_w))}
    sub = np.array([4, 1])
    assert np.allclose(small_ls.loss(sub, theta, {"w": w["w"][sub]}),
                       small_ls.loss(full, theta, w)[sub])
    assert np.allclose(small_ls.grad_theta(sub, theta, {"w": w["w"][sub]})["theta"],
                       small_ls.grad_theta(full, theta, w)["theta"][sub])


@pytest.mark.parametrize("bad", [dict(n=-1), dict(d_theta=0), dict(num_clients=0),
                                 dict(d_w=-5), dict(n=3, d_w=5)])
def test_bad_sizes_are_rejected_with_the_name(bad):
    with pytest.raises(ValueError) as e:
        LeastSquaresSpec(**bad)
    assert any(k in str(e.value) for k in bad)


def test_unknown_basis_and_client_ids():
    with pytest.raises(ValueError, match="basis"):
        LeastSquaresProblem(SMALL, basis="fourier")
    p = LeastSquaresProblem(SMALL)
    with pytest.raises(ValueError, match="client ids"):
        p.loss(np.array([0, 99]), p.init_theta(), {"w": np.zeros((2, SMALL.d_w))})


@pytest.mark.slow
def test_paper_constant_L_for_seed_0(paper_ls):
    """TARGETS.md: L ≈ 50.3 for seed-0 data at the paper's sizes."""
    assert paper_ls.L == pytest.approx(50.3, abs=0.2)
