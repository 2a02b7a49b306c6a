"""The algorithm interface (FedJAX-like).

An algorithm is ``init`` (server state from θ⁰), a pure ``client_update`` run on a cohort of
clients, and ``server_update`` (aggregate and step). A runtime — synchronous rounds,
asynchronous events, Flower — only calls these; an algorithm never knows which runtime or
backend runs it. Stateful baselines declare ``init_client_state``: that state is held by the
runtime's client side (one row per client), handed to ``client_update`` for the cohort and
written back from :attr:`ClientResult.client_state` — it never reaches the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialfl import arrays
from partialfl.aggregation import Mean, aggregate_tree
from partialfl.io import state_class
from partialfl.server import SGD
from partialfl.types import ClientUpdates, Params


@state_class
@dataclass
class ServerState:
    """θ (or the shared model), the server optimizer's state and algorithm extras."""

    theta: Params
    opt_state: Any = None
    round: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


#: ``state.extra`` key counting the rounds whose step was skipped for want of protection
UNPROTECTED = "rounds_unprotected"


def skipped_step(state: ServerState, extra: dict[str, Any] | None = None) -> ServerState:
    """Round ``state.round`` ends without a step because a robust rule cannot tolerate the
    planned f among the clients left (:func:`partialfl.aggregation.protection.cohort_checked`):
    θ and the optimizer state kept, the round counted in ``extra[UNPROTECTED]`` (``extra``:
    the state's extras, or the caller's updated copy of them), which the history logs."""
    extra = dict(state.extra if extra is None else extra)
    extra[UNPROTECTED] = extra.get(UNPROTECTED, 0) + 1
    return ServerState(state.theta, state.opt_state, state.round + 1, extra)


@dataclass(frozen=True)
class RoundContext:
    """What a client update may know about the round besides θ: the seed and round (for
    deriving randomness) and ``mode``, the batching mode the run's executor chose for the
    clients one call computes (:attr:`partialfl.batching.Executor.kernel_mode`; None: the
    problem's default). An algorithm passes ``mode`` to its local trainer and to the
    problem's kernels. ``noise_key``: a key only the clients hold, for noise the server must
    not be able to regenerate (local DP); None: the run seed (a simulation, where the server
    and the clients are one process anyway)."""

    seed: int
    round: int
    mode: Any = None
    noise_key: int | None = None

    @property
    def client_secret(self) -> int:
        """The seed of client-only randomness: ``noise_key``, else the run seed."""
        return self.seed if self.noise_key is None else self.noise_key


@dataclass(frozen=True)
class ClientResult:
    """``updates`` go to the server; ``client_state`` stays on the clients (or is None)."""

    updates: ClientUpdates
    client_state: Params | None = None


@dataclass(frozen=True)
class Deployed:
    """The model each client would use: θ shared ``[d]`` or per client ``[M, d]``, and w."""

    theta: Params
    w: Params
    personalized_theta: bool = False


class Algorithm:
    """Base class. Subclasses implement ``client_update`` and set ``pseudo_gradient``:

    * ``"gradient"`` — clients send ∇_θ (FFGG): the server steps θ ← opt(θ, agg(g)).
    * ``"delta"`` — clients send a model change Δ: the server steps with g = −agg(Δ), so
      SGD with lr 1 is plain averaging θ ← θ + mean(Δ) (FedAvg) and Adam gives FedAdam.
    """

    name: str = "algorithm"
    pseudo_gradient: str = "gradient"
    stateful_clients: bool = False
    #: what the clients may send besides θ-shaped ``vectors`` (see :mod:`partialfl.privacy`):
    #: per-client scalar metrics beyond ``train_loss`` (kept on the client side) ...
    client_metrics: tuple[str, ...] = ()
    #: ... those of them the server step reads (they pass to ``server_update``) ...
    server_metrics: tuple[str, ...] = ()
    #: ... and the names of the θ-shaped ``extra`` payloads (e.g. Scaffold's ``dc``)
    extra_names: tuple[str, ...] = ()
    #: numbers of the server state (``state.extra``) the clients' update reads besides θ
    #: (DP's adaptive clip norm): a transport that sends the clients θ sends these too
    shared_extra: tuple[str, ...] = ()
    #: entries of ``state.extra`` fixed by the run's configuration at ``init`` (Scaffold's
    #: and DP's M, a fixed clip norm, the planned Byzantine cohort): a resumed state must
    #: hold the fresh state's values (:mod:`partialfl.runtime.resume_check`)
    fixed_extra: tuple[str, ...] = ()

    def __init__(self, server_opt=None, aggregator=None) -> None:
        self.server_opt = server_opt if server_opt is not None else SGD(lr=1.0)
        self.aggregator = aggregator if aggregator is not None else Mean()

    # -- server ------------------------------------------------------------------------
    def init(self, problem, theta0: Params) -> ServerState:
        """The server state at round 0: θ⁰ and the server optimizer's state."""
        return ServerState(theta=theta0, opt_state=self.server_opt.init(theta0))

    def aggregate(self, updates: ClientUpdates) -> Params:
        """The aggregate of the cohort's vectors (the algorithm's aggregator, with the clients'
        weights)."""
        return aggregate_tree(self.aggregator, updates.vectors, updates.weights)

    def server_update(
        self, state: ServerState, updates: ClientUpdates, ctx: RoundContext
    ) -> ServerState:
        """One server step: aggregate the cohort's updates into g (−aggregate for model changes) and
        step θ ← opt(θ, g)."""
        agg = self.aggregate(updates)
        g = agg if self.pseudo_gradient == "gradient" else {k: -v for k, v in agg.items()}
        theta, opt_state = self.server_opt.step(state.theta, g, state.opt_state, state.round)
        return ServerState(theta, opt_state, state.round + 1, dict(state.extra))

    # -- clients -----------------------------------------------------------------------
    def init_client_state(self, problem) -> Params | None:
        """The state every client keeps between rounds, stacked over clients (None: stateless
        clients)."""
        return None

    def client_update(
        self, state: ServerState, problem, cohort: np.ndarray, ctx: RoundContext,
        client_state: Params | None = None,
    ) -> ClientResult:
        """What the sampled ``cohort`` sends for the round (a pure function of the server state, the
        round context and the cohort's own client state); returns the updates and the new client
        state."""
        raise NotImplementedError

    # -- evaluation --------------------------------------------------------------------
    def deploy(self, state: ServerState, problem, cohort: np.ndarray,
               client_state: Params | None, ctx: RoundContext) -> Deployed:
        """The models the clients of ``cohort`` would deploy after this round: w ``[k, ...]``
        and θ shared (or ``[k, ...]`` with ``personalized_theta``); ``client_state``: the
        cohort's rows. A Flower node asks this for its own clients only.

        Default: the cohort's rows of :meth:`deployed` (stateless clients only); algorithms
        that compute each client's deployment separately override this instead."""
        if type(self).deployed is Algorithm.deployed:
            raise NotImplementedError(f"{type(self).__name__} implements neither deploy nor "
                                      "deployed")
        if client_state is not None:
            raise NotImplementedError(f"{type(self).__name__} deploys with client state only "
                                      "for all clients at once (deployed)")
        cohort = np.asarray(cohort)
        dep = self.deployed(state, problem, None, ctx)
        theta = ({n: v[cohort] for n, v in dep.theta.items()} if dep.personalized_theta
                 else dep.theta)
        return Deployed(theta, {n: v[cohort] for n, v in dep.w.items()},
                        dep.personalized_theta)

    def deployed(self, state: ServerState, problem, client_state: Params | None,
                 ctx: RoundContext) -> Deployed:
        """The model every client would deploy after this round (for metrics):
        :meth:`deploy` on all clients."""
        if type(self).deploy is Algorithm.deploy:
            raise NotImplementedError(f"{type(self).__name__} implements neither deploy nor "
                                      "deployed")
        return self.deploy(state, problem, np.arange(problem.num_clients), client_state, ctx)

    def global_theta(self, state: ServerState, problem) -> Params:
        """The global parameters θ to compare with θ* (algorithms whose server model holds more
        than θ, e.g. a shared w, return its θ part: the leaves ``problem.theta_names``)."""
        return state.theta


_cat = arrays.concat


def concat_results(results: list[ClientResult]) -> ClientResult:
    """Stack per-client results along the client axis (cohort order preserved)."""
    ups = [r.updates for r in results]
    u0 = ups[0]
    updates = ClientUpdates(
        vectors={n: _cat([u.vectors[n] for u in ups]) for n in u0.vectors},
        weights=np.concatenate([np.asarray(u.weights) for u in ups]),
        cohort=np.concatenate([np.asarray(u.cohort) for u in ups]),
        grad_evals=max(u.grad_evals for u in ups),
        metrics={n: np.concatenate([np.asarray(u.metrics[n]) for u in ups]) for n in u0.metrics},
        extra={e: {n: _cat([u.extra[e][n] for u in ups]) for n in u0.extra[e]} for e in u0.extra},
    )
    cs = None
    if results[0].client_state is not None:
        cs = {n: _cat([r.client_state[n] for r in results]) for n in results[0].client_state}
    return ClientResult(updates, cs)
