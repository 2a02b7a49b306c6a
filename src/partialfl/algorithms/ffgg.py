"""FFGG — Fine-tuning Followed by Global Gradient (the paper's Algorithm 1).

Round r, for each sampled client m ∈ C_r (stateless):
    w_m ≈ argmin_w f_m(θʳ, w)        (any local solver, started afresh)
    g_m = ∇₁ f_m(θʳ, w_m)            (sent to the server)
Server: θʳ⁺¹ = θʳ − γ · agg({g_m}),  γ = 1/L by default (Theorem 1), agg = mean.
With exact fine-tuning g_m = F_m(θʳ), so FFGG is (stochastic) gradient descent on the
personalized risk (1/M)Σ_m min_w f_m(θ, w) (Theorem 4).
"""

from __future__ import annotations

import numpy as np

from partialfl.algorithms.base import Algorithm, ClientResult, Deployed, RoundContext
from partialfl.algorithms.common import loss_metric
from partialfl.algorithms.context import AlgorithmContext
from partialfl.registry import register
from partialfl.types import ClientUpdates


class FFGG(Algorithm):
    """FFGG (Algorithm 1): every sampled client fine-tunes its w from scratch for the current θ with
    ``solver`` and sends ∇_θ f_m(θ, w); the server aggregates and steps with ``server_opt``.

    ``weighting``: ``uniform`` (every client counts the same) or ``examples`` (by its number of
    examples)."""

    name = "ffgg"
    pseudo_gradient = "gradient"

    def __init__(self, solver, server_opt=None, aggregator=None, weighting: str = "uniform"):
        super().__init__(server_opt, aggregator)
        if weighting not in ("uniform", "examples"):
            raise ValueError(f"unknown weighting {weighting!r}; allowed: 'uniform', 'examples'")
        self.solver = solver
        self.weighting = weighting

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        """∇_θ f_m(θ, ŵ_m) of every client of the cohort, with ŵ_m the solver's fine-tuned w."""
        theta = state.theta
        fused = getattr(self.solver, "with_gradient", None)  # one pass where it applies
        both = None if fused is None else fused(problem, cohort, theta, ctx.seed, ctx.round,
                                                mode=ctx.mode)
        if both is None:
            sol = self.solver(problem, cohort, theta, ctx.seed, ctx.round, mode=ctx.mode)
            g = problem.grad_theta(cohort, theta, sol.w, mode=ctx.mode)
        else:
            sol, g = both
        weights = (problem.num_examples(cohort) if self.weighting == "examples"
                   else np.ones(len(cohort)))
        return ClientResult(ClientUpdates(g, weights, np.asarray(cohort), sol.grad_evals + 1,
                                          metrics=loss_metric(getattr(sol, "loss", None))))

    def deploy(self, state, problem, cohort, client_state, ctx):
        """θ with each client's w fine-tuned afresh by the solver (what a client would deploy)."""
        return Deployed(state.theta, self.solver(problem, np.asarray(cohort), state.theta,
                                                 ctx.seed, -1, mode=ctx.mode).w)


@register("algorithm", "ffgg", split="personal", sends="gradient")
def _ffgg(opts: None, ctx: AlgorithmContext) -> FFGG:
    """FFGG (Algorithm 1): each sampled client fine-tunes its w from scratch with the stage's
    fine-tuner and sends ∇_θ f_m(θ, w); the server aggregates and steps."""
    return FFGG(ctx.finetuner(), **ctx.common())
