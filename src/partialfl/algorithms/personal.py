"""Algorithms that keep a personal w on every client and train θ locally, on any problem.

What leaves a client is a :class:`~partialfl.types.ClientUpdates` over the *global* names
only. The client optimizer is any local trainer (:class:`~partialfl.local.sgd.SGDConfig`:
SGD epochs on a model problem; :class:`~partialfl.local.gd.GDConfig`: full-gradient steps on
any problem, e.g. least squares).

* :class:`LocalFFGG` — the paper's Algorithm 4: w ← init, a run on w (θʳ fixed), then K
  alternating steps (a w-step, then a θ-step at the new w); send Δθ = θ_K − θʳ. Stateless.
* :class:`FedAlt` / :class:`FedSim` — Pillutla et al. (2022): client m keeps w_m across rounds
  (runtime-held client state, never sent). FedAlt: a run on w_m with θʳ fixed, then a run on
  θ with the new w_m fixed; FedSim: a run on (θ, w_m) jointly. Both send Δθ = θ_local − θʳ.
  ``stateless=True`` restarts w_m from its initialisation every round. FedAlt's θ-phase may
  use its own ``local_theta`` trainer (FedRep: many head epochs, then few body epochs).
  Normalization running statistics travel with w_m (see
  :class:`~partialfl.problems.model.ModelProblem`).

``weighting``: aggregation weights sent with the updates, ``"uniform"`` (1 per client, the
paper's (1/M)Σ_m objective) or ``"examples"`` (n_m); they only matter with a weighted
aggregator such as ``Mean(weighted=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialfl.algorithms.base import Algorithm, ClientResult, Deployed, RoundContext
from partialfl.algorithms.common import (
    DeployAll,
    check_init,
    check_weighting,
    client_weights,
    delta,
    finetuned_w,
    loss_metric,
)
from partialfl.algorithms.context import AlgorithmContext
from partialfl.local.base import LocalTrainer
from partialfl.registry import option, register
from partialfl.tree import tree_copy
from partialfl.types import ClientUpdates, Params


class LocalFFGG(DeployAll, Algorithm):
    """Algorithm 4 (Local FFGG) on a model problem.

    Args:
        finetune: the w-only warm-up (default use: one epoch) before the local steps.
        local: the alternating phase (SGD: ``local.steps`` = K or ``local.epochs`` passes;
            GD: ``local.tau`` = K full-gradient step pairs).
        w_init: how w starts every round (``pretrained``, ``zero``, ``random``).
    """

    name = "local-ffgg"
    pseudo_gradient = "delta"

    def __init__(self, finetune: LocalTrainer, local: LocalTrainer, w_init: str = "pretrained",
                 server_opt=None, aggregator=None, weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        self.finetune, self.local = finetune, local
        self.w_init = check_init(w_init)
        self.weighting = check_weighting(weighting)

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        """Fine-tune w (``finetune``), then the alternating (w, θ) steps (``local``); sends the θ
        change."""
        w = problem.init_w(cohort, self.w_init, ctx.seed, ctx.round)
        r1 = self.finetune.run(problem, cohort, state.theta, w, "w", seed=ctx.seed,
                               round_=ctx.round, stream="finetune", mode=ctx.mode)
        r2 = self.local.run(problem, cohort, state.theta, r1.w, "alternate", seed=ctx.seed,
                            round_=ctx.round, stream="local", mode=ctx.mode)
        up = ClientUpdates(delta(r2.theta, state.theta),
                           client_weights(problem, cohort, self.weighting), np.asarray(cohort),
                           r1.steps + 2 * r2.steps, metrics=loss_metric(r2.loss))
        return ClientResult(up)

    def deploy(self, state, problem, cohort, client_state, ctx):
        """θ with each client's w fine-tuned by the ``finetune`` run."""
        return Deployed(state.theta, finetuned_w(self.finetune, problem, np.asarray(cohort),
                                                 state.theta, self.w_init, ctx.seed, -1,
                                                 ctx.mode))


class _PersonalState(DeployAll, Algorithm):
    """FedAlt / FedSim: personal parameters held by the runtime's client side."""

    pseudo_gradient = "delta"

    def __init__(self, local: LocalTrainer, w_init: str = "pretrained", stateless: bool = False,
                 init_seed: int = 0, server_opt=None, aggregator=None,
                 weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        self.local = local
        self.w_init = check_init(w_init)
        self.stateless = bool(stateless)
        self.stateful_clients = not self.stateless
        self.init_seed = int(init_seed)
        self.weighting = check_weighting(weighting)

    def init_client_state(self, problem) -> Params | None:
        """w_m⁰ for every client (``w_init``, round 0 of ``init_seed``), or None if stateless."""
        return self.init_client_state_rows(problem, np.arange(problem.num_clients))

    def init_client_state_rows(self, problem, cohort: np.ndarray) -> Params | None:
        """The rows of :meth:`init_client_state` for the given clients only."""
        if self.stateless:
            return None
        return problem.init_w(np.asarray(cohort), self.w_init, self.init_seed, 0)

    def _start_w(self, problem, cohort, ctx, client_state) -> Params:
        if self.stateless:
            return problem.init_w(cohort, self.w_init, ctx.seed, ctx.round)
        if client_state is None:
            raise ValueError(f"{self.name} keeps w on the clients: run it with a runtime that "
                             "holds client state (init_client_state)")
        return tree_copy(client_state)

    def _local(self, problem, cohort, theta, w, ctx) -> tuple[Params, Params, int, np.ndarray]:
        raise NotImplementedError

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        w = self._start_w(problem, cohort, ctx, client_state)
        theta_local, w_new, steps, loss = self._local(problem, cohort, state.theta, w, ctx)
        up = ClientUpdates(delta(theta_local, state.theta),
                           client_weights(problem, cohort, self.weighting), np.asarray(cohort),
                           steps, metrics=loss_metric(loss))
        return ClientResult(up, None if self.stateless else w_new)

    def deploy(self, state, problem, cohort, client_state, ctx):
        """θ with each client's own w_m (its rows of the client state), or, stateless, the
        w-phase from the initialisation."""
        if not self.stateless:
            return Deployed(state.theta, client_state)
        return Deployed(state.theta, finetuned_w(self.local, problem, np.asarray(cohort),
                                                 state.theta, self.w_init, ctx.seed, -1,
                                                 ctx.mode))


class FedAlt(_PersonalState):
    """FedAlt (Pillutla et al. 2022, alternating): a ``local`` run on w_m with θʳ fixed, then
    a ``local_theta`` run (default: ``local``) on θ with the new w_m fixed."""

    name = "fedalt"

    def __init__(self, local: LocalTrainer, w_init: str = "pretrained", stateless: bool = False,
                 init_seed: int = 0, server_opt=None, aggregator=None,
                 weighting: str = "uniform", local_theta: LocalTrainer | None = None) -> None:
        super().__init__(local, w_init, stateless, init_seed, server_opt, aggregator,
                         weighting)
        self.local_theta = local if local_theta is None else local_theta

    def _local(self, problem, cohort, theta, w, ctx):
        r1 = self.local.run(problem, cohort, theta, w, "w", seed=ctx.seed, round_=ctx.round,
                            stream="local-w", mode=ctx.mode)
        r2 = self.local_theta.run(problem, cohort, theta, r1.w, "theta", seed=ctx.seed,
                                  round_=ctx.round, stream="local-theta", mode=ctx.mode)
        # r2.w: r1's w_m (not trained in the θ-phase) with the running statistics after it
        return r2.theta, r2.w, r1.steps + r2.steps, r2.loss


class FedSim(_PersonalState):
    """FedSim (Pillutla et al. 2022, simultaneous): a ``local`` run on (θ, w_m) jointly."""

    name = "fedsim"

    def _local(self, problem, cohort, theta, w, ctx):
        r = self.local.run(problem, cohort, theta, w, "both", seed=ctx.seed, round_=ctx.round,
                           stream="local", mode=ctx.mode)
        return r.theta, r.w, r.steps, r.loss


@dataclass(frozen=True)
class LocalFFGGOptions:
    """Local FFGG's alternating phase."""

    local_steps: int | None = option(None, "K alternating (w, θ) steps (None: the client "
                                     "optimizer's epochs)")

    def __post_init__(self) -> None:
        if self.local_steps is not None and not (isinstance(self.local_steps, int)
                                                 and self.local_steps >= 1):
            raise ValueError(f"local_steps must be an integer >= 1, got {self.local_steps!r}")


@register("algorithm", "local-ffgg", options=LocalFFGGOptions, split="personal")
def _local_ffgg(opts: LocalFFGGOptions, ctx: AlgorithmContext) -> LocalFFGG:
    """Local FFGG (Algorithm 4): fine-tune w (one pass), then K alternating w- and θ-steps;
    send Δθ."""
    return LocalFFGG(ctx.warmup(), ctx.trainer(steps=opts.local_steps), w_init=ctx.w_init,
                     **ctx.common())


@dataclass(frozen=True)
class PersonalOptions:
    """Where w_m lives between rounds."""

    stateless: bool = option(False, "restart w_m from its initialisation every round "
                             "(nothing kept on the clients)")


@register("algorithm", "fedalt", options=PersonalOptions, split="personal")
def _fedalt(opts: PersonalOptions, ctx: AlgorithmContext) -> FedAlt:
    """FedAlt (Pillutla et al. 2022): a local run on w_m with θ fixed, then on θ with w_m
    fixed; w_m stays on the client."""
    return FedAlt(ctx.trainer(), w_init=ctx.w_init, stateless=opts.stateless, **ctx.common())


@register("algorithm", "fedsim", options=PersonalOptions, split="personal")
def _fedsim(opts: PersonalOptions, ctx: AlgorithmContext) -> FedSim:
    """FedSim (Pillutla et al. 2022): a local run on (θ, w_m) jointly; w_m stays on the
    client."""
    return FedSim(ctx.trainer(), w_init=ctx.w_init, stateless=opts.stateless, **ctx.common())
