"""Algorithms for model problems (:class:`partialfl.problems.model.ModelProblem`).

All local training goes through :func:`partialfl.local.sgd.run_sgd`; what leaves a client is
a :class:`~partialfl.types.ClientUpdates` over the *global* names only. FFGG itself is
:class:`partialfl.algorithms.ffgg.FFGG` with the :class:`~partialfl.local.sgd.SGDFineTuner`
local solver (see :func:`model_ffgg`).

* :class:`FedAvg` — non-personalized: SGD epochs on every parameter from θʳ, send
  Δ = θ_local − θʳ; the server steps with −mean Δ (server SGD lr 1 = averaging, Adam = FedAdam).
  Its problem must have no personal parameter (split ``none``); a model with BatchNorm keeps
  each client's running statistics on the client (runtime-held client state, never sent).
* :class:`LocalFFGG` — the paper's Algorithm 4: w ← init, one epoch of SGD on w (θʳ fixed),
  then K alternating stochastic steps (a w-step, then a θ-step at the new w, per minibatch);
  send Δθ = θ_K − θʳ. Stateless.
* :class:`FedAlt` / :class:`FedSim` — Pillutla et al. (2022): client m keeps w_m across rounds
  (runtime-held client state, never sent). FedAlt: SGD epochs on w_m with θʳ fixed, then SGD
  epochs on θ with the new w_m fixed; FedSim: SGD epochs on (θ, w_m) jointly. Both send
  Δθ = θ_local − θʳ. ``stateless=True`` restarts w_m from its initialisation every round.
  FedAlt's θ-phase may use its own ``local_theta`` epochs (FedRep: many head epochs, then
  few body epochs). BatchNorm running statistics travel with w_m (see
  :class:`~partialfl.problems.model.ModelProblem`).

``weighting``: aggregation weights sent with the updates, ``"uniform"`` (1 per client, the
paper's (1/M)Σ_m objective) or ``"examples"`` (n_m); they only matter with a weighted
aggregator such as ``Mean(weighted=True)``.
"""

from __future__ import annotations

import numpy as np

from partialfl.algorithms.base import Algorithm, ClientResult, Deployed, RoundContext
from partialfl.algorithms.ffgg import FFGG
from partialfl.local.sgd import SGDConfig, SGDFineTuner, run_sgd
from partialfl.problems.model import W_INITS
from partialfl.types import ClientUpdates, Params

WEIGHTINGS = ("uniform", "examples")


def _check_weighting(weighting: str) -> str:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
    return weighting


def _check_init(init: str) -> str:
    if init not in W_INITS:
        raise ValueError(f"unknown w initialisation {init!r}; allowed: {', '.join(W_INITS)}")
    return init


def _weights(problem, cohort, weighting: str) -> np.ndarray:
    if weighting == "examples":
        return problem.num_examples(cohort).astype(np.float64)
    return np.ones(len(cohort))


def _delta(theta_local: Params, theta: Params) -> Params:
    """Per-client θ change ``[k, ...]`` (θ_local stacked, θ shared)."""
    return {n: theta_local[n] - theta[n].unsqueeze(0) for n in theta}


def model_ffgg(finetune: SGDConfig, init: str = "pretrained", server_opt=None, aggregator=None,
               weighting: str = "uniform") -> FFGG:
    """FFGG (Algorithm 1) on a model problem: each sampled client fine-tunes a fresh w with
    ``finetune`` SGD epochs (θʳ fixed, w from ``init``) and sends ∇_θ f_m(θʳ, w_m) on its full
    training data."""
    return FFGG(SGDFineTuner(finetune, _check_init(init)), server_opt, aggregator, weighting)


class FedAvg(Algorithm):
    """FedAvg on a model problem with every parameter global (see the module docstring)."""

    name = "fedavg"
    pseudo_gradient = "delta"

    def __init__(self, local: SGDConfig, server_opt=None, aggregator=None,
                 weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        self.local = local
        self.weighting = _check_weighting(weighting)

    def _check(self, problem) -> None:
        if getattr(problem, "w_names", ()):
            raise ValueError(
                "FedAvg trains one shared model: build its problem with split 'none' (every "
                f"parameter global); this problem has personal parameters "
                f"{list(problem.w_names)[:4]}"
            )

    def init_client_state(self, problem) -> Params | None:
        """Each client's normalization running statistics, if the model has any."""
        if not getattr(problem, "state_names", ()):
            return None
        return problem.init_w(np.arange(problem.num_clients), "pretrained", 0, 0)

    def _stats(self, problem, cohort, ctx, client_state) -> Params:
        if client_state is not None:
            return {n: v.clone() for n, v in client_state.items()}
        if getattr(problem, "state_names", ()):  # a runtime without client state
            return problem.init_w(cohort, "pretrained", ctx.seed, ctx.round)
        return {}

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        """The model change after the local SGD epochs on every parameter (all global)."""
        self._check(problem)
        stats = self._stats(problem, cohort, ctx, client_state)
        res = run_sgd(problem, cohort, state.theta, stats, train="theta", cfg=self.local,
                      seed=ctx.seed, round_=ctx.round, stream="local")
        up = ClientUpdates(_delta(res.theta, state.theta), _weights(problem, cohort,
                           self.weighting), np.asarray(cohort), res.steps,
                           metrics={"train_loss": res.loss})
        return ClientResult(up, res.w if client_state is not None else None)

    def deployed(self, state, problem, client_state, ctx):
        """The global model on every client (no personal parameters)."""
        self._check(problem)
        allc = np.arange(problem.num_clients)
        return Deployed(state.theta, self._stats(problem, allc, ctx, client_state))


class LocalFFGG(Algorithm):
    """Algorithm 4 (Local FFGG) on a model problem.

    Args:
        finetune: the w-only warm-up (default use: one epoch) before the local steps.
        local: the alternating phase; ``local.steps`` = K (or ``local.epochs`` passes).
        w_init: how w starts every round (``pretrained``, ``zero``, ``random``).
    """

    name = "local-ffgg"
    pseudo_gradient = "delta"

    def __init__(self, finetune: SGDConfig, local: SGDConfig, w_init: str = "pretrained",
                 server_opt=None, aggregator=None, weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        self.finetune, self.local = finetune, local
        self.w_init = _check_init(w_init)
        self.weighting = _check_weighting(weighting)

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        """Fine-tune w (``finetune``), then the alternating (w, θ) steps (``local``); sends the θ
        change."""
        w = problem.init_w(cohort, self.w_init, ctx.seed, ctx.round)
        r1 = run_sgd(problem, cohort, state.theta, w, train="w", cfg=self.finetune,
                     seed=ctx.seed, round_=ctx.round, stream="finetune")
        r2 = run_sgd(problem, cohort, state.theta, r1.w, train="alternate", cfg=self.local,
                     seed=ctx.seed, round_=ctx.round, stream="local")
        up = ClientUpdates(_delta(r2.theta, state.theta),
                           _weights(problem, cohort, self.weighting), np.asarray(cohort),
                           r1.steps + 2 * r2.steps, metrics={"train_loss": r2.loss})
        return ClientResult(up)

    def deployed(self, state, problem, client_state, ctx):
        """θ with every client's w fine-tuned by the ``finetune`` SGD."""
        allc = np.arange(problem.num_clients)
        sol = SGDFineTuner(self.finetune, self.w_init)(problem, allc, state.theta, ctx.seed, -1)
        return Deployed(state.theta, sol.w)


class _PersonalState(Algorithm):
    """FedAlt / FedSim: personal parameters held by the runtime's client side."""

    pseudo_gradient = "delta"

    def __init__(self, local: SGDConfig, w_init: str = "pretrained", stateless: bool = False,
                 init_seed: int = 0, server_opt=None, aggregator=None,
                 weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        self.local = local
        self.w_init = _check_init(w_init)
        self.stateless = bool(stateless)
        self.stateful_clients = not self.stateless
        self.init_seed = int(init_seed)
        self.weighting = _check_weighting(weighting)

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
        return {n: v.clone() for n, v in client_state.items()}

    def _local(self, problem, cohort, theta, w, ctx) -> tuple[Params, Params, int, np.ndarray]:
        raise NotImplementedError

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        w = self._start_w(problem, cohort, ctx, client_state)
        theta_local, w_new, steps, loss = self._local(problem, cohort, state.theta, w, ctx)
        up = ClientUpdates(_delta(theta_local, state.theta),
                           _weights(problem, cohort, self.weighting), np.asarray(cohort), steps,
                           metrics={"train_loss": loss})
        return ClientResult(up, None if self.stateless else w_new)

    def deployed(self, state, problem, client_state, ctx):
        if not self.stateless:
            return Deployed(state.theta, client_state)
        # stateless: what a client would use = its w-phase from the initialisation
        allc = np.arange(problem.num_clients)
        sol = SGDFineTuner(self.local, self.w_init)(problem, allc, state.theta, ctx.seed, -1)
        return Deployed(state.theta, sol.w)


class FedAlt(_PersonalState):
    """FedAlt (Pillutla et al. 2022, alternating): ``local`` epochs on w_m with θʳ fixed,
    then ``local_theta`` epochs (default: ``local``) on θ with the new w_m fixed."""

    name = "fedalt"

    def __init__(self, local: SGDConfig, w_init: str = "pretrained", stateless: bool = False,
                 init_seed: int = 0, server_opt=None, aggregator=None,
                 weighting: str = "uniform", local_theta: SGDConfig | None = None) -> None:
        super().__init__(local, w_init, stateless, init_seed, server_opt, aggregator,
                         weighting)
        self.local_theta = local if local_theta is None else local_theta

    def _local(self, problem, cohort, theta, w, ctx):
        r1 = run_sgd(problem, cohort, theta, w, train="w", cfg=self.local, seed=ctx.seed,
                     round_=ctx.round, stream="local-w")
        r2 = run_sgd(problem, cohort, theta, r1.w, train="theta", cfg=self.local_theta,
                     seed=ctx.seed, round_=ctx.round, stream="local-theta")
        # r2.w: r1's w_m (not trained in the θ-phase) with the running statistics after it
        return r2.theta, r2.w, r1.steps + r2.steps, r2.loss


class FedSim(_PersonalState):
    """FedSim (Pillutla et al. 2022, simultaneous): local epochs on (θ, w_m) jointly."""

    name = "fedsim"

    def _local(self, problem, cohort, theta, w, ctx):
        r = run_sgd(problem, cohort, theta, w, train="both", cfg=self.local, seed=ctx.seed,
                    round_=ctx.round, stream="local")
        return r.theta, r.w, r.steps, r.loss
