"""A base class for algorithms that wrap another one (Byzantine robustness, staleness
weighting, buffering, fault injection): everything except what the wrapper overrides is
delegated.

The wrapped algorithm's declarations (:data:`MIRRORED`: its name, kind of pseudo-gradient,
client state, server optimizer, aggregator, and the metrics and ``extra`` payloads its
clients may send, see :mod:`partialfl.privacy`) are read through to ``base`` every time, so
a wrapper never hides one of them. (The wrapper used to copy a hand-picked few at
construction: ``client_metrics`` was not among them, so ``FaultInjector(Ditto)`` and
``ByzantineRobust(Ditto)`` were refused with a false PrivacyError.) A wrapper that changes
one assigns it (``self.name = ...``, ``self.aggregator = ...``), which overrides the base's
value for that wrapper only.
"""

from __future__ import annotations

from typing import Any

from partialfl.algorithms.base import Algorithm, ServerState
from partialfl.types import Params

#: the declarations of :class:`~partialfl.algorithms.base.Algorithm` a wrapper mirrors
MIRRORED = ("name", "pseudo_gradient", "stateful_clients", "server_opt", "aggregator",
            "client_metrics", "server_metrics", "extra_names", "shared_extra", "fixed_extra")


class _Mirror:
    """A declaration read through to ``base`` unless the wrapper assigned its own."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None) -> Any:
        if obj is None:
            return getattr(Algorithm, self.name, self)
        own = obj.__dict__
        return own[self.name] if self.name in own else getattr(own["base"], self.name)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value


class AlgorithmWrapper(Algorithm):
    """Delegates ``init``, client work, deployment and every declaration (:data:`MIRRORED`)
    to ``base``."""

    name = _Mirror()
    pseudo_gradient = _Mirror()
    stateful_clients = _Mirror()
    server_opt = _Mirror()
    aggregator = _Mirror()
    client_metrics = _Mirror()
    server_metrics = _Mirror()
    extra_names = _Mirror()
    shared_extra = _Mirror()
    fixed_extra = _Mirror()

    def __init__(self, base: Algorithm) -> None:
        if not isinstance(base, Algorithm):
            raise TypeError(f"can only wrap an Algorithm, got {type(base).__name__}")
        self.base = base

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


def with_aggregator(algorithm: Algorithm, aggregator) -> Algorithm:
    """A shallow copy of ``algorithm`` whose server step aggregates with ``aggregator``:
    every wrapper down its ``base`` chain is copied too and the rule set at each level, since
    a wrapper's server step delegates to its base, which reads its own ``aggregator``
    (setting it on the outer copy alone left e.g. ``FaultInjector(FFGG)`` aggregating with
    the rule as built, not the one bound for the round)."""
    import copy

    out = copy.copy(algorithm)
    out.aggregator = aggregator
    if isinstance(algorithm, AlgorithmWrapper):
        out.base = with_aggregator(algorithm.base, aggregator)
    return out
