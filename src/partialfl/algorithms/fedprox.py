"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith 2020, "Federated Optimization in
Heterogeneous Networks", Algorithm 2) on one shared model.

Round r, sampled client m: starting from xʳ, minimise the proximal local objective

    h_m(x; xʳ) = f_m(x) + (μ/2) ‖x − xʳ‖²

inexactly by local SGD epochs, each step a proximal-gradient step (the exact prox of the
(μ/2)‖x − xʳ‖² term, stable for every μ ≥ 0; the same solver as Ditto's personal model,
:func:`partialfl.local.sgd.run_sgd` with ``prox=(μ, xʳ)``):

    x ← x − η ∇f_m(x; b),    x ← (x + ημ xʳ) / (1 + ημ),

then send Δ_m = x − xʳ; the server steps with −agg Δ (SGD lr 1: averaging). μ = 0 is FedAvg
exactly. Model problems (SGD epochs); every parameter global (split ``none``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partialfl.algorithms.common import pick
from partialfl.algorithms.context import AlgorithmContext
from partialfl.algorithms.fedavg import FedAvg
from partialfl.registry import option, register


class FedProx(FedAvg):
    """FedAvg whose clients add the proximal term (μ/2)‖x − xʳ‖² (see the module
    docstring). ``local``: the client SGD; ``mu``: μ ≥ 0."""

    name = "fedprox"

    def __init__(self, local, mu: float, server_opt=None, aggregator=None,
                 weighting: str = "uniform") -> None:
        super().__init__(local, server_opt, aggregator, weighting)
        mu = float(mu)
        if not (mu >= 0 and math.isfinite(mu)):
            raise ValueError(f"FedProx's mu must be a finite number >= 0, got {mu!r}")
        self.mu = mu

    def _local_run(self, problem, cohort, state, ctx, client_state, shift=None):
        from partialfl.local.sgd import run_sgd

        theta, _ = self._parts(problem, state.theta)
        w = self._stats(problem, cohort, ctx, client_state)
        res = run_sgd(problem, cohort, theta, w, train="theta", cfg=self.local,
                      seed=ctx.seed, round_=ctx.round, stream="local", prox=(self.mu, theta),
                      mode=ctx.mode)
        stats = pick(res.w, problem.state_names) if client_state is not None else None
        return dict(res.theta), stats, res


@dataclass(frozen=True)
class FedProxOptions:
    """The proximal strength."""

    mu: float = option(0.01, "μ >= 0: the pull of each client's model to the round's θ "
                       "(0: FedAvg)")

    def __post_init__(self) -> None:
        if not (self.mu >= 0 and math.isfinite(self.mu)):
            raise ValueError(f"mu must be a finite number >= 0, got {self.mu!r}")


@register("algorithm", "fedprox", options=FedProxOptions, split="none", problems=("model",))
def _fedprox(opts: FedProxOptions, ctx: AlgorithmContext) -> FedProx:
    """FedProx (Li et al. 2020): FedAvg whose clients minimise f_m(x) + (μ/2)‖x − xʳ‖²."""
    return FedProx(ctx.trainer(), opts.mu, **ctx.common())
