"""The paper's Example 3: partially personalized generalized linear models.

    f_m(θ, w) = ½‖H_mθ − b_m‖² + Σ_i ψ((A_mθ + B_m w − y_m)_i) + (ρ/2)‖w‖²

with a smooth convex scalar loss ψ applied to each residual:

* ``logcosh``  ψ(u) = log cosh u,       ψ' = tanh u,        0 < ψ'' ≤ 1
* ``softplus`` ψ(u) = log(1 + eᵘ),     ψ' = σ(u),          0 < ψ'' ≤ ¼
* ``huber``    ψ(u) = ½u² (|u| ≤ δ), δ|u| − ½δ² (else),     0 ≤ ψ'' ≤ 1

and a ridge ρ ≥ 0 on w (ρ > 0 makes w*(θ) unique even where ψ'' vanishes). Unlike Example 1,
w*_m(θ) has no closed form: :meth:`w_star` runs a batched damped Newton method to machine
precision. F_m(θ) = ∇₁f_m(θ, w*_m(θ)) = H_mᵀ(H_mθ − b_m) + A_mᵀψ'(u*_m) is the gradient of the
convex envelope g_m(θ) = min_w f_m(θ, w), hence L-cocoercive with
L = max_m λ_max(H_mᵀH_m) + ψ''_max·λ_max(A_mᵀA_m).
Data are generated as in Example 1 (U[0,1] entries, matrices divided by their second dimension)
with y_m scaled by ``y_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialfl import rng as prng
from partialfl.problems.base import W_INITS, check_cohort
from partialfl.registry import option, register
from partialfl.types import Params

PSI = ("logcosh", "softplus", "huber")


def _psi(kind: str, u: np.ndarray, delta: float):
    """(ψ(u), ψ'(u), ψ''(u)) elementwise."""
    if kind == "logcosh":
        a = np.abs(u)
        val = a + np.log1p(np.exp(-2 * a)) - np.log(2.0)
        t = np.tanh(u)
        return val, t, 1 - t * t
    if kind == "softplus":
        val = np.logaddexp(0.0, u)
        s = 0.5 * (1 + np.tanh(0.5 * u))
        return val, s, s * (1 - s)
    a = np.abs(u)
    inside = a <= delta
    val = np.where(inside, 0.5 * u * u, delta * a - 0.5 * delta * delta)
    return val, np.clip(u, -delta, delta), inside.astype(u.dtype)


@dataclass(frozen=True)
class GLMSpec:
    """Sizes and link of Example 3 (a generalized linear model per client): ``psi`` is the
    convex link on the personal residual (``logcosh``, ``huber`` with ``huber_delta``), ``ridge``
    the ℓ2 weight on w, ``y_scale`` the scale of the targets."""

    num_clients: int = 16
    n: int = 400
    d_theta: int = 20
    d_w: int = 10
    psi: str = "logcosh"
    huber_delta: float = 1.0
    ridge: float = 1e-3
    y_scale: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_clients", "n", "d_theta", "d_w"):
            v = getattr(self, name)
            if not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"GLM size {name} must be a positive integer, got {v!r}")
        if self.psi not in PSI:
            raise ValueError(f"unknown loss psi {self.psi!r}; allowed: {', '.join(PSI)}")
        if self.ridge < 0 or (self.psi == "huber" and self.ridge == 0):
            raise ValueError(f"ridge must be >= 0 (> 0 for huber), got {self.ridge}")
        if not self.huber_delta > 0:
            raise ValueError(f"huber_delta must be positive, got {self.huber_delta}")


class GeneralizedLinearProblem:
    """Example 3, batched over cohorts; θ = {"theta": [d_θ]}, w = {"w": [k, d_w]}."""

    theta_names = ("theta",)
    w_names = ("w",)
    state_names = ()

    def __init__(self, spec: GLMSpec | None = None, **kw) -> None:
        spec = spec or GLMSpec(**kw)
        self.spec = spec
        M, n, dt, dw = spec.num_clients, spec.n, spec.d_theta, spec.d_w
        self.num_clients, self.d_theta, self.d_w = M, dt, dw
        self.theta_shapes = {"theta": (dt,)}
        g = prng.generator(spec.seed, "glm")
        self.H = g.random((M, n, dt)) / dt
        self.b = g.random((M, n))
        self.A = g.random((M, n, dt)) / dt
        self.B = g.random((M, n, dw)) / dw
        self.y = spec.y_scale * g.random((M, n))
        self.HtH = self.H.transpose(0, 2, 1) @ self.H
        self.Htb = np.einsum("mni,mn->mi", self.H, self.b)
        self.psi2_max = 0.25 if spec.psi == "softplus" else 1.0
        lam = lambda X: np.linalg.eigvalsh(X.transpose(0, 2, 1) @ X)[:, -1]  # noqa: E731
        self.L = float((lam(self.H) + self.psi2_max * lam(self.A)).max())
        self._Lw = self.psi2_max * lam(self.B) + spec.ridge
        self._theta_star: np.ndarray | None = None
        self._f_star: np.ndarray | None = None

    # ---- pieces -------------------------------------------------------------------------
    def _u(self, c, theta: np.ndarray, W: np.ndarray) -> np.ndarray:
        At = self.A[c] @ theta if theta.ndim == 1 else np.einsum("knd,kd->kn", self.A[c], theta)
        return At + np.einsum("knd,kd->kn", self.B[c], W) - self.y[c]

    def _psi(self, u):
        return _psi(self.spec.psi, u, self.spec.huber_delta)

    # ---- Problem protocol -------------------------------------------------------------
    def init_theta(self, rng=None) -> Params:
        """θ⁰ = 0."""
        return {"theta": np.zeros(self.d_theta)}

    def init_w(self, cohort, how: str, seed: int, round_: int) -> Params:
        """Fresh w for ``cohort``: zeros (``zero``, or ``pretrained``: the problem's own start
        w⁰ = 0), or standard normal drawn from (seed, "init-w", round, client)."""
        cohort = np.asarray(cohort)
        if how in ("zero", "pretrained"):
            return {"w": np.zeros((len(cohort), self.d_w))}
        if how == "random":
            return {"w": np.stack([prng.generator(seed, "init-w", *prng.round_path(round_),
                                                  int(m))
                                   .standard_normal(self.d_w) for m in cohort])}
        raise ValueError(f"unknown w initialisation {how!r}; allowed: {', '.join(W_INITS)}")

    def num_examples(self, cohort) -> np.ndarray:
        """n for every client of the cohort."""
        return np.full(len(cohort), float(self.spec.n))

    def lipschitz_w(self, cohort) -> np.ndarray:
        """The smoothness constant of w ↦ f_m(θ, w) for each client of the cohort."""
        return self._Lw[np.asarray(cohort)]

    def loss(self, cohort, theta: Params, w: Params, *, mode=None) -> np.ndarray:
        """f_m(θ, w_m) = ½‖H_mθ − b_m‖² + Σ ψ(A_mθ + B_m w_m − y_m) + (ρ/2)‖w_m‖² per client."""
        c = check_cohort(cohort, self.num_clients)
        t, W = theta["theta"], w["w"]
        Ht = self.H[c] @ t if t.ndim == 1 else np.einsum("knd,kd->kn", self.H[c], t)
        r = Ht - self.b[c]
        val, _, _ = self._psi(self._u(c, t, W))
        return 0.5 * (r * r).sum(1) + val.sum(1) + 0.5 * self.spec.ridge * (W * W).sum(1)

    def grad_theta(self, cohort, theta: Params, w: Params, *, mode=None) -> Params:
        """∇₁f_m = H_mᵀ(H_mθ − b_m) + A_mᵀψ′(u_m), stacked over the cohort."""
        c = np.asarray(cohort)
        t = theta["theta"]
        HtHt = self.HtH[c] @ t if t.ndim == 1 else np.einsum("kij,kj->ki", self.HtH[c], t)
        _, d1, _ = self._psi(self._u(c, t, w["w"]))
        return {"theta": HtHt - self.Htb[c] + np.einsum("knd,kn->kd", self.A[c], d1)}

    def grad_w(self, cohort, theta: Params, w: Params, *, mode=None) -> Params:
        """∇₂f_m = B_mᵀψ′(u_m) + ρw_m, stacked over the cohort."""
        c = np.asarray(cohort)
        _, d1, _ = self._psi(self._u(c, theta["theta"], w["w"]))
        return {"w": np.einsum("knd,kn->kd", self.B[c], d1) + self.spec.ridge * w["w"]}

    # ---- exact inner solve ------------------------------------------------------------
    def w_star(self, cohort, theta: Params, tol: float = 1e-13, max_iter: int = 100) -> Params:
        """argmin_w f_m(θ, w) by batched damped Newton (backtracking on f) to ‖∇₂f‖ ≤ tol·scale."""
        c = np.asarray(cohort)
        W = np.zeros((len(c), self.d_w))
        B = self.B[c]
        rho = self.spec.ridge
        t = theta["theta"]
        for _ in range(max_iter):
            u = self._u(c, t, W)
            f0, d1, d2 = self._psi(u)
            g = np.einsum("knd,kn->kd", B, d1) + rho * W
            if np.abs(g).max() <= tol * max(1.0, np.abs(B).sum(1).max()):
                break
            Hs = np.einsum("kni,kn,knj->kij", B, d2, B) + rho * np.eye(self.d_w)
            step = np.linalg.solve(Hs + 1e-300 * np.eye(self.d_w), g[..., None])[..., 0]
            fcur = f0.sum(1) + 0.5 * rho * (W * W).sum(1)
            s = np.ones(len(c))
            for _ in range(40):  # backtracking (Armijo) per client
                Wn = W - s[:, None] * step
                fn = self._psi(self._u(c, t, Wn))[0].sum(1) + 0.5 * rho * (Wn * Wn).sum(1)
                bad = fn > fcur - 1e-4 * s * (g * step).sum(1) + 1e-12 * np.abs(fcur)
                if not bad.any():
                    break
                s = np.where(bad, 0.5 * s, s)
            W = W - s[:, None] * step
        return {"w": W}

    # ---- ClosedForm ---------------------------------------------------------------------
    def F_clients(self, cohort, theta: Params) -> np.ndarray:
        """F_m(θ) = ∇₁f_m(θ, w*_m(θ)) for each client of the cohort ``[k, d_θ]``."""
        c = np.asarray(cohort)
        return self.grad_theta(c, theta, self.w_star(c, theta))["theta"]

    def F(self, theta: Params) -> np.ndarray:
        """F(θ) = (1/M) Σ_m F_m(θ)."""
        return self.F_clients(np.arange(self.num_clients), theta).mean(0)

    def _envelope_jacobian(self, theta: np.ndarray) -> np.ndarray:
        """∇F(θ) = (1/M)Σ HᵀH + AᵀDA − AᵀDB(BᵀDB + ρI)⁻¹BᵀDA at w*(θ)."""
        c = np.arange(self.num_clients)
        W = self.w_star(c, {"theta": theta})["w"]
        _, _, d2 = self._psi(self._u(c, theta, W))
        A, B = self.A, self.B
        AtDA = np.einsum("kni,kn,knj->kij", A, d2, A)
        AtDB = np.einsum("kni,kn,knj->kij", A, d2, B)
        BtDB = np.einsum("kni,kn,knj->kij", B, d2, B) + self.spec.ridge * np.eye(self.d_w)
        schur = AtDB @ np.linalg.solve(BtDB, AtDB.transpose(0, 2, 1))
        return (self.HtH + AtDA - schur).mean(0)

    def theta_star(self) -> Params:
        """Root of F by Newton's method on the (strongly convex) envelope."""
        if self._theta_star is None:
            t = np.zeros(self.d_theta)
            for _ in range(100):
                Fv = self.F({"theta": t})
                if np.linalg.norm(Fv) <= 1e-12 * max(1.0, np.linalg.norm(self.Htb.mean(0))):
                    break
                t = t - np.linalg.solve(self._envelope_jacobian(t), Fv)
            self._theta_star = t
        return {"theta": self._theta_star.copy()}

    def f_star(self) -> np.ndarray:
        """min over (θ, w) of each f_m, by damped Newton (Armijo backtracking) on (θ, w)."""
        if self._f_star is None:
            out = np.empty(self.num_clients)
            dt = self.d_theta
            for m in range(self.num_clients):
                c = np.array([m])
                X = np.concatenate([self.A[m], self.B[m]], 1)

                def fgh(z, c=c, X=X, m=m):
                    th, W = {"theta": z[:dt]}, {"w": z[dt:][None]}
                    f = self.loss(c, th, W)[0]
                    g = np.concatenate([self.grad_theta(c, th, W)["theta"][0],
                                        self.grad_w(c, th, W)["w"][0]])
                    _, _, d2 = self._psi(self._u(c, z[:dt], z[dt:][None]))
                    Hs = X.T @ (d2[0][:, None] * X)
                    Hs[:dt, :dt] += self.HtH[m]
                    Hs[dt:, dt:] += self.spec.ridge * np.eye(self.d_w)
                    return f, g, Hs

                z = np.zeros(dt + self.d_w)
                f, g, Hs = fgh(z)
                for _ in range(200):
                    if np.linalg.norm(g) < 1e-10:
                        break
                    step = np.linalg.lstsq(Hs, g, rcond=None)[0]
                    s = 1.0
                    for _ in range(60):
                        fn = fgh(z - s * step)[0]
                        if fn <= f - 1e-4 * s * (g @ step):
                            break
                        s *= 0.5
                    z = z - s * step
                    f, g, Hs = fgh(z)
                out[m] = f
            self._f_star = out
        return self._f_star.copy()


@dataclass(frozen=True)
class GLMOptions:
    """The paper's Example 3 (a generalized linear model per client)."""

    num_clients: int = option(16, "clients M")
    n: int = option(400, "rows per client")
    d_theta: int = option(20, "global dimension")
    d_w: int = option(10, "personal dimension")
    psi: str = option("logcosh", "the convex link on the personal residual: logcosh, "
                      "softplus, huber")
    huber_delta: float = option(1.0, "huber: the threshold δ > 0")
    ridge: float = option(1e-3, "ℓ2 weight on w (> 0 for huber)")
    seed: int = option(0, "data seed")

    def __post_init__(self) -> None:
        from partialfl.problems.base import check_size

        GLMSpec(self.num_clients, self.n, self.d_theta, self.d_w, self.psi, self.huber_delta,
                self.ridge, seed=self.seed)
        check_size(self.num_clients, self.n, self.d_theta + self.d_w)


@register("problem", "glm", options=GLMOptions)
def _glm(opts: GLMOptions, ctx) -> GeneralizedLinearProblem:
    """Example 3: a generalized linear model per client; w*(θ) has no closed form."""
    return GeneralizedLinearProblem(GLMSpec(opts.num_clients, opts.n, opts.d_theta, opts.d_w,
                                            opts.psi, opts.huber_delta, opts.ridge,
                                            seed=opts.seed))
