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
* ``threads`` (:class:`partialfl.runtime.threads.ThreadBackend`) spreads them over threads of
  this process (one torch thread each; torch releases the GIL in its kernels); bit-exact with
  the sequential backend too.

By name: the registry's kind ``executor`` (``sequential``, ``vmap``, ``processes``,
``threads``). A run
holds its mode in an :class:`~partialfl.batching.Executor`; which clients run together is
decided in one place, :func:`partialfl.batching.map_clients`, for the cohort (the loop) and
for the clients of one call (the problem's kernels, given the run's mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from partialfl.algorithms.base import ClientResult, concat_results
from partialfl.batching import MAX_EXAMPLES, Loop, Vmap
from partialfl.registry import option, register
from partialfl.runtime.clients import CohortRunner
from partialfl.runtime.cohort_pool import START_METHODS, ProcessBackend
from partialfl.runtime.threads import ThreadBackend


class BatchedBackend(CohortRunner, Vmap):
    """Hands the whole cohort to the algorithm in one call (vectorised over clients)."""

    name = "batched"


class SequentialBackend(CohortRunner, Loop):
    """Runs one client at a time and concatenates the results (the reference path; same result
    as the batched one)."""

    name = "sequential"


@register("executor", "sequential")
def _sequential(opts: None = None, ctx=None) -> SequentialBackend:
    """One client at a time, in cohort order (the reference path)."""
    return SequentialBackend()


@dataclass(frozen=True)
class VmapOptions:
    """How many clients one vectorised call may hold."""

    max_examples: int | None = option(MAX_EXAMPLES, "at most this many examples (clients × "
                                      "batch) in one call (None: the whole cohort)")

    def __post_init__(self) -> None:
        Vmap(self.max_examples)


@register("executor", "vmap", options=VmapOptions, aliases=("batched",))
def _vmap(opts: VmapOptions, ctx=None) -> BatchedBackend:
    """The cohort's clients in one vectorised call (torch.func.vmap on a model, batched
    numpy on a closed form)."""
    return BatchedBackend(opts.max_examples)


@dataclass(frozen=True)
class ProcessOptions:
    """The worker processes."""

    workers: int | None = option(None, "worker processes (None: the usable CPU cores)")
    start_method: str | None = option(None, "fork, spawn or forkserver (None: fork unless "
                                      "torch sees a GPU, then spawn, or a threads backend's "
                                      "pool runs in this process, then forkserver)")
    task_timeout: float | None = option(None, "seconds after which a client's computation is "
                                        "killed and counted as a worker death (a hung "
                                        "client; None: no limit)")

    def __post_init__(self) -> None:
        if self.workers is not None and not (isinstance(self.workers, int) and
                                             self.workers >= 1):
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        t = self.task_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)
                              or not 0 < t < float("inf")):
            raise ValueError(f"task_timeout must be a number of seconds > 0, got {t!r}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise ValueError(f"start_method {self.start_method!r} is not allowed; allowed: "
                             f"{', '.join(START_METHODS)}")


@register("executor", "processes", options=ProcessOptions, cpu_only=True)
def _processes(opts: ProcessOptions, ctx=None) -> ProcessBackend:
    """The cohort's clients over CPU worker processes (θ in shared memory; bit-exact with
    sequential)."""
    return ProcessBackend(opts.workers, opts.start_method, task_timeout=opts.task_timeout)


@dataclass(frozen=True)
class ThreadOptions:
    """The threads."""

    workers: int | None = option(None, "threads (None: the usable CPU cores)")

    def __post_init__(self) -> None:
        if self.workers is not None and not (isinstance(self.workers, int) and
                                             not isinstance(self.workers, bool) and
                                             self.workers >= 1):
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")


@register("executor", "threads", options=ThreadOptions, cpu_only=True)
def _threads(opts: ThreadOptions, ctx=None) -> ThreadBackend:
    """The cohort's clients over threads of this process, one torch thread each (bit-exact
    with sequential; no start-up, nothing pickled)."""
    return ThreadBackend(opts.workers)


__all__ = ["BatchedBackend", "ClientResult", "ProcessBackend", "SequentialBackend",
           "ThreadBackend", "concat_results"]
