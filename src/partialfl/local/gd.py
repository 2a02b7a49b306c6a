"""Full-gradient local steps on any problem (numpy or torch trees, whatever their names).

One step on client m with stepsize η_m and trained variables x (w, θ or both):

    x ← x − η_m (∇_x f_m(θ, w) − s_m)

(``s_m``: an optional shift, Scaffold's c_m − c; 0 otherwise). ``train="alternate"`` takes a
w-step and then a θ-step at the new w. η_m = ``lr``, or 1/L_m with L_m the joint smoothness of
f_m in (θ, w) (``problem.L_joint_clients``; it bounds the smoothness of every block, so it is
safe for every mode). With ``fast=True`` and a problem that has ``joint_gd`` (quadratic
problems), τ joint steps are evaluated in closed form (the same iterates up to rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partialfl import arrays
from partialfl.local.base import LocalResult, check_tau, check_train
from partialfl.registry import option, register
from partialfl.types import Params


def stepsizes(problem, cohort: np.ndarray, lr: float | None) -> np.ndarray:
    """η per client ``[k]``: ``lr`` for all, or 1/L_m (joint smoothness of f_m)."""
    if lr is not None:
        return np.full(len(cohort), float(lr))
    L = getattr(problem, "L_joint_clients", None)
    if L is None:
        raise TypeError(f"{type(problem).__name__} has no known smoothness constant "
                        "(L_joint_clients): give the local steps an explicit lr")
    return 1.0 / np.asarray(L)[np.asarray(cohort)]


def stack_theta(problem, theta: Params, k: int) -> Params:
    """θ per client ``[k, ...]`` (a shared leaf is copied to every row)."""
    shapes = problem.theta_shapes
    return {n: arrays.repeat_rows(v, k) if tuple(v.shape) == tuple(shapes[n]) else v
            for n, v in theta.items()}


def _step(x: Params, g: Params, eta: np.ndarray, shift: Params | None) -> Params:
    out = {}
    for n, v in x.items():
        if n not in g:
            out[n] = v
            continue
        d = g[n] if shift is None or n not in shift else g[n] - shift[n]
        out[n] = v - arrays.per_row(eta, v) * d
    return out


@dataclass(frozen=True)
class GDConfig:
    """τ full-gradient local steps (see the module docstring).

    Attributes:
        tau: number of local steps τ.
        lr: stepsize η (None: 1/L_m per client, the joint smoothness).
        fast: use the problem's closed form for joint steps (``problem.joint_gd``) if any.
    """

    tau: int
    lr: float | None = None
    fast: bool = True

    def __post_init__(self) -> None:
        check_tau(self.tau)
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"local stepsize lr must be a positive finite number, "
                             f"got {self.lr!r}")

    def stepsizes(self, problem, cohort) -> np.ndarray:
        """η per client ``[k]``: ``lr``, or 1/L_m."""
        return stepsizes(problem, np.asarray(cohort), self.lr)

    def run(self, problem, cohort, theta: Params, w: Params, train: str, *, seed: int = 0,
            round_: int = 0, stream: str = "local", shift: Params | None = None,
            eta: np.ndarray | None = None, mode=None) -> LocalResult:
        """τ steps on every client of the cohort (deterministic: seed and stream unused).
        ``eta`` overrides the per-client stepsizes; ``mode``: the kernels' batching mode."""
        check_train(train)
        cohort = np.asarray(cohort, dtype=np.int64)
        k = len(cohort)
        eta = stepsizes(problem, cohort, self.lr) if eta is None else np.asarray(eta)
        if train != "w":
            theta = stack_theta(problem, theta, k)
        if train == "both" and self.fast and hasattr(problem, "joint_gd"):
            x = problem.joint_gd(cohort, {**theta, **w}, eta, self.tau, shift)
            return LocalResult({n: x[n] for n in theta}, {n: x.get(n, w[n]) for n in w},
                               self.tau, None, np.full(k, self.tau))
        sw = st = None
        if shift is not None:
            sw = {n: v for n, v in shift.items() if n in w}
            st = {n: v for n, v in shift.items() if n in theta}
        for _ in range(self.tau):
            if train == "both":
                gt = problem.grad_theta(cohort, theta, w, mode=mode)
                gw = problem.grad_w(cohort, theta, w, mode=mode)
                theta, w = _step(theta, gt, eta, st), _step(w, gw, eta, sw)
                continue
            if train in ("w", "alternate"):
                w = _step(w, problem.grad_w(cohort, theta, w, mode=mode), eta, sw)
            if train in ("theta", "alternate"):
                theta = _step(theta, problem.grad_theta(cohort, theta, w, mode=mode), eta,
                              st)
        return LocalResult(theta, w, self.tau, None, np.full(k, self.tau))


@dataclass(frozen=True)
class GDOptions:
    """τ full-gradient local steps (any problem; Algorithm 2 as FFGG's fine-tuner)."""

    tau: int = option(1, "local steps τ >= 1")
    lr: float | None = option(None, "stepsize (None: 1/L_m per client)")
    fast: bool = option(True, "use the problem's closed form for the τ steps where it has one")

    def __post_init__(self) -> None:
        GDConfig(self.tau, self.lr, self.fast)  # validates

    def trainer(self, steps: int | None = None, epochs: int | None = None) -> GDConfig:
        """The client optimizer: τ steps (``steps``: K steps instead; ``epochs`` is SGD's)."""
        return GDConfig(self.tau if steps is None else steps, self.lr, self.fast)

    def finetuner(self, w_init: str):
        """FFGG's fine-tuner: Algorithm 2, τ GD steps on w from ``w_init``."""
        from partialfl.local.solvers import GradientDescent

        return GradientDescent(self.tau, self.lr, w_init, closed_form=self.fast)


@register("local", "gd", options=GDOptions, trainer=True)
def _gd(opts: GDOptions, ctx=None) -> GDOptions:
    """τ full-gradient local steps with η = 1/L_m (or ``lr``): Local GD's client optimizer and
    FFGG's Algorithm 2 fine-tuner."""
    return opts
