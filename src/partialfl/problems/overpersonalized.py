"""An overpersonalized, heterogeneous instance of the paper's Example 1.

Same features as :class:`~partialfl.problems.least_squares.LeastSquaresProblem` (H_m, A_m,
B_m ~ U[0, 1] / second dimension, same generator), but the targets are planted so that every
client fits its data *exactly* at one common θ♮ with its own w♮_m:

    b_m = H_m θ♮,   y_m = A_m θ♮ + B_m w♮_m,   θ♮ ~ N(0, I),   w♮_m ~ N(0, h²·I)

(``generator(seed, "overpersonalized")``). Then f_m(θ♮, w♮_m) = 0 = min f_m for every m, so
θ* = θ♮ and F_m(θ*) = ∇₁f_m(θ*, w*_m(θ*)) = 0 for *every* client (the paper's
overpersonalization), although the clients are heterogeneous: the w♮_m differ (spread h),
and no shared (θ, w) fits them all. The sufficient statistics follow from the raw ones:

    p_m = P_mθ♮ + G_m w♮_m,  q_m = G_mᵀθ♮ + Q_m w♮_m,
    c_m = ½(θ♮ᵀP_mθ♮ + 2θ♮ᵀG_m w♮_m + w♮_mᵀQ_m w♮_m).

With few examples per client, d_w ≤ n < (d_θ + d_w)/2, w*_m(θ) is still unique (Q_m ≻ 0) but
no client can identify θ* from its own data (its joint Hessian K_m = [[P, G], [Gᵀ, Q]] is
singular): only cooperation finds θ*. (With n ≥ (d_θ + d_w)/2 a single client's data already
pins θ* down, and a rule that follows one client, e.g. Krum, recovers θ* without cooperating.)

Personal coordinates are the standard ones (``basis="standard"``), so a *shared* w means the
same vector for every client (needed by the non-personalized baselines).
"""

from __future__ import annotations

import numpy as np

from partialfl import rng as prng
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec


class OverpersonalizedLeastSquares(LeastSquaresProblem):
    """Example 1 with planted targets; ``heterogeneity`` = h, the spread of the w♮_m."""

    def __init__(self, spec: LeastSquaresSpec | None = None, heterogeneity: float = 1.0,
                 **sizes: int) -> None:
        if not (isinstance(heterogeneity, int | float) and heterogeneity >= 0
                and np.isfinite(heterogeneity)):
            raise ValueError(f"heterogeneity must be finite and >= 0, got {heterogeneity!r}")
        super().__init__(spec, basis="standard", **sizes)
        M, dt, dw = self.num_clients, self.d_theta, self.d_w
        g = prng.generator(self.spec.seed, "overpersonalized")
        self.heterogeneity = float(heterogeneity)
        self.theta_planted = g.standard_normal(dt)
        self.w_planted = heterogeneity * g.standard_normal((M, dw))
        t, W = self.theta_planted, self.w_planted
        Pt = self.P @ t
        Gw = np.einsum("mij,mj->mi", self.G, W)
        Qw = np.einsum("mij,mj->mi", self.Q, W)
        self.p = Pt + Gw
        self.q = self.Gt @ t + Qw
        self.c = 0.5 * (Pt @ t + 2 * np.einsum("i,mi->m", t, Gw) + np.einsum("mi,mi->m", W, Qw))
        self._init_derived(np.linalg.eigvalsh(self.P)[:, -1])
        self._jeig = None  # drop any cache built from the unplanted statistics

    def shared_optimum(self) -> np.ndarray:
        """argmin over one shared x = (θ, w) of (1/M)Σ_m f_m: the non-personalized solution
        ``[d_θ + d_w]`` (solves the averaged normal equations)."""
        K = np.concatenate([np.concatenate([self.P, self.G], 2),
                            np.concatenate([self.Gt, self.Q], 2)], 1).mean(0)
        r = np.concatenate([self.p, self.q], 1).mean(0)
        return np.linalg.solve(K, r)

    def joint_gd(self, cohort, z0, eta: np.ndarray, tau: int, shift=None):
        """τ steps of z ← z − η(∇f_m(z) − s) on z = (θ, w), one by one: K_m may be singular
        here (a client with n < (d_θ + d_w)/2 cannot identify (θ, w) alone), where the base
        class's closed form does not apply."""
        c = self._ix(cohort)
        z = {"theta": np.array(z0["theta"], dtype=float), "w": np.array(z0["w"], dtype=float)}
        e = np.asarray(eta, dtype=float)[:, None]
        P, G, Gt, Q = self.P[c], self.G[c], self.Gt[c], self.Q[c]
        p, q = self.p[c], self.q[c]
        for _ in range(int(tau)):
            gt = (np.einsum("kij,kj->ki", P, z["theta"]) + np.einsum("kij,kj->ki", G, z["w"])
                  - p)
            gw = (np.einsum("kij,kj->ki", Gt, z["theta"]) + np.einsum("kij,kj->ki", Q, z["w"])
                  - q)
            if shift is not None:
                gt, gw = gt - shift["theta"], gw - shift["w"]
            z = {"theta": z["theta"] - e * gt, "w": z["w"] - e * gw}
        return z
