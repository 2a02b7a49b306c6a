"""Ditto (Li, Hu, Beirami, Smith 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", Algorithm 1) on a model problem with every parameter global (split ``none``).

The global model θ is trained by FedAvg; every client m also keeps a *fully personal* model
v_m (all parameters), never sent, that solves

    min_v  f_m(v) + (λ/2) ‖v − θ‖².

Round r on a sampled client m: (1) FedAvg's local SGD epochs from θʳ, send Δ = θ_local − θʳ;
(2) ``personal`` SGD epochs on v_m, each step a proximal-gradient step towards the *received*
θʳ (:func:`partialfl.local.sgd.run_sgd` with ``prox=(λ, θʳ)``):

    v ← v − η ∇f_m(v; batch),   v ← (v + ηλ θʳ) / (1 + ηλ).

(Ditto's paper takes the plain gradient step on the sum; the proximal form is the same to
first order in ηλ and stays stable for large λ.) A client joins with v_m = θʳ the first time it
is sampled. Limits: λ = ∞ gives v_m = θʳ (FedAvg's global model); λ = 0 gives pure local
training of v_m from the global model at the client's first participation. With the FedAvg
part switched off (``local.epochs = 0``, θ never moves) and λ = 0, Ditto is *local training
only* from θ⁰ (:func:`local_only`).

Client state (runtime-held): ``"v/<name>"`` rows ``[M, ...]`` and ``"joined"`` ``[M]`` (1.0 once
the client has a personal model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partialfl.algorithms.base import Algorithm, ClientResult, Deployed, RoundContext
from partialfl.algorithms.common import check_weighting, client_weights, delta
from partialfl.algorithms.context import AlgorithmContext
from partialfl.local.sgd import SGDConfig
from partialfl.registry import option, register
from partialfl.types import ClientUpdates, Params

PREFIX = "v/"
JOINED = "joined"


def personal_models(problem, cohort, v: Params, centre: Params, cfg: SGDConfig, lam: float,
                    seed: int, round_: int, stream: str = "personal", mode=None
                    ) -> tuple[Params, np.ndarray]:
    """``cfg`` proximal SGD epochs on each client's full model ``v`` (stacked ``[k, ...]``)
    pulled to ``centre`` with strength λ (``mode``: the kernels' batching mode); returns
    (new v, mean loss per client)."""
    from partialfl.local.sgd import run_sgd

    if cfg.epochs == 0 and cfg.steps in (None, 0):
        return {n: t.clone() for n, t in v.items()}, np.full(len(cohort), np.nan)
    res = run_sgd(problem, cohort, v, {}, train="theta", cfg=cfg, seed=seed, round_=round_,
                  stream=stream, prox=(lam, centre), mode=mode)
    return res.theta, res.loss


class Ditto(Algorithm):
    """Ditto (see the module docstring).

    Args:
        local: FedAvg's local SGD for the global model (``epochs=0``: θ is not trained).
        personal: the SGD of the personal model v_m per round.
        lam: λ ≥ 0 (``math.inf`` allowed).
    """

    name = "ditto"
    pseudo_gradient = "delta"
    #: a per-client scalar (the personal model's minibatch loss), for the client-side log only:
    #: the runtime drops per-client metrics before the server (partialfl.privacy)
    client_metrics = ("personal_loss",)
    stateful_clients = True

    def __init__(self, local: SGDConfig, personal: SGDConfig, lam: float, server_opt=None,
                 aggregator=None, weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        lam = float(lam)
        if not lam >= 0 or math.isnan(lam):
            raise ValueError(f"Ditto's lambda must be >= 0 (inf allowed), got {lam!r}")
        self.local, self.personal, self.lam = local, personal, lam
        self.weighting = check_weighting(weighting)

    @staticmethod
    def _check(problem) -> None:
        if getattr(problem, "w_names", ()):
            raise ValueError("Ditto keeps a full personal copy of the model: build its problem "
                             "with split 'none'; this problem has personal parameters "
                             f"{list(problem.w_names)[:4]}")

    def init_client_state(self, problem) -> Params:
        import torch

        self._check(problem)
        M = problem.num_clients
        dev = getattr(problem, "device", None)
        out = {PREFIX + n: torch.zeros((M, *s), device=dev)
               for n, s in problem.theta_shapes.items()}
        out[JOINED] = torch.zeros(M, device=dev)
        return out

    @staticmethod
    def personal_v(theta: Params, client_state: Params) -> Params:
        """Each client's v (θ itself for a client that has not joined yet), stacked."""
        import torch

        joined = client_state[JOINED]
        out = {}
        for n, t in theta.items():
            v = client_state[PREFIX + n]
            mask = (joined > 0).reshape((-1,) + (1,) * t.dim())
            out[n] = torch.where(mask, v, t.unsqueeze(0).expand_as(v))
        return out

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        import torch

        from partialfl.local.sgd import run_sgd

        self._check(problem)
        if client_state is None:
            raise ValueError("Ditto keeps v_m on the clients: run it with a runtime that holds "
                             "client state (init_client_state)")
        theta = state.theta
        if self.local.epochs == 0 and self.local.steps in (None, 0):
            dtheta = {n: torch.zeros((len(cohort), *t.shape), device=t.device)
                     for n, t in theta.items()}
            steps, loss = 0, np.full(len(cohort), np.nan)
        else:
            r = run_sgd(problem, cohort, theta, {}, train="theta", cfg=self.local,
                        seed=ctx.seed, round_=ctx.round, stream="local", mode=ctx.mode)
            dtheta, steps, loss = delta(r.theta, theta), r.steps, r.loss
        v0 = self.personal_v(theta, client_state)
        v, ploss = personal_models(problem, cohort, v0, theta, self.personal, self.lam,
                                   ctx.seed, ctx.round, mode=ctx.mode)
        up = ClientUpdates(dtheta, client_weights(problem, cohort, self.weighting),
                           np.asarray(cohort), steps,
                           metrics={"train_loss": loss, "personal_loss": ploss})
        new_state = {PREFIX + n: t for n, t in v.items()}
        new_state[JOINED] = torch.ones(len(cohort), device=client_state[JOINED].device)
        return ClientResult(up, new_state)

    def deploy(self, state, problem, cohort, client_state, ctx):
        """Each client's v_m (θ for a client never sampled yet), as a per-client θ."""
        return Deployed(self.personal_v(state.theta, client_state), {}, personalized_theta=True)


def local_only(personal: SGDConfig) -> Ditto:
    """Local training only, as Ditto with λ = 0 and no global training (θ stays θ⁰: every
    client trains its own copy of θ⁰ and shares nothing)."""
    return Ditto(SGDConfig(lr=personal.lr, epochs=0, batch_size=personal.batch_size),
                 personal, 0.0)


@dataclass(frozen=True)
class DittoOptions:
    """Ditto's proximal strength."""

    lam: float | None = option(None, "λ >= 0 pulling each personal model to θ (finite here; "
                               "the Python class Ditto also takes inf: v_m = θ)")

    def __post_init__(self) -> None:
        if self.lam is None or not float(self.lam) >= 0:
            raise ValueError(f"Ditto needs lam >= 0, got {self.lam!r}")


@register("algorithm", "ditto", options=DittoOptions, split="full", problems=("model",))
def _ditto(opts: DittoOptions, ctx: AlgorithmContext) -> Ditto:
    """Ditto (Li et al. 2021): θ by FedAvg, and a fully personal model v_m per client pulled
    to θ with strength λ (proximal SGD)."""
    sgd = ctx.trainer()
    return Ditto(sgd, sgd, float(opts.lam), server_opt=ctx.server_opt,
                 aggregator=ctx.aggregator, weighting=ctx.weighting)


@register("algorithm", "local", split="full", fresh_model=True, problems=("model",))
def _local(opts: None, ctx: AlgorithmContext) -> Ditto:
    """Local training only: every client trains its own copy of a fresh model; nothing is
    shared."""
    return local_only(ctx.trainer())
