"""Stateful baselines with their client state on disk instead of in memory.

``OnDiskClientState(FedAlt(...), path)`` behaves exactly like the wrapped algorithm, but
``init_client_state`` returns a :class:`~partialfl.data.client_state.ClientStateStore` under
``path``: the runtimes index it like in-memory state (``state[name][cohort]``,
``state[name][cohort] = rows``), a round reads and writes only its cohort's rows, and clients
never sampled cost no memory (their rows come from the base algorithm's
``init_client_state_rows(problem, cohort)`` when it has one — FedAlt, FedSim, Scaffold — and
are written once at the start otherwise). Not picklable, so not for runs with checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.data.client_state import ClientStateStore


class OnDiskClientState(AlgorithmWrapper):
    """Keeps ``base``'s client state in a :class:`ClientStateStore` at ``path``."""

    def __init__(self, base, path: str | Path) -> None:
        super().__init__(base)
        self.path = Path(path)

    def init_client_state(self, problem):
        M = problem.num_clients
        lazy = getattr(self.base, "init_client_state_rows", None)
        if lazy is not None:
            probe = lazy(problem, np.zeros(1, dtype=np.int64))
            if probe is None:
                return None
            return ClientStateStore(self.path, M, lambda c: lazy(problem, c))
        full = self.base.init_client_state(problem)
        if full is None:
            return None
        store = ClientStateStore(self.path, M, lambda c: {n: v[c] for n, v in full.items()})
        store.put(np.arange(M), full)
        store.init_rows = _never
        return store


def _never(cohort):  # every row was written at the start
    raise AssertionError("client-state row read before it was written")
