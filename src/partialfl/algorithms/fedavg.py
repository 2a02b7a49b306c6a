"""FedAvg = Local GD, and Scaffold: local training on one shared model, on any problem.

The shared model x holds every trained parameter: θ (``problem.theta_names``) and, with
``share_w=True``, one copy of w shared by all clients (``problem.w_names``: the paper's
non-personalized baseline on the joint variable (θ, w)). Round r, sampled client m:

    x_m ← the local trainer's run from xʳ on f_m,    send Δ_m = x_m − xʳ,
    server: x ← opt(x, −agg Δ)   (server SGD with lr 1 is plain averaging; Adam is FedAdam).

The local trainer makes the names: τ full-gradient steps with η = 1/L_m
(:class:`~partialfl.local.gd.GDConfig`) is *Local GD* (:class:`LocalGD`), SGD epochs
(:class:`~partialfl.local.sgd.SGDConfig`) is *FedAvg*. Personal client state (normalization
running statistics, ``problem.state_names``) stays on the client (runtime-held, never sent).

:class:`Scaffold` — Karimireddy et al. (2020), option II control variates, global step 1:
y ← y − η(∇f_m(y) − c_m + c) for τ steps; c_m⁺ = c_m − c + (x − y)/(τη); the client sends Δy
and Δc_m = c_m⁺ − c_m; x ← x + mean(Δy), c ← c + (|C|/M)·mean(Δc). c_m lives on the client
(runtime-held state, ``"c_" + name`` per leaf), c on the server.

The deployed model is the shared one on every client (its w copied to each).
"""

from __future__ import annotations

import numpy as np

from partialfl import arrays
from partialfl.algorithms.base import Algorithm, ClientResult, Deployed, RoundContext
from partialfl.algorithms.common import (
    DeployAll,
    check_init,
    check_weighting,
    client_weights,
    delta,
    loss_metric,
    pick,
    repeat_tree,
)
from partialfl.algorithms.context import AlgorithmContext
from partialfl.local.gd import GDConfig
from partialfl.registry import register
from partialfl.tree import tree_copy
from partialfl.types import ClientUpdates, Params


def shared_model(problem, theta0: Params, w_init: str = "pretrained") -> Params:
    """The non-personalized model x = (θ⁰, w⁰): θ⁰ plus one shared w⁰ (``w_init``, client 0's
    draw) for the problem's personal names, unless ``theta0`` has them already.

    A shared w must mean the same on every client: a problem that keeps w in per-client
    coordinates says so through its ``check_shareable_w`` (least squares in its eigenbasis).
    """
    check = getattr(problem, "check_shareable_w", None)
    if check is not None:
        check()
    names = tuple(problem.w_names)
    if all(n in theta0 for n in names):
        return theta0
    w0 = problem.init_w(np.arange(1), w_init, 0, 0)
    return {**theta0, **{n: w0[n][0] for n in names}}


def theta_part(problem, x: Params) -> Params:
    """The global θ of a shared model (its leaves named in ``problem.theta_names``)."""
    return pick(x, problem.theta_names)


class FedAvg(DeployAll, Algorithm):
    """FedAvg / Local GD on one shared model (see the module docstring).

    Args:
        local: the client optimizer (:class:`~partialfl.local.sgd.SGDConfig` or
            :class:`~partialfl.local.gd.GDConfig`).
        weighting: ``uniform`` or ``examples`` aggregation weights.
        share_w: train and share the problem's personal parameters too (else a problem with
            personal parameters is refused: build it with split ``none``).
        w_init: where a shared w starts (``pretrained``: the problem's own values).
    """

    name = "fedavg"
    pseudo_gradient = "delta"

    def __init__(self, local, server_opt=None, aggregator=None, weighting: str = "uniform",
                 share_w: bool = False, w_init: str = "pretrained") -> None:
        super().__init__(server_opt, aggregator)
        self.local = local
        self.weighting = check_weighting(weighting)
        self.share_w = bool(share_w)
        self.w_init = check_init(w_init)

    # -- the shared model ------------------------------------------------------------------
    def _w_names(self, problem) -> tuple[str, ...]:
        names = tuple(problem.w_names)
        if names and not self.share_w:
            raise ValueError(
                f"{self.name} trains one shared model: build its problem with split 'none' "
                f"(every parameter global) or share w too (share_w=True); this problem has "
                f"personal parameters {list(names)[:4]}")
        return names

    def _parts(self, problem, x: Params) -> tuple[Params, Params]:
        """(θ, shared w) of the shared model."""
        return theta_part(problem, x), pick(x, self._w_names(problem))

    def _stats(self, problem, cohort, ctx, client_state) -> Params:
        """The cohort's personal client state (running statistics), never trained or sent."""
        names = tuple(problem.state_names)
        if not names:
            return {}
        if client_state is not None:
            return tree_copy(pick(client_state, names))
        return pick(problem.init_w(cohort, "pretrained", ctx.seed, ctx.round), names)

    def _train(self, problem) -> str:
        return "both" if self._w_names(problem) else "theta"

    # -- Algorithm -------------------------------------------------------------------------
    def init(self, problem, theta0):
        """The server state with the shared model (θ⁰, and w⁰ if w is shared)."""
        x = shared_model(problem, theta0, self.w_init) if self._w_names(problem) else theta0
        return super().init(problem, x)

    def init_client_state(self, problem) -> Params | None:
        """Each client's normalization running statistics, if the model has any."""
        return self.init_client_state_rows(problem, np.arange(problem.num_clients))

    def init_client_state_rows(self, problem, cohort: np.ndarray) -> Params | None:
        """The rows of :meth:`init_client_state` for the given clients only."""
        if not problem.state_names:
            return None
        return pick(problem.init_w(np.asarray(cohort), "pretrained", 0, 0), problem.state_names)

    def _local_run(self, problem, cohort, state, ctx, client_state, shift=None):
        """(the shared model after the cohort's local run ``[k, ...]``, the new client state,
        the trainer's result)."""
        theta, w_sh = self._parts(problem, state.theta)
        w = {**repeat_tree(w_sh, len(cohort)), **self._stats(problem, cohort, ctx, client_state)}
        res = self.local.run(problem, cohort, theta, w, self._train(problem), seed=ctx.seed,
                             round_=ctx.round, stream="local", shift=shift, mode=ctx.mode)
        x = {**res.theta, **pick(res.w, w_sh)}
        new_stats = pick(res.w, problem.state_names) if client_state is not None else None
        return x, new_stats, res

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        """The model change after the local run on every shared parameter."""
        cohort = np.asarray(cohort)
        x, stats, res = self._local_run(problem, cohort, state, ctx, client_state)
        up = ClientUpdates(delta(x, state.theta), client_weights(problem, cohort, self.weighting),
                           cohort, res.steps, metrics=loss_metric(res.loss))
        return ClientResult(up, stats)

    def deploy(self, state, problem, cohort, client_state, ctx):
        """The shared model on each client of the cohort (its w copied to each, with the
        client's running statistics)."""
        cohort = np.asarray(cohort)
        theta, w_sh = self._parts(problem, state.theta)
        w = {**repeat_tree(w_sh, len(cohort)), **self._stats(problem, cohort, ctx, client_state)}
        return Deployed(theta, w)

    def global_theta(self, state, problem) -> Params:
        """θ, the global part of the shared model."""
        return theta_part(problem, state.theta)


class LocalGD(FedAvg):
    """Local GD on the shared model (θ, w): τ full-gradient local steps with stepsize ``lr``
    (default 1/L_m per client), the server averages the model changes. ``fast``: the
    problem's closed form of τ steps where it has one."""

    name = "local-gd"

    def __init__(self, tau: int, lr: float | None = None, server_opt=None, aggregator=None,
                 fast: bool = True) -> None:
        super().__init__(GDConfig(tau, lr, fast), server_opt, aggregator, share_w=True)
        self.tau, self.lr, self.fast = self.local.tau, lr, fast


class Scaffold(FedAvg):
    """Scaffold (Karimireddy et al., 2020) on the shared model: local steps corrected by control
    variates, x ← x − η(∇f_m(x) − c_m + c); clients keep c_m, the server c.

    ``Scaffold(tau, lr)``: τ full-gradient steps (η = 1/L_m unless ``lr``), as Local GD;
    ``Scaffold(local=SGDConfig(...))``: minibatch SGD steps (τ_m = the steps client m took).
    """

    name = "scaffold"
    extra_names = ("dc",)  # the control-variate change Δc, θ-shaped, global
    stateful_clients = True
    fixed_extra = ("num_clients",)  # M in the step c ← c + (|C|/M)·mean Δc

    def __init__(self, tau: int | None = None, lr: float | None = None, server_opt=None,
                 aggregator=None, fast: bool = True, *, local=None,
                 weighting: str = "uniform") -> None:
        if (local is None) == (tau is None):
            raise ValueError("Scaffold needs either tau (full-gradient local steps) or local "
                             "(a local trainer such as SGDConfig), not both")
        local = GDConfig(tau, lr, fast) if local is None else local
        super().__init__(local, server_opt, aggregator, weighting, share_w=True)
        self.tau, self.lr, self.fast = getattr(local, "tau", None), lr, fast

    def init(self, problem, theta0):
        """The shared model and the server's control variate c = 0."""
        s = super().init(problem, theta0)
        s.extra["c"] = {n: arrays.zeros_like(v) for n, v in s.theta.items()}
        s.extra["num_clients"] = problem.num_clients
        return s

    def init_client_state(self, problem) -> Params:
        """Every client's control variate c_m = 0 (one leaf ``c_<name>`` per shared leaf)."""
        return self.init_client_state_rows(problem, np.arange(problem.num_clients))

    def init_client_state_rows(self, problem, cohort: np.ndarray) -> Params:
        """Control variates c_m = 0 of the given clients (and their running statistics)."""
        x = shared_model(problem, problem.init_theta(None), self.w_init)
        c = {f"c_{n}": arrays.zeros_like(v) for n, v in repeat_tree(x, len(cohort)).items()}
        return {**c, **(super().init_client_state_rows(problem, cohort) or {})}

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        """τ corrected local steps; sends the model change and the change of c_m (option II update
        c_m ← c_m − c + (x − y)/(τη))."""
        cohort = np.asarray(cohort)
        x0, c = state.theta, state.extra["c"]
        cm = {n: client_state[f"c_{n}"] for n in x0}
        shift = {n: cm[n] - c[n] for n in cm}
        y, stats, res = self._local_run(problem, cohort, state, ctx, client_state, shift=shift)
        steps = np.full(len(cohort), res.steps) if res.client_steps is None else res.client_steps
        idle = steps == 0  # a client without a step keeps its c_m
        step_eta = np.where(idle, 1.0, steps * self.local.stepsizes(problem, cohort))
        cm_new = {n: cm[n] - c[n] + (x0[n][None] - y[n]) / arrays.per_row(step_eta, y[n])
                  for n in y}
        if idle.any():
            cm_new = {n: arrays.where_rows(idle, cm[n], v) for n, v in cm_new.items()}
        dc = {n: cm_new[n] - cm[n] for n in y}
        up = ClientUpdates(delta(y, x0), client_weights(problem, cohort, self.weighting), cohort,
                           res.steps, metrics=loss_metric(res.loss), extra={"dc": dc})
        return ClientResult(up, {**{f"c_{n}": v for n, v in cm_new.items()}, **(stats or {})})

    def server_update(self, state, updates, ctx):
        """Averages the model changes, then c ← c + (|S|/M)·mean Δc_m."""
        new = super().server_update(state, updates, ctx)
        frac = len(updates.cohort) / state.extra["num_clients"]
        dc = updates.extra["dc"]
        new.extra["c"] = {n: state.extra["c"][n] + frac * dc[n].mean(0) for n in dc}
        return new


@register("algorithm", "fedavg", aliases=("local-gd",), split="none", shared_w=True)
def _fedavg(opts: None, ctx: AlgorithmContext) -> FedAvg:
    """FedAvg / Local GD (McMahan et al. 2017): local training of one shared model from θʳ,
    the server steps with −mean Δ (SGD lr 1: averaging; Adam: FedAdam)."""
    return FedAvg(ctx.trainer(), **ctx.common(), share_w=True, w_init=ctx.w_init)


@register("algorithm", "scaffold", split="none", shared_w=True)
def _scaffold(opts: None, ctx: AlgorithmContext) -> Scaffold:
    """Scaffold (Karimireddy et al. 2020): local steps corrected by control variates c_m
    (kept on the clients) and c (on the server)."""
    return Scaffold(local=ctx.trainer(), **ctx.common())
