"""APFL — Adaptive Personalized Federated Learning (Deng, Kamani, Mahdavi 2020,
arXiv:2003.13461, Algorithm 1) on a model problem with every parameter global.

The global model θ is trained by FedAvg; client m also keeps a local model v_m and a mixing
weight α_m ∈ [0, 1] (runtime-held client state, never sent), and deploys the mixture

    v̄_m = α_m v_m + (1 − α_m) θ.

Each local step on a minibatch b (θ_m the client's copy of θ, every update from the values
before the step):

    g_θ = ∇f_m(θ_m; b),                      θ_m ← θ_m − η g_θ,
    g   = ∇f_m(v̄_m; b),  v̄_m = α v_m + (1 − α) θ_m,
    v_m ← v_m − η α g,                          (∇_v f_m(v̄_m) = α g)
    α   ← Π_[0,1](α − η_α ⟨v_m − θ_m, g⟩)      (adaptive mixing, ``adaptive``),

then send Δ = θ_m − θʳ; the server steps with −agg Δ (SGD lr 1: averaging). A client's
v_m starts as θʳ when it is first sampled, α_m at ``alpha``. With α fixed at 0 the clients
deploy θ (FedAvg); at 1 they train v_m alone from θ (local training after joining).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partialfl.algorithms.base import Algorithm, ClientResult, Deployed, RoundContext
from partialfl.algorithms.common import check_weighting, client_weights, delta
from partialfl.algorithms.context import AlgorithmContext
from partialfl.algorithms.ditto import JOINED, PREFIX, Ditto
from partialfl.local.sgd import SGDConfig
from partialfl.registry import option, register
from partialfl.types import ClientUpdates, Params

ALPHA = "alpha"


class APFL(Algorithm):
    """APFL (see the module docstring). ``local``: the client SGD (θ and v share its
    minibatches and stepsize η); ``alpha``: α_m at a client's first round; ``alpha_lr``:
    η_α (None: η); ``adaptive``: update α_m (else it stays ``alpha``)."""

    name = "apfl"
    pseudo_gradient = "delta"
    stateful_clients = True

    def __init__(self, local: SGDConfig, alpha: float = 0.5, alpha_lr: float | None = None,
                 adaptive: bool = True, server_opt=None, aggregator=None,
                 weighting: str = "uniform") -> None:
        super().__init__(server_opt, aggregator)
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"APFL's alpha must be in [0, 1], got {alpha!r}")
        if alpha_lr is not None and not (alpha_lr >= 0 and math.isfinite(alpha_lr)):
            raise ValueError(f"alpha_lr must be a finite number >= 0, got {alpha_lr!r}")
        self.local, self.alpha, self.adaptive = local, float(alpha), bool(adaptive)
        self.alpha_lr = local.lr if alpha_lr is None else float(alpha_lr)
        self.weighting = check_weighting(weighting)

    def init_client_state(self, problem) -> Params:
        """v_m (zeros until the client joins), α_m and the joined flag, for every client."""
        import torch

        Ditto._check(problem)
        M = problem.num_clients
        dev = getattr(problem, "device", None)
        out = {PREFIX + n: torch.zeros((M, *s), device=dev)
               for n, s in problem.theta_shapes.items()}
        out[ALPHA] = torch.full((M,), self.alpha, device=dev)
        out[JOINED] = torch.zeros(M, device=dev)
        return out

    @staticmethod
    def mixture(theta: Params, v: Params, alpha) -> Params:
        """v̄ = α v + (1 − α) θ per client (θ shared ``[...]`` or stacked ``[k, ...]``)."""
        out = {}
        for n, t in theta.items():
            a = alpha.reshape((-1,) + (1,) * (v[n].dim() - 1)).to(v[n].dtype)
            out[n] = a * v[n] + (1 - a) * t
        return out

    def client_update(self, state, problem, cohort, ctx: RoundContext, client_state=None):
        """Local steps on θ_m, v_m and α_m (see the module docstring); sends Δθ."""
        import torch

        from partialfl.local.sgd import _stack_theta, client_plans

        Ditto._check(problem)
        if client_state is None:
            raise ValueError("APFL keeps v_m and α_m on the clients: run it with a runtime "
                             "that holds client state (init_client_state)")
        cohort = np.asarray(cohort)
        k = len(cohort)
        theta0 = state.theta
        th = _stack_theta(theta0, problem.theta_shapes, k)
        v = Ditto.personal_v(theta0, client_state)
        alpha = client_state[ALPHA].clone()
        plans = client_plans(problem, cohort, self.local, ctx.seed, ctx.round, "local")
        lr, steps = float(self.local.lr), max((len(p) for p in plans), default=0)
        loss_sum = np.zeros(k)
        for s in range(steps):
            batches = [p[s] if s < len(p) else None for p in plans]
            active = torch.as_tensor([b is not None for b in batches], device=alpha.device)
            g_th, loss = problem.minibatch_grads(cohort, th, {}, batches, "theta",
                                                 mode=ctx.mode)
            g, _ = problem.minibatch_grads(cohort, self.mixture(th, v, alpha), {}, batches,
                                           "theta", mode=ctx.mode)
            if self.adaptive:
                inner = sum(((v[n] - th[n]) * g[n]).reshape(k, -1).sum(1) for n in g)
                new_alpha = (alpha - self.alpha_lr * inner.to(alpha.dtype)).clamp(0.0, 1.0)
                alpha_next = torch.where(active, new_alpha, alpha)
            else:
                alpha_next = alpha
            v = {n: x - lr * alpha.reshape((-1,) + (1,) * (x.dim() - 1)).to(x.dtype) * g[n]
                 for n, x in v.items()}
            th = {n: x - lr * g_th[n] for n, x in th.items()}
            alpha = alpha_next
            loss_sum += loss.detach().cpu().numpy().astype(np.float64)
        counts = np.array([len(p) for p in plans], dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_loss = np.where(counts > 0, loss_sum / counts, np.nan)
        up = ClientUpdates(delta(th, theta0), client_weights(problem, cohort, self.weighting),
                           cohort, 2 * steps, metrics={"train_loss": mean_loss})
        new_state = {PREFIX + n: x for n, x in v.items()}
        new_state[ALPHA] = alpha
        new_state[JOINED] = torch.ones(k, device=client_state[JOINED].device)
        return ClientResult(up, new_state)

    def deploy(self, state, problem, cohort, client_state, ctx):
        """Each client's mixture v̄_m = α_m v_m + (1 − α_m) θ (θ for a client never
        sampled), as a per-client θ."""
        v = Ditto.personal_v(state.theta, client_state)
        mixed = self.mixture(state.theta, v, client_state[ALPHA])
        return Deployed(mixed, {}, personalized_theta=True)

    def deployed(self, state, problem, client_state, ctx):
        """:meth:`deploy` on every client."""
        return self.deploy(state, problem, np.arange(problem.num_clients), client_state, ctx)


@dataclass(frozen=True)
class APFLOptions:
    """APFL's mixing weight."""

    alpha: float = option(0.5, "α at a client's first round, in [0, 1]")
    alpha_lr: float | None = option(None, "stepsize of α (None: the client lr)")
    adaptive: bool = option(True, "learn α per client (else it stays alpha)")

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if self.alpha_lr is not None and not (self.alpha_lr >= 0
                                              and math.isfinite(self.alpha_lr)):
            raise ValueError(f"alpha_lr must be a finite number >= 0, got {self.alpha_lr!r}")


@register("algorithm", "apfl", options=APFLOptions, split="full", problems=("model",))
def _apfl(opts: APFLOptions, ctx: AlgorithmContext) -> APFL:
    """APFL (Deng et al. 2020): each client deploys an adaptive mixture α_m v_m + (1 − α_m) θ
    of a local model and the FedAvg model."""
    return APFL(ctx.trainer(), opts.alpha, opts.alpha_lr, opts.adaptive, **ctx.common())
