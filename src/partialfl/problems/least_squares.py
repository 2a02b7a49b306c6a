"""The paper's Example 1: partially personalized least squares.

    f_m(θ, w) = ½‖H_m θ − b_m‖² + ½‖A_m θ + B_m w − y_m‖²

with H_m, A_m ∈ R^{n×d_θ}, B_m ∈ R^{n×d_w}. Generator (Sec. 4.2 of the paper): every entry of
every matrix and vector is U[0, 1], and each matrix is divided by its second dimension. Per
client, in this order, from ``rng.generator(seed, "least-squares")``: H_m, b_m, A_m, B_m, y_m.

Only sufficient statistics are kept (Gram matrices), so no round touches an n×d matrix:

    P_m = H_mᵀH_m + A_mᵀA_m,  p_m = H_mᵀb_m + A_mᵀy_m,  G_m = A_mᵀB_m,  Q_m = B_mᵀB_m,
    q_m = B_mᵀy_m,  c_m = ½(‖b_m‖² + ‖y_m‖²)

    f_m   = ½θᵀP_mθ + θᵀG_m w + ½wᵀQ_m w − θᵀp_m − wᵀq_m + c_m
    ∇₁f_m = P_mθ + G_m w − p_m,      ∇₂f_m = Q_m w + G_mᵀθ − q_m
    w*_m(θ) = Q_m⁻¹(q_m − G_mᵀθ)
    F_m(θ) = ∇₁f_m(θ, w*_m(θ)) = S_mθ − s_m,  S_m = P_m − G_mQ_m⁻¹G_mᵀ,  s_m = p_m − G_mQ_m⁻¹q_m

F = (1/M)Σ F_m is affine, θ* = S̄⁻¹ s̄. The constant of Example 1 is
L = max_m λ_max(H_mᵀH_m + A_mᵀA_m) ≥ max_m λ_max(S_m), so every F_m is L-cocoercive.

Personal coordinates. With ``basis="eigen"`` (the default) each client keeps its w in the
eigenbasis of its own Q_m = V_mΛ_mV_mᵀ, i.e. the personal variable is ŵ = V_mᵀw. This is an
orthogonal change of variables that GD and CG are equivariant to, so θ-iterates are the same
as in the standard basis (up to rounding, checked in the tests), while every local mat-vec
becomes an elementwise product: Q̂_m = Λ_m is diagonal (``w_system`` returns it as ``[k, d_w]``).
``to_standard_w`` maps ŵ back to w.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialfl import rng as prng
from partialfl.problems.base import W_INITS, check_cohort
from partialfl.registry import option, register
from partialfl.types import Params


@dataclass(frozen=True)
class LeastSquaresSpec:
    """Sizes of Example 1 (defaults are the paper's)."""

    num_clients: int = 32
    n: int = 10_000
    d_theta: int = 100
    d_w: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_clients", "n", "d_theta", "d_w"):
            v = getattr(self, name)
            if not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"least-squares size {name} must be a positive integer, got {v!r}")
        if self.n < self.d_w:
            raise ValueError(
                f"n={self.n} < d_w={self.d_w}: B_m would be rank deficient and w*(θ) not unique"
            )


def generate_raw(spec: LeastSquaresSpec, m: int | None = None):
    """Yield ``(H, b, A, B, y)`` for each client in order (or only client ``m``).

    The raw n×d matrices exist only here and in the paper-faithful reference path.
    """
    g = prng.generator(spec.seed, "least-squares")
    n, dt, dw = spec.n, spec.d_theta, spec.d_w
    for i in range(spec.num_clients):
        H = g.random((n, dt)) / dt
        b = g.random(n)
        A = g.random((n, dt)) / dt
        B = g.random((n, dw)) / dw
        y = g.random(n)
        if m is None or i == m:
            yield H, b, A, B, y


class LeastSquaresProblem:
    """Example 1 with batched closed forms; θ = {"theta": [d_θ]}, w = {"w": [k, d_w]}."""

    theta_names = ("theta",)
    w_names = ("w",)
    state_names = ()

    def __init__(
        self, spec: LeastSquaresSpec | None = None, basis: str = "eigen",
        progress: bool | str = False, **sizes: int
    ) -> None:
        """Generate the clients' data of ``spec`` (or of the keyword ``sizes``) and keep only
        their sufficient statistics; ``progress`` (True or a label) shows a bar over clients
        (the paper's size takes tens of seconds)."""
        if basis not in ("eigen", "standard"):
            raise ValueError(f"unknown basis {basis!r}; allowed: 'eigen', 'standard'")
        spec = spec or LeastSquaresSpec(**sizes)
        self.basis = basis
        self.spec = spec
        M, dt, dw = spec.num_clients, spec.d_theta, spec.d_w
        self.num_clients = M
        self.d_theta, self.d_w = dt, dw
        self.theta_shapes = {"theta": (dt,)}
        P = np.empty((M, dt, dt))
        p = np.empty((M, dt))
        G = np.empty((M, dt, dw))
        Q = np.empty((M, dw, dw))
        q = np.empty((M, dw))
        c = np.empty(M)
        lam_h_a = np.empty(M)
        clients = generate_raw(spec)
        if progress:
            from tqdm.auto import tqdm

            clients = tqdm(clients, total=M, leave=False, desc=progress if isinstance(
                progress, str) else "least-squares data")
        for m, (H, b, A, B, y) in enumerate(clients):
            HtH, AtA = H.T @ H, A.T @ A
            P[m] = HtH + AtA
            p[m] = H.T @ b + A.T @ y
            G[m] = A.T @ B
            Q[m] = B.T @ B
            q[m] = B.T @ y
            c[m] = 0.5 * (b @ b + y @ y)
            lam_h_a[m] = np.linalg.eigvalsh(P[m])[-1]
        self.P, self.p, self.G, self.Q, self.q, self.c = P, p, G, Q, q, c
        self._init_derived(lam_h_a)
        self.V = None
        if basis == "eigen":
            lam, V = np.linalg.eigh(Q)
            self.V = V
            self.G = G @ V
            self.Gt = np.ascontiguousarray(self.G.transpose(0, 2, 1))
            self.q = np.einsum("mji,mj->mi", V, q)
            self.Q = lam  # diagonal, [M, d_w]

    def _init_derived(self, lam_h_a: np.ndarray) -> None:
        P, p, G, Q, q = self.P, self.p, self.G, self.Q, self.q
        self.Gt = np.ascontiguousarray(G.transpose(0, 2, 1))
        QinvGt = np.linalg.solve(Q, self.Gt)  # [M, dw, dt]
        Qinvq = np.linalg.solve(Q, q[..., None])[..., 0]
        self.S = P - G @ QinvGt
        self.s = p - np.einsum("mij,mj->mi", G, Qinvq)
        self.S_bar = self.S.mean(0)
        self.s_bar = self.s.mean(0)
        self._theta_star = np.linalg.solve(self.S_bar, self.s_bar)
        #: Example 1's constant: max_m λ_max(H_mᵀH_m + A_mᵀA_m).
        self.L = float(lam_h_a.max())
        #: the tight cocoercivity constant of each F_m, λ_max(S_m) ≤ L.
        self.L_F_clients = np.linalg.eigvalsh(self.S)[:, -1]
        self._Lw = np.linalg.eigvalsh(Q)[:, -1]
        # f_m* = min over (θ, w) jointly: the fully personalized optimum.
        K = np.concatenate(
            [np.concatenate([P, G], 2), np.concatenate([self.Gt, Q], 2)], 1
        )  # [M, dt+dw, dt+dw]
        rhs = np.concatenate([p, q], 1)
        lam_K = np.linalg.eigvalsh(K)
        # A client with n < d_θ + d_w examples cannot identify (θ, w) alone: K_m is singular
        # and any solution of the (consistent) system gives f_m*; use the pseudo-inverse there.
        full = lam_K[:, 0] > 1e-12 * lam_K[:, -1]
        z = np.empty_like(rhs)
        z[full] = np.linalg.solve(K[full], rhs[full][..., None])[..., 0]
        if not full.all():
            z[~full] = np.einsum("mij,mj->mi", np.linalg.pinv(K[~full], hermitian=True),
                                 rhs[~full])
        self._f_star = self.c - 0.5 * np.einsum("mi,mi->m", z, rhs)
        #: smoothness of f_m in the joint variable (θ, w), per client.
        self.L_joint_clients = lam_K[:, -1]

    # ---- Problem protocol -------------------------------------------------------------
    def init_theta(self, rng: np.random.Generator | None = None) -> Params:
        """θ⁰ = 0 (the paper's initialisation)."""
        return {"theta": np.zeros(self.d_theta)}

    def init_w(self, cohort: np.ndarray, how: str, seed: int, round_: int) -> Params:
        """Fresh w for ``cohort``: zeros (``zero``, or ``pretrained``: the problem's own start
        w⁰ = 0), or standard normal drawn from (seed, "init-w", round, client)."""
        cohort = np.asarray(cohort)
        if how in ("zero", "pretrained"):
            return {"w": np.zeros((len(cohort), self.d_w))}
        if how == "random":
            return {
                "w": np.stack(
                    [prng.generator(seed, "init-w", *prng.round_path(round_), int(m))
                     .standard_normal(self.d_w) for m in cohort]
                ).reshape(len(cohort), self.d_w)
            }
        raise ValueError(f"unknown w initialisation {how!r}; allowed: {', '.join(W_INITS)}")

    def num_examples(self, cohort: np.ndarray) -> np.ndarray:
        """n for every client of the cohort."""
        return np.full(len(cohort), float(self.spec.n))

    def lipschitz_w(self, cohort: np.ndarray) -> np.ndarray:
        """λ_max(B_mᵀB_m), the smoothness constant of w ↦ f_m(θ, w), per client of the cohort."""
        return self._Lw[self._ix(cohort)]

    def _ix(self, cohort) -> np.ndarray | slice:
        """Index for a cohort; the full ordered cohort becomes a slice (no copies)."""
        c = np.asarray(cohort)
        M = self.num_clients
        if len(c) == M and c[0] == 0 and c[-1] == M - 1 and (M < 3 or (np.diff(c) > 0).all()):
            return slice(None)
        return check_cohort(c, M)

    def qmul(self, cohort, W: np.ndarray) -> np.ndarray:
        """Q_m w_m for each client of the cohort."""
        Q = self.Q[self._ix(cohort)]
        return Q * W if Q.ndim == 2 else np.einsum("kij,kj->ki", Q, W)

    def check_shareable_w(self) -> None:
        """Raises unless w means the same on every client (standard basis): in the eigenbasis
        each client keeps w in its own coordinates, so a shared w would be meaningless."""
        if self.V is not None:
            raise ValueError(
                "this baseline shares w across clients, but the problem keeps w in per-client "
                "eigen-coordinates; build it with LeastSquaresProblem(..., basis='standard')")

    def to_standard_w(self, cohort, w: Params) -> Params:
        """Personal parameters in the standard basis of Example 1 (w = V_m ŵ)."""
        if self.V is None:
            return w
        return {"w": np.einsum("kij,kj->ki", self.V[self._ix(cohort)], w["w"])}

    def loss(self, cohort: np.ndarray, theta: Params, w: Params, *, mode=None) -> np.ndarray:
        """f_m(θ, w_m); θ may be shared ``[d_θ]`` or per client ``[k, d_θ]``."""
        c = self._ix(cohort)
        k = len(w["w"])
        t = _per_client(theta["theta"], k)
        W = w["w"]
        quad_t = np.einsum("ki,kij,kj->k", t, self.P[c], t)
        cross = np.einsum("ki,kij,kj->k", t, self.G[c], W)
        quad_w = np.vecdot(W, self.qmul(cohort, W))
        lin = np.einsum("ki,ki->k", t, self.p[c]) + np.einsum("ki,ki->k", W, self.q[c])
        return 0.5 * quad_t + cross + 0.5 * quad_w - lin + self.c[c]

    def grad_theta(self, cohort: np.ndarray, theta: Params, w: Params, *, mode=None) -> Params:
        """∇₁f_m = P_mθ + G_m w_m − p_m (P = HᵀH + AᵀA, G = AᵀB, p = Hᵀb + Aᵀy), stacked."""
        c = self._ix(cohort)
        t = theta["theta"]
        Pt = self.P[c] @ t if t.ndim == 1 else np.matmul(self.P[c], t[..., None])[..., 0]
        Gw = np.matmul(self.G[c], w["w"][..., None])[..., 0]
        return {"theta": Pt + Gw - self.p[c]}

    def grad_w(self, cohort: np.ndarray, theta: Params, w: Params, *, mode=None) -> Params:
        """∇₂f_m = Q_m w_m − c_m(θ) (Q = BᵀB, c(θ) = Bᵀy − Gᵀθ), stacked."""
        return {"w": self.qmul(cohort, w["w"]) - self.w_system(cohort, theta)[1]}

    # ---- QuadraticInW -------------------------------------------------------------------
    def w_system(self, cohort: np.ndarray, theta: Params) -> tuple[np.ndarray, np.ndarray]:
        """``(Q, c(θ))`` with ∇₂f_m = Q_m w − c_m(θ); Q is ``[k, d_w]`` (diagonal) in the
        eigenbasis, else ``[k, d_w, d_w]``."""
        c = self._ix(cohort)
        t = theta["theta"]
        if t.ndim == 1:
            Gt = self.Gt[c]
            rhs = self.q[c] - (Gt.reshape(-1, Gt.shape[-1]) @ t).reshape(Gt.shape[:2])
        else:
            rhs = self.q[c] - np.matmul(self.Gt[c], t[..., None])[..., 0]
        return self.Q[c], rhs

    def w_star(self, cohort: np.ndarray, theta: Params) -> Params:
        """w*_m(θ) = Q_m⁻¹c_m(θ) (elementwise in the eigenbasis)."""
        Q, rhs = self.w_system(cohort, theta)
        if Q.ndim == 2:
            return {"w": rhs / Q}
        return {"w": np.linalg.solve(Q, rhs[..., None])[..., 0]}

    # ---- closed-form local GD on the joint variable (fast path of Local GD / Scaffold) ---
    def _joint_eig(self):
        if getattr(self, "_jeig", None) is None:
            M, dt = self.num_clients, self.d_theta
            Qf = np.stack([np.diag(q) for q in self.Q]) if self.Q.ndim == 2 else self.Q
            K = np.concatenate([np.concatenate([self.P, self.G], 2),
                                np.concatenate([self.Gt, Qf], 2)], 1)
            lam, U = np.linalg.eigh(K)
            r = np.concatenate([self.p, self.q], 1)
            zstar = np.einsum("mij,mj->mi", U, np.einsum("mji,mj->mi", U, r) / lam)
            self._jeig = (lam, U, zstar, dt)
            assert zstar.shape == (M, dt + self.d_w)
        return self._jeig

    def joint_gd(self, cohort, z0: Params, eta: np.ndarray, tau: int,
                 shift: Params | None = None) -> Params:
        """τ steps of z ← z − η(∇f_m(z) − s) on the joint variable z = (θ, w), in closed form.

        ∇f_m(z) = K_m z − r_m with K_m = [[P, G], [Gᵀ, Q]]; with the fixed point
        z̄ = K_m⁻¹(r_m + s), z_τ = z̄ + U(1 − ηΛ)^τUᵀ(z⁰ − z̄) for K_m = UΛUᵀ. Identical (up to
        rounding) to looping the steps, at the cost of two mat-vecs.
        """
        lam, U, zstar, dt = self._joint_eig()
        c = self._ix(cohort)
        lam, U, zbar = lam[c], U[c], zstar[c]
        if not (lam[:, 0] > 1e-12 * lam[:, -1]).all():
            raise ValueError("joint_gd: some client's K_m is singular (n < (d_θ + d_w)/2), the "
                             "closed form needs it invertible; use fast=False")
        z = np.concatenate([z0["theta"], z0["w"]], 1)
        if shift is not None:
            sv = np.concatenate([shift["theta"], shift["w"]], 1)
            zbar = zbar + np.einsum("kij,kj->ki", U, np.einsum("kji,kj->ki", U, sv) / lam)
        decay = (1.0 - eta[:, None] * lam) ** tau
        zt = zbar + np.einsum("kij,kj->ki", U, decay * np.einsum("kji,kj->ki", U, z - zbar))
        return {"theta": zt[:, :dt], "w": zt[:, dt:]}

    # ---- ClosedForm ---------------------------------------------------------------------
    def F_clients(self, cohort: np.ndarray, theta: Params) -> np.ndarray:
        """F_m(θ) = S_mθ − s_m for each m in the cohort ``[k, d_θ]``."""
        c = self._ix(cohort)
        return self.S[c] @ theta["theta"] - self.s[c]

    def F(self, theta: Params) -> np.ndarray:
        """F(θ) = S̄θ − s̄ with S_m = P_m − G_mQ_m⁻¹G_mᵀ (the Schur complement), averaged."""
        return self.S_bar @ theta["theta"] - self.s_bar

    def theta_star(self) -> Params:
        """θ* = S̄⁻¹s̄, the root of F (a copy)."""
        return {"theta": self._theta_star.copy()}

    def f_star(self) -> np.ndarray:
        """min_{θ,w} f_m(θ, w) per client (the fully personalized optimum; a copy)."""
        return self._f_star.copy()

    def personalized_risk(self, theta: Params) -> float:
        """(1/M) Σ_m min_w f_m(θ, w): the objective FFGG minimises (Theorem 4)."""
        allc = np.arange(self.num_clients)
        return float(self.loss(allc, theta, self.w_star(allc, theta)).mean())


def _per_client(t: np.ndarray, k: int) -> np.ndarray:
    return np.broadcast_to(t, (k, t.shape[-1])) if t.ndim == 1 else t



@dataclass(frozen=True)
class LeastSquaresOptions:
    """The paper's Example 1 (defaults are its sizes)."""

    num_clients: int = option(32, "clients M")
    n: int = option(10_000, "rows per client")
    d_theta: int = option(100, "global dimension")
    d_w: int = option(50, "personal dimension")
    seed: int = option(0, "data seed")
    basis: str = option("eigen", "personal coordinates: eigen or standard")

    def __post_init__(self) -> None:
        from partialfl.config import check_choice
        from partialfl.problems.base import check_size

        check_choice("basis", self.basis, ("eigen", "standard"))
        LeastSquaresSpec(self.num_clients, self.n, self.d_theta, self.d_w, self.seed)
        check_size(self.num_clients, self.n, self.d_theta + self.d_w)


@register("problem", "least-squares", options=LeastSquaresOptions)
def _least_squares(opts: LeastSquaresOptions, ctx) -> LeastSquaresProblem:
    """Example 1: f_m(θ, w) = ‖A_m θ + B_m w − y_m‖²/(2n), with exact w*(θ), F(θ), θ*."""
    spec = LeastSquaresSpec(opts.num_clients, opts.n, opts.d_theta, opts.d_w, opts.seed)
    shared = ctx is not None and ctx.shared_w
    progress = ctx.progress if ctx is not None else False
    return LeastSquaresProblem(spec, basis="standard" if shared else opts.basis,
                               progress=progress and (
                                   f"building the problem ({opts.num_clients} clients × "
                                   f"{opts.n:,} rows)"))
