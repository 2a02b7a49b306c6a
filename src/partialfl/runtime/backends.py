"""Execution backends for a cohort's client updates: the batching modes of
:mod:`partialfl.batching` with the runtime's ``run``
(:class:`~partialfl.runtime.clients.CohortRunner`).

* :class:`BatchedBackend` (``Vmap``, no size limit) hands the whole cohort to
  ``algorithm.client_update`` at once (the problem vectorises over clients: batched numpy for
  closed forms, ``torch.func.vmap`` for models where supported).
* :class:`SequentialBackend` (``Loop``) runs one client at a time and stacks the results —
  the reference path; results must agree with the batched one.
* ``processes`` (:class:`partialfl.runtime.cohort_pool.ProcessBackend`) spreads the cohort's
  clients over worker processes; same results as the sequential backend, bit for bit.

By name: :func:`partialfl.build.make_backend`. Which clients run together is decided in one
place, :func:`partialfl.batching.map_clients`.
"""

from __future__ import annotations

from partialfl.algorithms.base import ClientResult, concat_results
from partialfl.batching import Loop, Vmap
from partialfl.runtime.clients import CohortRunner
from partialfl.runtime.cohort_pool import ProcessBackend


class BatchedBackend(CohortRunner, Vmap):
    """Hands the whole cohort to the algorithm in one call (vectorised over clients)."""

    name = "batched"


class SequentialBackend(CohortRunner, Loop):
    """Runs one client at a time and concatenates the results (the reference path; same result
    as the batched one)."""

    name = "sequential"


__all__ = ["BatchedBackend", "ClientResult", "ProcessBackend", "SequentialBackend",
           "concat_results"]
