"""A base class for algorithms that wrap another one (Byzantine robustness, staleness
weighting, buffering): everything except what the wrapper overrides is delegated."""

from __future__ import annotations

from partialfl.algorithms.base import Algorithm, ServerState
from partialfl.types import Params


class AlgorithmWrapper(Algorithm):
    """Delegates ``init``, client work, deployment and the server optimizer to ``base``."""

    def __init__(self, base: Algorithm) -> None:
        if not isinstance(base, Algorithm):
            raise TypeError(f"can only wrap an Algorithm, got {type(base).__name__}")
        self.base = base
        self.name = base.name
        self.pseudo_gradient = base.pseudo_gradient
        self.stateful_clients = base.stateful_clients
        self.server_opt = base.server_opt
        self.aggregator = base.aggregator

    def init(self, problem, theta0: Params) -> ServerState:
        """The wrapped algorithm's initial state."""
        return self.base.init(problem, theta0)

    def init_client_state(self, problem):
        """The wrapped algorithm's client state."""
        return self.base.init_client_state(problem)

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        """The wrapped algorithm's client update."""
        return self.base.client_update(state, problem, cohort, ctx, client_state)

    def server_update(self, state, updates, ctx) -> ServerState:
        """The wrapped algorithm's server step."""
        return self.base.server_update(state, updates, ctx)

    def deployed(self, state, problem, client_state, ctx):
        """The wrapped algorithm's deployed models."""
        return self.base.deployed(state, problem, client_state, ctx)

    def deploy(self, state, problem, cohort, client_state, ctx):
        """The wrapped algorithm's deployed models for ``cohort``."""
        return self.base.deploy(state, problem, cohort, client_state, ctx)

    def global_theta(self, state: ServerState, problem) -> Params:
        """The wrapped algorithm's global θ."""
        return self.base.global_theta(state, problem)
