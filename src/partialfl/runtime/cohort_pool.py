"""The ``processes`` backend: one round's cohort spread over the worker processes of a
:class:`~partialfl.runtime.pool.WorkerPool` (persistent workers, θ in shared memory,
one-client tasks handed to idle workers, dead-worker detection; see :mod:`partialfl.runtime.pool`).

Clients are handed out as planned by :class:`~partialfl.runtime.schedule.Schedule` (a list of
near-equal training examples per worker, largest first, a worker with nothing left taking
over another's smallest client), as in the threads backend. Each worker runs exactly what
:class:`SequentialBackend` runs for a client,
``algorithm.client_update(state, problem, [m], ctx, state_rows_m)``. Bit-exactness: the
parent stacks the per-client rows in cohort order, as the sequential backend does, and the
aggregator (mean, or any robust rule) runs on them in the parent. So the result equals the
sequential backend's bit for bit when the sequential run also uses one torch thread (a
client's arithmetic does not depend on which process runs it). Summing inside the workers
would save the transfer of k rows but changes the floating-point summation order, hence is
not done.

Failures are isolated per client: a client that raises, or whose worker dies (the worker is
replaced), is reported in a :class:`ClientsFailed` carrying every other client's result, so
the runtime skips and counts exactly the failing clients without re-running anyone; the
healthy workers live on. A pool that had to close (every worker died) is never reused: the
next round starts a new one.
"""

from __future__ import annotations

import hashlib
import pickle
import weakref

import numpy as np

from partialfl.algorithms.base import ClientResult
from partialfl.batching import check_device
from partialfl.runtime.checkpoint import content_digest
from partialfl.runtime.clients import ClientCall, CohortRunner, checked, error_text
from partialfl.runtime.faults import is_data_error
from partialfl.runtime.pool import (
    START_METHODS,
    Task,
    WorkerError,
    WorkerPool,
    default_start_method,
    default_workers,
)
from partialfl.runtime.schedule import Schedule

__all__ = ["START_METHODS", "ClientsFailed", "ProcessBackend", "WorkerError",
           "default_start_method", "default_workers"]


class ClientsFailed(WorkerError):
    """Some clients of a cohort failed in the workers. ``results``: every position's
    ClientResult (None where it failed); ``failures``: ``{position: (kind, reason)}`` with
    kind ``error`` (the client raised; reason: its traceback) or ``death`` (its worker
    died); ``errors``: the exception a raising client raised, where it survived the trip
    from the worker (so a bug in every client is re-raised as itself, as in process)."""

    def __init__(self, results: list[ClientResult | None],
                 failures: dict[int, tuple[str, str]], clients: np.ndarray,
                 errors: dict[int, BaseException] | None = None) -> None:
        self.results, self.failures, self.errors = results, failures, errors or {}
        i = min(failures)
        kind, why = failures[i]
        head = (f"client {int(clients[i])} (cohort position {i}) failed in a worker:\n{why}"
                if kind == "error" else
                f"the worker process of client {int(clients[i])} (cohort position {i}) {why}")
        more = f" ({len(failures) - 1} more client(s) failed)" if len(failures) > 1 else ""
        super().__init__(head + more)


def algorithm_digest(algorithm, limit: int = 1 << 20) -> str | None:
    """SHA-256 of the pickled algorithm (its configuration: a few hundred bytes, ~10 µs), or
    None when it does not pickle or exceeds ``limit`` bytes (a pool then matches by identity
    alone)."""
    try:
        blob = pickle.dumps(algorithm, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an algorithm that does not pickle (fork start)
        return None
    return hashlib.sha256(blob).hexdigest() if len(blob) <= limit else None


class ProcessBackend(CohortRunner):
    """Runs a round's clients on ``workers`` worker processes (see the module docstring): a
    pool mode of :func:`partialfl.batching.map_clients` that runs :class:`ClientCall` s.

    The pool starts at the first round and is reused while it is open and the problem and the
    algorithm stay the same objects, with the same contents (a new pair starts a new one; the
    algorithm is fingerprinted every round, the problem when a run starts (:meth:`new_run`): a
    problem changed in place between two runs gets a new pool, not the workers' stale copy);
    :meth:`close` (or the end of the program) stops it. ``task_timeout``: seconds after which a
    client's computation is killed and counted as a worker death (None: no limit; a dead worker
    is always detected within ``poll`` seconds). ``own_session``: each worker in a process
    session of its own, dying with this process (a fair CPU share per worker on a busy Linux
    machine, as torchrun's ranks have; :func:`partialfl.runtime.worker._detach`); an interrupt of
    this process (Ctrl-C) then kills the workers at once.
    """

    name = "processes"
    cpu_only = True  # the workers run on the CPU (see partialfl.batching.check_device)

    def __init__(self, workers: int | None = None, start_method: str | None = None,
                 task_timeout: float | None = None, poll: float = 0.2,
                 max_respawns: int = 100, own_session: bool = True) -> None:
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive integer or None, got {workers!r}")
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"unknown start method {start_method!r}; allowed: "
                             f"{', '.join(START_METHODS)}")
        self.workers = workers or default_workers()
        self.start_method = start_method  # None: default_start_method() when a pool starts
        self.task_timeout, self.poll, self.max_respawns = task_timeout, poll, max_respawns
        self.own_session = own_session
        self._pool: WorkerPool | None = None
        self._digest: str | None = None  # of the algorithm the pool's workers hold
        self._problem_digest: str | None = None  # of the problem they hold
        self._check_problem = False  # a run started: compare the problem before reusing
        self._finalizer = None

    def _pool_for(self, problem, algorithm) -> WorkerPool:
        """The open pool running ``problem`` and ``algorithm`` — the same objects, and the
        algorithm unchanged since the workers copied it (a user's ``alg.solver = …`` between
        two runs on one backend made them run the stale copy) — else a new one."""
        fits = self._pool is not None and self._pool.fits(problem, algorithm)
        if fits and self._check_problem:  # a new run on the same object: changed in place?
            fits = content_digest(problem, fast=True) == self._problem_digest
        self._check_problem = False
        # an algorithm too large to fingerprint cheaply (None) is matched by identity only
        digest = None if fits and self._digest is None else algorithm_digest(algorithm)
        if not fits or digest != self._digest:
            self.close()
            self._digest, self._problem_digest = digest, content_digest(problem, fast=True)
            # never more workers than clients: the rest could never run one (workers =
            # 100000 once tried to start that many processes)
            n = min(self.workers, max(1, int(getattr(problem, "num_clients", self.workers))))
            self._pool = WorkerPool(problem, algorithm, n,
                                    start_method=self.start_method, poll=self.poll,
                                    task_timeout=self.task_timeout,
                                    max_respawns=self.max_respawns,
                                    own_session=self.own_session)
            self._finalizer = weakref.finalize(self, self._pool.close)
            self._pool.wait_ready()
        return self._pool

    def new_run(self) -> None:
        """A run starts (called by the loops): the next round compares the problem's
        contents with the copy the workers hold (:func:`content_digest`) and starts a new
        pool if it changed."""
        self._check_problem = True

    def map_groups(self, fn, groups: list[np.ndarray]) -> list[ClientResult]:
        """Each one-client group of ``fn`` (a :class:`ClientCall`) in a worker, cohort order;
        :class:`ClientsFailed` (with the others' results) if some clients failed."""
        if not isinstance(fn, ClientCall):
            raise TypeError(f"the processes backend runs client updates (ClientCall), not "
                            f"{type(fn).__name__}")
        check_device(self, getattr(fn.problem, "device", "cpu"))
        pool = self._pool_for(fn.problem, fn.algorithm)
        pos = np.concatenate(groups)
        clients = fn.cohort[pos]
        cs = fn.client_state
        todo = Schedule.of(fn, [pos[i:i + 1] for i in range(len(pos))], pool.n)
        out: list[ClientResult | None] = [None] * len(pos)
        failures: dict[int, tuple[str, str]] = {}
        errors: dict[int, BaseException] = {}
        try:
            while todo or pool.busy():
                # one task per worker, and a second queued behind it while enough are left
                # (the worker need not wait while this process reads its last result)
                while todo and (ws := pool.free(2 if len(todo) > pool.n else 1)):
                    for w in ws[:len(todo)]:
                        i = todo.take(w)
                        p = int(pos[i])
                        rows = None if cs is None else {n: v[p:p + 1] for n, v in cs.items()}
                        pool.send(w, Task(i, int(clients[i]), fn.state, fn.ctx, rows))
                ev = pool.next()
                if ev.kind == "done":  # the worker's result, checked here (runtime.clients)
                    try:
                        p = int(pos[ev.task])
                        out[ev.task] = checked(ev.payload, clients[ev.task:ev.task + 1],
                                               fn.state.theta,
                                               None if cs is None else
                                               {n: v[p:p + 1] for n, v in cs.items()})
                    except ValueError as e:  # MalformedResult, PrivacyError
                        failures[ev.task] = ("error", error_text(e))
                        errors[ev.task] = e
                elif ev.kind == "error" and is_data_error(ev.error):
                    raise ev.error  # a data error stops the run (the pool is closed below)
                elif ev.kind == "error":
                    failures[ev.task] = ("error", ev.payload)
                    if isinstance(ev.error, Exception):
                        errors[ev.task] = ev.error
                elif ev.kind == "death":
                    if ev.task is not None:
                        failures[ev.task] = ("death", ev.payload)
                    todo.give_back(ev.worker, ev.unstarted)  # never run: run them later
                    pool.restart(ev.worker)
        except WorkerError:
            self.close()  # every worker gone: the next round starts a new pool
            raise
        except KeyboardInterrupt:
            self.close(wait=0.0)  # the workers (in sessions of their own) never saw it
            raise
        except BaseException:
            self.close()  # a data error: workers may still be busy with this cohort
            raise
        if failures:
            raise ClientsFailed(out, failures, clients, errors)
        return out  # type: ignore[return-value]

    def close(self, wait: float | None = None) -> None:
        """Stop the worker processes (a later round starts new ones), killing those still
        busy after ``wait`` seconds (None: the pool's default, 10 s)."""
        if wait is not None and self._pool is not None:
            self._pool.close(timeout=wait)
        if self._finalizer is not None:
            self._finalizer()
        self._pool, self._finalizer = None, None

    def __enter__(self) -> ProcessBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
