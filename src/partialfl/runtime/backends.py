"""Execution backends for a cohort's client updates.

* :class:`BatchedBackend` hands the whole cohort to ``algorithm.client_update`` at once (the
  problem vectorises over clients: batched numpy for closed forms, ``torch.func.vmap`` for
  models where supported).
* :class:`SequentialBackend` runs one client at a time and stacks the results — the
  reference path; results must agree with the batched one.
* ``processes`` (:class:`partialfl.runtime.cohort_pool.ProcessBackend`) spreads the cohort's
  clients over worker processes; same results as the sequential backend, bit for bit.

By name: :func:`partialfl.build.make_backend`.
"""

from __future__ import annotations

import numpy as np

from partialfl.algorithms.base import ClientResult, concat_results
from partialfl.runtime.cohort_pool import ProcessBackend


class BatchedBackend:
    """Hands the whole cohort to the algorithm in one call (vectorised over clients)."""

    name = "batched"

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """The cohort's client update in one call."""
        return algorithm.client_update(state, problem, cohort, ctx, client_state)


class SequentialBackend:
    """Runs one client at a time and concatenates the results (the reference path; same result
    as the batched backend)."""

    name = "sequential"

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """Each client's update on its own (with its row of the client state), concatenated."""
        out = []
        for i, m in enumerate(cohort):
            cs = None
            if client_state is not None:
                cs = {n: v[i : i + 1] for n, v in client_state.items()}
            out.append(algorithm.client_update(state, problem, np.asarray([m]), ctx, cs))
        return concat_results(out)


__all__ = ["BatchedBackend", "ClientResult", "ProcessBackend", "SequentialBackend",
           "concat_results"]
