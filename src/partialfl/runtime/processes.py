"""Asynchronous training on real concurrency: Algorithm 3 with worker processes.

One worker per slot (``concurrency`` of them) of a :class:`~partialfl.runtime.pool.WorkerPool`
(the pool of the synchronous ``processes`` backend too: persistent workers, θ in shared
memory, one-client tasks, dead-worker detection), started with the ``spawn`` method and
single-threaded. The server (this process) hands each worker the θ its new client receives;
the worker really computes ``algorithm.client_update`` for that client and then sleeps until
the client's compute time — ``compute_time.job_duration(...) × time_unit`` seconds, so slow
devices are really slow — has passed, and returns the result. The server applies results in
the order they arrive and hands the slot to a newly sampled client. The loop is
:func:`partialfl.runtime.asynchronous.drive` (the simulated runtime's) with the
:class:`WorkerProcesses` transport, which the executor mode :class:`AsyncWorkers` names
(``run_arrivals(Run(…, Arrivals(…), executor=Executor(AsyncWorkers(…))))``); times are real
seconds since the start.

Faults: a client that raises in a worker is reported and skipped (the worker lives on); a
worker process that dies is detected within ``poll_seconds`` even while other workers keep
delivering — its job is counted as lost (``worker_deaths``), its client freed, and a fresh
worker is started for the slot (a slot whose workers died ``max_respawns`` times is
closed; the run goes on with fewer workers). Aborts only past ``max_failure_fraction``. A
data error (a corrupt client store) raised in a worker stops the run.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from partialfl.algorithms.base import Algorithm
from partialfl.batching import Executor
from partialfl.runtime.asynchronous import (
    AsyncRunResult,
    ComputeTimeModel,
    Event,
    run_arrivals,
)
from partialfl.runtime.clients import MalformedResult, checked, error_text
from partialfl.runtime.faults import ClientFaultError, is_data_error
from partialfl.runtime.pool import Task, WorkerError, WorkerPool
from partialfl.runtime.run import Arrivals, Checkpointing, Evaluation, Run
from partialfl.types import Params


@dataclass(frozen=True)
class AsyncWorkers:
    """The executor mode of an asynchronous run on real concurrency (see the module
    docstring): one spawned worker per slot; ``time_unit`` real seconds per unit of the
    compute-time model; a dead worker is detected within ``poll_seconds`` and replaced at
    most ``max_respawns`` times per slot."""

    time_unit: float = 0.01
    poll_seconds: float = 0.5
    max_respawns: int = 3
    start_method: str = "spawn"
    cpu_only = True  # the workers run on the CPU (partialfl.batching.check_device)

    def __post_init__(self) -> None:
        if not (self.time_unit >= 0):
            raise ValueError(f"time_unit must be >= 0 seconds, got {self.time_unit!r}")
        if not (self.poll_seconds > 0):
            raise ValueError(f"poll_seconds must be > 0, got {self.poll_seconds!r}")

    def transport(self, problem, algorithm: Algorithm, concurrency: int) -> WorkerProcesses:
        """The :class:`WorkerProcesses` transport of a run with ``concurrency`` slots."""
        return WorkerProcesses(problem, algorithm, concurrency, self.time_unit,
                               self.poll_seconds, self.max_respawns, self.start_method)


class WorkerProcesses:
    """The transport of :class:`AsyncWorkers`: worker ``slot`` of a :class:`WorkerPool` runs
    that slot's jobs; times are real seconds since every worker was ready."""

    real_time = True  # its clock is the wall clock

    def __init__(self, problem, algorithm: Algorithm, concurrency: int, time_unit: float,
                 poll_seconds: float, max_respawns: int, start_method: str = "spawn") -> None:
        self.problem, self.algorithm = problem, algorithm
        self.n, self.time_unit, self.poll = concurrency, time_unit, poll_seconds
        self.max_respawns, self.start_method = max_respawns, start_method
        self.pool: WorkerPool | None = None
        self.jobs: dict[int, object] = {}
        self.sent: dict[int, Params | None] = {}  # each job's client-state rows
        self.t0 = _time.perf_counter()

    def start(self) -> None:
        """Start every worker and wait until all are ready; the clock starts then."""
        self.pool = WorkerPool(self.problem, self.algorithm, self.n,
                               start_method=self.start_method, poll=self.poll,
                               max_respawns=self.max_respawns)
        try:
            self.pool.wait_ready()
        except WorkerError as e:
            raise RuntimeError(f"asynchronous {e}") from None
        self.t0 = _time.perf_counter()

    def now(self) -> float:
        """Real seconds since the start."""
        return _time.perf_counter() - self.t0

    def send(self, job, state, client_state, ctx, seconds):
        """Hand the job to its slot's worker (it sleeps until ``seconds × time_unit``)."""
        self.jobs[job.job] = job
        self.sent[job.job] = client_state  # the rows its result's client state must match
        self.pool.send(job.slot, Task(job.job, job.client, state, ctx, client_state,
                                      self.time_unit * seconds))
        return None

    def next(self, max_time):
        """The next event of any worker (deaths detected within ``poll_seconds``)."""
        ev = self.pool.next(self.poll)
        if max_time is not None and self.now() > max_time:
            return None
        if ev is None:
            return Event("wait")
        # the pool's events are the loop's: done, error (the client's traceback), death of
        # the slot's worker (its job lost), ready (a restarted worker)
        job = None if ev.task is None else self.jobs.pop(ev.task)
        rows = None if ev.task is None else self.sent.pop(ev.task, None)
        if ev.kind == "done":  # a result for another client, or none: the client failed
            try:
                checked(ev.payload, np.asarray([job.client]), None, rows)
            except MalformedResult as e:
                ev = replace(ev, kind="error", payload=error_text(e), error=None)
        error = ev.kind == "error"
        if error:  # a data error itself (re-raised by the server), else the reason's line
            why = ev.error if is_data_error(ev.error) else ev.payload.strip().splitlines()[-1]
        else:
            why = ev.payload
        return Event(ev.kind, ev.worker, job, why,
                     self.now(), ev.payload if error else "", ev.busy)

    def resume(self, time: float) -> None:
        """Continue the clock at ``time`` seconds (a resumed run)."""
        self.t0 = _time.perf_counter() - float(time)

    def restart(self, slot: int) -> None:
        """Worker ``slot`` died: start a fresh one (it says "ready"), or close the slot."""
        if not self.pool.restart(slot) and self.pool.live() == 0:
            raise ClientFaultError(
                f"every asynchronous worker died ({self.max_respawns} restarts per slot)")

    def close(self) -> None:
        """Stop every worker."""
        if self.pool is not None:
            self.pool.close()


def run_processes(
    problem,
    algorithm: Algorithm,
    *,
    steps: int | None = None,
    max_time: float | None = None,
    concurrency: int = 2,
    compute_time: ComputeTimeModel | None = None,
    time_unit: float = 0.01,
    seed: int = 0,
    theta0: Params | None = None,
    evaluate=None,
    eval_every: int = 1,
    logger=None,
    progress: bool | str = False,
    record_events: bool = True,
    poll_seconds: float = 0.5,
    max_failure_fraction: float = 0.5,
    max_respawns: int = 3,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    private_checkpoints: bool = True,
) -> AsyncRunResult:
    """Run Algorithm 3 with ``concurrency`` worker processes until ``steps`` updates were
    applied or ``max_time`` real seconds passed: :func:`~partialfl.runtime.asynchronous.
    run_arrivals` with the executor ``AsyncWorkers(time_unit, poll_seconds, max_respawns)``
    (the keyword form, kept for its callers). ``result.seconds`` is the wall time;
    ``steps["busy"]`` the seconds each applied job really computed. Checkpoints as in
    :func:`~partialfl.runtime.asynchronous.run_async` (a resumed run sends the jobs in flight
    again; real time is not replayed exactly)."""
    ck = None if checkpoint is None else Checkpointing(checkpoint, checkpoint_every, resume,
                                                       private_checkpoints)
    workers = AsyncWorkers(time_unit, poll_seconds, max_respawns)
    return run_arrivals(Run(problem, algorithm,
                            Arrivals(steps, max_time, concurrency, compute_time, record_events),
                            seed=seed, theta0=theta0,
                            executor=Executor(workers, str(getattr(problem, "device", "cpu"))),
                            evaluation=Evaluation(evaluate, eval_every, logger, progress),
                            checkpoint=ck, max_failure_fraction=max_failure_fraction))
