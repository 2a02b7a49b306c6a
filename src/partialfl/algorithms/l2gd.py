"""L2GD — Loopless Local GD (Hanzely & Richtárik 2020), fully personalized baseline.

Each client owns a full model x_m = (θ_m, w_m) and the method minimises
    (1/M)Σ_m f_m(x_m) + λ/(2M) Σ_m ‖x_m − x̄‖².
At every iteration a shared coin ξ ~ Bernoulli(p) picks a local step
    x_m ← x_m − α/(M(1−p)) ∇f_m(x_m)                     (ξ = 0, no communication)
or an averaging step
    x_m ← x_m − αλ/(Mp) (x_m − x̄)                         (ξ = 1, one communication).
Defaults follow the paper's Sec. 4.2: λ = 0.1, p = 1/τ, and α = 1/(2L_F) with
L_F = (1/M)·max(L/(1−p), λ/p), L = max_m joint smoothness of f_m (Hanzely & Richtárik's
theory). A *round* here is one communication: the run of local steps drawn until the next
ξ = 1 (geometric, mean (1−p)/p), then the averaging step, which uses the x̄ the server
broadcast. All clients participate. Each client deploys its own x_m.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialfl import arrays
from partialfl import rng as prng
from partialfl.algorithms.base import Algorithm, ClientResult, Deployed
from partialfl.algorithms.common import DeployAll, pick, repeat_tree
from partialfl.algorithms.context import AlgorithmContext
from partialfl.algorithms.fedavg import shared_model, theta_part
from partialfl.config import ConfigError
from partialfl.local.base import check_tau
from partialfl.local.gd import GDConfig
from partialfl.registry import option, register
from partialfl.types import ClientUpdates, Params


class L2GD(DeployAll, Algorithm):
    """L2GD (Hanzely & Richtárik, 2020): one full model x_m per client, pulled towards the average
    with penalty ``lam``; each round makes a geometric number of local steps (communication
    probability ``p``, default 1/τ), then averages."""

    name = "l2gd"
    pseudo_gradient = "delta"
    stateful_clients = True

    def __init__(self, tau: int, lam: float = 0.1, p: float | None = None,
                 alpha_scale: float = 0.5, fast: bool = True) -> None:
        super().__init__()
        tau = check_tau(tau)
        p = 1.0 / tau if p is None else p
        if not 0 < p <= 1:
            raise ValueError(f"communication probability p must be in (0, 1], got {p}")
        if p == 1 and tau != 1:
            raise ValueError("p = 1 leaves no local steps")
        if not lam > 0:
            raise ValueError(f"penalty lambda must be positive, got {lam}")
        self.tau, self.lam, self.p, self.alpha_scale = int(tau), float(lam), float(p), alpha_scale
        self.fast = fast

    def _steps(self, problem) -> tuple[float, float]:
        M, p, lam = problem.num_clients, self.p, self.lam
        L = float(problem.L_joint_clients.max())
        L_F = max(L / (1 - p) if p < 1 else L, lam / p) / M
        alpha = self.alpha_scale / L_F
        local = alpha / (M * (1 - p)) if p < 1 else 0.0
        return local, alpha * lam / (M * p)

    def init(self, problem, theta0):
        """The server state with the average model x̄ = (θ⁰, w⁰)."""
        return super().init(problem, shared_model(problem, theta0))

    def init_client_state(self, problem) -> Params:
        """Every client's own model x_m = 0 (θ- and w-parts)."""
        x = shared_model(problem, problem.init_theta(None))
        return {n: arrays.zeros_like(v) for n, v in repeat_tree(x, problem.num_clients).items()}

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        """The averaging step that closed the previous round, then local steps on x_m until the coin
        says communicate; sends x_m − x̄. Each client's steps depend on the round's shared
        coin only, so any backend may compute the cohort in parts (one client per job too);
        the round needs every client (the registry's ``full_participation``, checked at
        build)."""
        local, avg = self._steps(problem)
        x = {n: arrays.copy(client_state[n]) for n in state.theta}
        if ctx.round > 0:  # the averaging step that closed the previous round
            for n in x:
                x[n] -= avg * (x[n] - state.theta[n][None])
        g = prng.generator(ctx.seed, "l2gd-coin", ctx.round)
        k = int(g.geometric(self.p)) - 1 if self.p < 1 else 0  # local steps before ξ = 1
        if k > 0:
            res = GDConfig(k, fast=self.fast).run(
                problem, cohort, theta_part(problem, x), pick(x, problem.w_names), "both",
                eta=np.full(len(cohort), local), mode=ctx.mode)
            x = {**res.theta, **res.w}
        delta = {n: x[n] - state.theta[n][None] for n in state.theta}
        up = ClientUpdates(delta, np.ones(len(cohort)), np.asarray(cohort), k)
        return ClientResult(up, {n: x[n] for n in state.theta})

    def deploy(self, state, problem, cohort, client_state, ctx):
        """Each client's own model x_m (its rows of the client state; the θ-part is personal
        too)."""
        return Deployed(theta_part(problem, client_state), pick(client_state, problem.w_names),
                        personalized_theta=True)

    def global_theta(self, state, problem) -> Params:
        """θ, the global part of the average model x̄."""
        return theta_part(problem, state.theta)


@dataclass(frozen=True)
class L2GDOptions:
    """L2GD's penalty and communication probability."""

    lam: float = option(0.1, "penalty λ > 0 pulling each x_m to the average")
    p: float | None = option(None, "communication probability (None: 1/τ)")

    def __post_init__(self) -> None:
        if not self.lam > 0:
            raise ValueError(f"lam must be > 0, got {self.lam!r}")
        if self.p is not None and not 0 < self.p <= 1:
            raise ValueError(f"p must be in (0, 1], got {self.p!r}")


@register("algorithm", "l2gd", options=L2GDOptions, split="none", shared_w=True,
          full_participation=True, problems=("closed-form",))  # one call for every client
def _l2gd(opts: L2GDOptions, ctx: AlgorithmContext) -> L2GD:
    """L2GD (Hanzely & Richtárik 2020): one full model per client pulled to the average with
    penalty λ; a geometric number of local GD steps per communication."""
    tau = getattr(ctx.local, "tau", None)
    if tau is None:
        raise ConfigError("l2gd takes full-gradient local steps: use client = {name = \"gd\", "
                          "tau = …}")
    if ctx.weighting != "uniform":
        raise ConfigError(f"l2gd: weighting {ctx.weighting!r}; allowed: 'uniform' (its "
                          "objective (1/M)·Σ_m f_m averages the client models uniformly)")
    alg = L2GD(tau, lam=opts.lam, p=opts.p)
    if ctx.aggregator is not None:  # the run's [aggregation] rule averages the x_m − x̄
        alg.aggregator = ctx.aggregator
    if ctx.server_opt is not None:  # the averaging step x̄ ← x̄ + lr·mean Δ (lr 1: its own)
        alg.server_opt = ctx.server_opt
    return alg
