"""Non-personalized baselines on the shared model x = (θ, w) with full local gradients.

* :class:`LocalGD` — FedAvg / Local GD: each client runs τ steps x ← x − η∇f_m(x) from the
  server model and sends Δ = x_τ − x⁰; the server averages, x ← x + mean(Δ) (server SGD lr 1).
  η = 1/L_m with L_m the joint smoothness of f_m in (θ, w) unless given.
* :class:`Scaffold` — Karimireddy et al. (2020), option II control variates, global step 1:
  y ← y − η(∇f_m(y) − c_m + c) for τ steps; c_m⁺ = c_m − c + (x − y)/(τη);
  the client sends Δy and Δc_m = c_m⁺ − c_m; x ← x + mean(Δy), c ← c + (|C|/M)·mean(Δc).
  η as for LocalGD. c_m lives on the client (runtime-held state); c on the server.

The deployed model is the shared (θ, w) for every client.

``fast=True`` uses the problem's closed form for τ linear GD steps (``problem.joint_gd``, for
quadratic problems), which gives the same iterates as the step-by-step loop (``fast=False``,
the reference path) up to rounding, in O(1) instead of O(τ) mat-vecs.
"""

from __future__ import annotations

import numpy as np

from partialfl.algorithms.base import Algorithm, ClientResult, Deployed
from partialfl.types import ClientUpdates, Params


def _joint_grad(problem, cohort, x: Params) -> Params:
    """∇f_m at per-client joint points x = {"theta": [k, dθ], "w": [k, dw]}."""
    th, w = {"theta": x["theta"]}, {"w": x["w"]}
    return {**problem.grad_theta(cohort, th, w), **problem.grad_w(cohort, th, w)}


def _broadcast(x: Params, k: int) -> Params:
    return {n: np.repeat(v[None], k, 0) for n, v in x.items()}


def _lr(problem, cohort, lr):
    return np.full(len(cohort), lr) if lr is not None else 1.0 / problem.L_joint_clients[cohort]


def shared_model(problem, theta0: Params) -> Params:
    """The non-personalized model x = (θ, w): θ⁰ plus a shared w⁰ = 0.

    A shared w must mean the same thing on every client, so problems that store personal
    parameters in per-client coordinates (least squares with ``basis="eigen"``) are refused.
    """
    if getattr(problem, "V", None) is not None:
        raise ValueError(
            "this baseline shares w across clients, but the problem keeps w in per-client "
            "eigen-coordinates; build it with LeastSquaresProblem(..., basis='standard')"
        )
    if "w" in theta0:
        return theta0
    return {**theta0, "w": problem.init_w(np.arange(1), "zero", 0, 0)["w"][0]}


def _check_tau(tau):
    if not isinstance(tau, int | np.integer) or tau < 1:
        raise ValueError(f"local steps tau must be an integer >= 1, got {tau!r}")


class LocalGD(Algorithm):
    """Local GD on one shared model (θ, w) (the non-personalized baseline): τ local gradient
    steps per round with stepsize ``lr`` (default 1/L_m per client), the server averages the
    model changes."""

    name = "local-gd"
    pseudo_gradient = "delta"

    def __init__(self, tau: int, lr: float | None = None, server_opt=None, aggregator=None,
                 fast: bool = True):
        super().__init__(server_opt, aggregator)
        _check_tau(tau)
        if lr is not None and not lr > 0:
            raise ValueError(f"local stepsize lr must be positive, got {lr!r}")
        self.tau, self.lr, self.fast = int(tau), lr, fast

    def _local_gd(self, problem, cohort, x0: Params, eta: np.ndarray, shift=None) -> Params:
        """τ steps x ← x − η(∇f_m(x) − shift) from x0 (per client)."""
        if self.fast and hasattr(problem, "joint_gd"):
            return problem.joint_gd(cohort, x0, eta, self.tau, shift)
        x = {n: v.copy() for n, v in x0.items()}
        e = eta[:, None]
        for _ in range(self.tau):
            g = _joint_grad(problem, cohort, x)
            for n in x:
                x[n] -= e * (g[n] if shift is None else g[n] - shift[n])
        return x

    def init(self, problem, theta0):
        """The server state with the shared model (θ⁰, w⁰)."""
        return super().init(problem, shared_model(problem, theta0))

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        """The model change after τ local GD steps on the joint variable, from the shared model."""
        x0 = _broadcast(state.theta, len(cohort))
        x = self._local_gd(problem, cohort, x0, _lr(problem, cohort, self.lr))
        delta = {n: x[n] - x0[n] for n in x}
        return ClientResult(ClientUpdates(delta, np.ones(len(cohort)), np.asarray(cohort),
                                          self.tau))

    def deployed(self, state, problem, client_state, ctx):
        """The shared model on every client (its w copied to each)."""
        M = problem.num_clients
        w = np.repeat(state.theta["w"][None], M, 0)
        return Deployed({"theta": state.theta["theta"]}, {"w": w})


class Scaffold(LocalGD):
    """Scaffold (Karimireddy et al., 2020) on the shared model: local steps corrected by control
    variates, x ← x − η(∇f_m(x) − c_m + c); clients keep c_m, the server c."""

    name = "scaffold"
    stateful_clients = True

    def init(self, problem, theta0):
        """The shared model and the server's control variate c = 0."""
        s = super().init(problem, theta0)
        s.extra["c"] = {n: np.zeros_like(v) for n, v in s.theta.items()}
        s.extra["num_clients"] = problem.num_clients
        return s

    def init_client_state(self, problem) -> Params:
        """Every client's control variate c_m = 0 (θ- and w-parts)."""
        return self.init_client_state_rows(problem, np.arange(problem.num_clients))

    def init_client_state_rows(self, problem, cohort: np.ndarray) -> Params:
        """Control variates c_m = 0 of the given clients."""
        k = len(cohort)
        return {"c_theta": np.zeros((k, problem.d_theta)), "c_w": np.zeros((k, problem.d_w))}

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        """τ corrected local steps; sends the model change and the change of c_m (option II update
        c_m ← c_m − c + (x − y)/(τη))."""
        k = len(cohort)
        x0 = _broadcast(state.theta, k)
        c = state.extra["c"]
        cm = {"theta": client_state["c_theta"], "w": client_state["c_w"]}
        eta = _lr(problem, cohort, self.lr)
        y = self._local_gd(problem, cohort, x0, eta, shift={n: cm[n] - c[n] for n in cm})
        cm_new = {n: cm[n] - c[n] + (x0[n] - y[n]) / (self.tau * eta[:, None]) for n in y}
        dy = {n: y[n] - x0[n] for n in y}
        dc = {n: cm_new[n] - cm[n] for n in y}
        up = ClientUpdates(dy, np.ones(k), np.asarray(cohort), self.tau, extra={"dc": dc})
        return ClientResult(up, {"c_theta": cm_new["theta"], "c_w": cm_new["w"]})

    def server_update(self, state, updates, ctx):
        """Averages the model changes, then c ← c + (|S|/M)·mean Δc_m."""
        new = super().server_update(state, updates, ctx)
        frac = len(updates.cohort) / state.extra["num_clients"]
        dc = updates.extra["dc"]
        new.extra["c"] = {n: state.extra["c"][n] + frac * dc[n].mean(0) for n in dc}
        return new
