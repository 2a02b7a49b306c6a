"""A cohort's client updates under a batching mode (:func:`partialfl.batching.map_clients`).

:class:`ClientCall` is ``algorithm.client_update`` for some positions of a cohort, with those
clients' rows of the client state; it is a picklable value, so a pool (worker processes) can
run it. :class:`CohortRunner` gives every mode the runtime's ``run(algorithm, state, problem,
cohort, ctx, client_state)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from partialfl.algorithms.base import ClientResult, RoundContext, ServerState, concat_results
from partialfl.batching import map_clients
from partialfl.types import Params


def rows(tree: Params | None, pos: np.ndarray) -> Params | None:
    """The rows ``pos`` (consecutive positions, as :func:`partialfl.batching.groups` makes
    them) of a tree stacked over the cohort; None stays None."""
    if tree is None:
        return None
    sl = slice(int(pos[0]), int(pos[-1]) + 1)
    return {n: v[sl] for n, v in tree.items()}


@dataclass(frozen=True)
class ClientCall:
    """``algorithm.client_update(state, problem, cohort[pos], ctx, client_state[pos])``."""

    algorithm: Any
    problem: Any
    state: ServerState
    cohort: np.ndarray
    ctx: RoundContext
    client_state: Params | None = None

    def __call__(self, pos: np.ndarray) -> ClientResult:
        return self.algorithm.client_update(self.state, self.problem, self.cohort[pos],
                                            self.ctx, rows(self.client_state, pos))


def run_clients(algorithm, state: ServerState, problem, cohort, ctx: RoundContext,
                client_state: Params | None, mode) -> ClientResult:
    """The cohort's :class:`ClientResult` (cohort order) with its clients mapped as ``mode``
    says."""
    cohort = np.asarray(cohort)
    call = ClientCall(algorithm, problem, state, cohort, ctx, client_state)
    return map_clients(call, cohort, mode, combine=concat_results)


class CohortRunner:
    """Mixin of the runtime's modes: ``run`` = :func:`run_clients` with this mode."""

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """The cohort's client update, its clients mapped as this mode says."""
        return run_clients(algorithm, state, problem, cohort, ctx, client_state, self)

