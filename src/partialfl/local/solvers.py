"""Closed-form-problem local solvers (numpy, batched over a cohort).

* :class:`GradientDescent` — the paper's Algorithm 2: τ steps w ← w − η∇₂f_m(θ, w), with
  η = 1/L_w,m (the smoothness of w ↦ f_m) unless given.
* :class:`ConjugateGradient` — τ CG iterations on Q_m w = c_m(θ) (quadratic-in-w problems),
  the same recurrence as SciPy's ``cg`` (Hestenes–Stiefel), batched over clients.
* :class:`ExactSolver` — w*_m(θ) in closed form (quadratic problems) or to machine precision
  (the problem's own ``w_star``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from partialfl import arrays
from partialfl.local.base import check_tau, one_of
from partialfl.problems.base import W_INITS
from partialfl.registry import option, register
from partialfl.types import Params

INITS = W_INITS  # pretrained = the problem's own start (0 for the closed forms)


@dataclass(frozen=True)
class SolverResult:
    """A local solver's output: the fine-tuned w (stacked over the cohort), the number of local
    gradient evaluations per client and, for a minibatch solver, each client's mean training
    loss over its steps (``[k]``; None when not measured)."""

    w: Params
    grad_evals: int
    loss: np.ndarray | None = None


class LocalSolver(Protocol):
    """Approximates w*(θ) for a cohort: ``solver(problem, cohort, θ, seed, round, mode=…) ->
    SolverResult`` (``mode``: the batching mode of the problem's kernels, the run's
    ``RoundContext.mode``; None: the problem's default)."""

    def __call__(
        self, problem, cohort: np.ndarray, theta: Params, seed: int, round_: int, *, mode=None
    ) -> SolverResult: ...


def _check_init(init: str) -> str:
    return one_of(init, INITS, "w initialisation")


@dataclass(frozen=True)
class GradientDescent:
    """Algorithm 2 (GD fine-tuning): w^{t+1} = w^t − η ∇₂f_m(θ, w^t), t < τ.

    On a problem whose w-system is diagonal (least squares in its eigenbasis) and with
    ``closed_form=True``, the τ steps are evaluated in closed form,
    w^τ = w* + (1 − ηΛ)^τ (w⁰ − w*), w* = c/Λ — the same iterates up to rounding.
    """

    tau: int
    lr: float | None = None
    init: str = "zero"
    closed_form: bool = True

    def __post_init__(self) -> None:
        check_tau(self.tau)
        _check_init(self.init)
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"local stepsize lr must be positive, got {self.lr!r}")

    def __call__(self, problem, cohort, theta, seed=0, round_=0, *, mode=None) -> SolverResult:
        w = problem.init_w(cohort, self.init, seed, round_)
        eta = (
            np.full(len(cohort), self.lr) if self.lr is not None
            else 1.0 / problem.lipschitz_w(cohort)
        )
        if hasattr(problem, "w_system"):
            # Same iterates, one batched mat-vec per step: ∇₂f = Qw − c(θ).
            Q, c = problem.w_system(cohort, theta)
            name = _w_leaf(problem, w)
            W = w[name].copy()
            e = eta[:, None]
            if Q.ndim == 2 and self.closed_form:
                ws = c / Q
                W = ws + (1.0 - e * Q) ** self.tau * (W - ws)
            elif Q.ndim == 2:  # diagonal Q (eigenbasis): w ← w − η(Λw − c), elementwise
                for _ in range(self.tau):
                    W -= e * (Q * W - c)
            else:
                for _ in range(self.tau):
                    W -= e * (np.einsum("kij,kj->ki", Q, W) - c)
            return SolverResult({name: W}, self.tau)
        for _ in range(self.tau):
            g = problem.grad_w(cohort, theta, w, mode=mode)
            w = {n: (v - arrays.per_row(eta, v) * g[n]) if n in g else v for n, v in w.items()}
        return SolverResult(w, self.tau)


@dataclass(frozen=True)
class ConjugateGradient:
    """τ iterations of conjugate gradient on Q_m w = c_m(θ), from w⁰ = 0 or random.

    r⁰ = c − Qw⁰, p⁰ = r⁰; α = ‖r‖²/pᵀQp; w += αp; r −= αQp; β = ‖r_new‖²/‖r‖²; p = r + βp.
    A client whose residual is exactly zero stops moving (α = 0).
    """

    tau: int
    init: str = "zero"

    def __post_init__(self) -> None:
        check_tau(self.tau)
        _check_init(self.init)

    def __call__(self, problem, cohort, theta, seed=0, round_=0, *, mode=None) -> SolverResult:
        if not hasattr(problem, "w_system"):
            raise TypeError(
                f"conjugate gradient needs a problem quadratic in w; {type(problem).__name__} "
                "is not (use the 'gd' or 'exact' solver)"
            )
        Q, c = problem.w_system(cohort, theta)
        diag = Q.ndim == 2

        def matvec(v):
            return Q * v if diag else np.einsum("kij,kj->ki", Q, v)

        w0 = problem.init_w(cohort, self.init, seed, round_)
        name = _w_leaf(problem, w0)
        W = w0[name].copy()
        r = c - matvec(W) if self.init != "zero" else c.copy()
        p = r.copy()
        # Scalars are [k, 1] columns. A client with r = 0 (hence p = 0) must stop: adding the
        # smallest normal float to denominators makes α = β = 0 there and changes nothing
        # for any denominator above 1e-292.
        tiny = np.finfo(np.float64).tiny
        rho = np.vecdot(r, r, keepdims=True)
        for _ in range(self.tau):
            q = matvec(p)
            alpha = rho / (np.vecdot(p, q, keepdims=True) + tiny)
            W += alpha * p
            r -= alpha * q
            rho_new = np.vecdot(r, r, keepdims=True)
            p *= rho_new / (rho + tiny)
            p += r
            rho = rho_new
        return SolverResult({name: W}, self.tau)


@dataclass(frozen=True)
class ExactSolver:
    """w*_m(θ) from the problem's own exact solve (counted as one local computation)."""

    def __call__(self, problem, cohort, theta, seed=0, round_=0, *, mode=None) -> SolverResult:
        if not hasattr(problem, "w_star"):
            raise TypeError(f"{type(problem).__name__} has no exact w*(θ); use 'gd' or 'cg'")
        return SolverResult(problem.w_star(cohort, theta), 1)


def _w_leaf(problem, w: Params) -> str:
    """The one personal leaf of ``w`` whose system ``problem.w_system`` describes (Q w = c(θ)
    is over one flat vector)."""
    names = tuple(w)
    if len(names) != 1:
        raise TypeError(f"{type(problem).__name__}.w_system needs exactly one personal leaf, "
                        f"the problem has {list(names)}")
    return names[0]


@dataclass(frozen=True)
class CGOptions:
    """τ conjugate-gradient iterations on the quadratic w-subproblem (FFGG's fine-tuner)."""

    tau: int = option(1, "CG iterations τ >= 1")

    def __post_init__(self) -> None:
        check_tau(self.tau)

    def finetuner(self, w_init: str) -> ConjugateGradient:
        """CG from ``w_init``."""
        return ConjugateGradient(self.tau, w_init)


@register("local", "cg", options=CGOptions, trainer=False)
def _cg(opts: CGOptions, ctx=None) -> CGOptions:
    """τ conjugate-gradient iterations on Q_m w = c_m(θ) (problems quadratic in w): a
    fine-tuning solver for FFGG only."""
    return opts


@dataclass(frozen=True)
class _Exact:
    def finetuner(self, w_init: str) -> ExactSolver:
        return ExactSolver()


@register("local", "exact", trainer=False)
def _exact(opts=None, ctx=None) -> _Exact:
    """w*_m(θ) exactly (the problem's own solve): a fine-tuning solver for FFGG only."""
    return _Exact()
