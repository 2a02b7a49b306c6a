"""The ``threads`` backend: a round's clients over Python threads of this process.

torch releases the GIL inside its kernels (convolutions, matrix products, the backward
pass), so N threads that each run one client with ONE intra-op torch thread overlap on a
GIL build of CPython (their Python-level work — autograd bookkeeping, the optimizer loop —
still takes turns) and fully on a free-threaded build. Unlike worker processes
(:class:`~partialfl.runtime.cohort_pool.ProcessBackend`) nothing starts, nothing is pickled
and nothing is copied per round: the threads read θ, the round context and the data where
they are, and their results are the clients' own tensors.

Clients are handed out one at a time as planned by :class:`~partialfl.runtime.schedule.
Schedule` (a list of near-equal training examples per thread, largest first, a thread with
nothing left taking over another's smallest client); the results
come back in cohort order and are stacked as the sequential
backend stacks them, and the aggregator runs on them in the caller's thread. A client's
arithmetic does not depend on the thread that runs it (one intra-op thread each), so the
round equals :class:`~partialfl.runtime.backends.SequentialBackend`'s at one torch thread,
bit for bit.

Thread safety:

* the problem: each thread runs its clients on its own ``problem.thread_replica()`` when the
  problem has one (:meth:`partialfl.problems.model.ModelProblem.thread_replica`: its own
  module, the data shared); a problem without it is shared and must be safe to call from
  several threads at once (the numpy closed forms are: pure functions of their arguments);
* the algorithm is shared: ``client_update`` must be pure (as
  :mod:`partialfl.algorithms.base` requires and the process backend assumes);
* randomness: clients draw from their own generators (:mod:`partialfl.rng`); code that must
  reseed torch's global generator (a random personal initialisation) does it under
  :func:`partialfl.rng.global_torch_seed`, which holds a lock;
* torch's thread count is process-wide: :meth:`ThreadBackend.map_groups` sets one intra-op
  thread for the round and restores the caller's count afterwards.

A client that raises stops the round: the threads take no further clients and the exception
of the failed client earliest in the cohort is raised in the caller, as the sequential
backend raises a client's exception (so :class:`partialfl.runtime.sync.InProcess` isolates
the failing client the same way).
"""

from __future__ import annotations

import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from partialfl.runtime.clients import ClientCall, CohortRunner
from partialfl.runtime.cohort_pool import default_workers
from partialfl.runtime.pool import LIVE_THREAD_POOLS
from partialfl.runtime.schedule import Schedule


class _Round:
    """One :meth:`ThreadBackend.map_groups` call, shared by the threads: the groups, the
    schedule that hands them out (under a lock), their results and failures."""

    def __init__(self, groups: list[np.ndarray], schedule: Schedule) -> None:
        self.groups, self.schedule = groups, schedule
        self.out: list = [None] * len(groups)
        self.errors: dict[int, BaseException] = {}
        self.lock = threading.Lock()
        self.stopped = False

    def take(self, w: int) -> int | None:
        with self.lock:
            if self.errors or self.stopped:
                return None
            return self.schedule.take(w)

    def stop(self) -> None:
        """Hand out no further groups (a failure, or the caller stopped waiting)."""
        with self.lock:
            self.stopped = True

    def work(self, fn, w: int) -> None:
        """Thread ``w``: run its groups until none is left."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # this thread's own count (OpenMP's is per thread)
        while (i := self.take(w)) is not None:
            try:
                self.out[i] = fn(self.groups[i])
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                with self.lock:
                    self.errors[i] = e


class ThreadBackend(CohortRunner):
    """Runs a round's clients on ``workers`` threads of this process (see the module
    docstring): a pool mode of :func:`partialfl.batching.map_clients` for
    :class:`~partialfl.runtime.clients.ClientCall` s (or any thread-safe function of a
    group).

    The threads start at the first round and are reused; the problem's thread replicas are
    built once per run (:meth:`new_run`) and problem object, so a problem changed between two
    runs is seen (within a run they do not see changes to the object's attributes).
    :meth:`close` (or the end of the program) stops the threads.
    """

    name = "threads"

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                    or workers < 1):
            raise ValueError(f"workers must be a positive integer or None, got {workers!r}")
        self.workers = workers or default_workers()
        self._executor: ThreadPoolExecutor | None = None
        self._finalizer = None
        self._problem = None  # the problem whose replicas are held (kept alive: keyed by id)
        self._replicas: list = []
        self._new_run = False  # a run started: make the replicas anew at its first round

    def __repr__(self) -> str:
        return f"ThreadBackend(workers={self.workers})"

    def _calls(self, fn, n: int) -> list:
        """One callable per thread: ``fn`` on that thread's replica of the problem."""
        if not isinstance(fn, ClientCall):
            return [fn] * n
        dev = getattr(fn.problem, "device", None)
        if dev is not None and getattr(dev, "type", str(dev)) != "cpu":
            raise ValueError(f"the threads backend runs clients on CPU threads; the problem "
                             f"is on {dev}: use device 'cpu' (or another backend)")
        make = getattr(fn.problem, "thread_replica", None)
        if make is None:
            return [fn] * n
        if self._problem is not fn.problem or self._new_run:  # a new problem, or a new run
            self._problem, self._replicas, self._new_run = fn.problem, [], False
        while len(self._replicas) < n:
            self._replicas.append(make())  # 0.3 ms for the EMNIST CNN
        return [replace(fn, problem=r) for r in self._replicas[:n]]

    def new_run(self) -> None:
        """A run starts (called by the loops and by a direct :meth:`run`): the problem's
        replicas are made anew at its first round, so they see the problem as it is now."""
        self._new_run = True

    def map_groups(self, fn, groups: list[np.ndarray]) -> list:
        """``fn`` on each group, spread over the threads; the results in group order."""
        n = min(self.workers, len(groups))
        calls = self._calls(fn, n)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers,
                                                thread_name_prefix="partialfl-cohort")
            self._finalizer = weakref.finalize(self, self._executor.shutdown)
            LIVE_THREAD_POOLS.add(self)
        rnd = _Round(groups, Schedule.of(fn, groups, n))
        torch = sys.modules.get("torch")
        old = torch.get_num_threads() if torch is not None else 1
        if old != 1:
            torch.set_num_threads(1)
        try:
            for f in [self._executor.submit(rnd.work, c, w) for w, c in enumerate(calls)]:
                f.result()
        finally:
            rnd.stop()  # e.g. interrupted: the threads finish their client and stop
            if old != 1:
                torch.set_num_threads(old)
        if rnd.errors:
            raise rnd.errors[min(rnd.errors)]
        return rnd.out

    def transport(self, problem, algorithm, concurrency: int):
        """The asynchronous runtime's transport on this mode: the simulated clock (a job is
        computed when it is sent; its arrival time is simulated), the same as for the
        sequential mode."""
        from partialfl.runtime.asynchronous import SimulatedClock

        return SimulatedClock(problem, algorithm)

    def close(self) -> None:
        """Stop the threads and drop the problem replicas (a later round starts anew)."""
        if self._finalizer is not None:
            self._finalizer()
        self._executor, self._finalizer = None, None
        self._problem, self._replicas = None, []
        LIVE_THREAD_POOLS.discard(self)

    def __enter__(self) -> ThreadBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
