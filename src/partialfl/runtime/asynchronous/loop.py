"""The one asynchronous loop (Algorithm 3), :func:`drive`, over a transport
(:class:`AsyncTransport`: :class:`SimulatedClock` here, worker processes in
:mod:`partialfl.runtime.processes`, Flower in :mod:`partialfl.flower.jobs`), and
:func:`run_arrivals`, which runs a :class:`~partialfl.runtime.run.Run` with an
:class:`~partialfl.runtime.run.Arrivals` schedule on the transport its executor names."""

from __future__ import annotations

import heapq
import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from partialfl.algorithms.base import Algorithm, RoundContext, ServerState
from partialfl.batching import Executor, Loop, Vmap
from partialfl.runtime.asynchronous.server import AsyncCheckpoint, AsyncRunResult, AsyncServer, Job
from partialfl.runtime.asynchronous.timing import ComputeTimeModel
from partialfl.runtime.checkpoint import run_fingerprint
from partialfl.runtime.clients import checked
from partialfl.runtime.faults import ClientFaultError, check_end, check_stalled
from partialfl.runtime.resume_check import check_async
from partialfl.runtime.run import Arrivals, Checkpointing, Evaluation, Run, check_budget
from partialfl.types import Params


def _progress(progress, steps, max_time, name):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps if steps is not None else max_time, mininterval=0.5, leave=False,
                desc=progress if isinstance(progress, str) else f"async {name}")



@dataclass(frozen=True)
class Event:
    """What a transport reports: ``done`` (``payload``: the job's ClientResult), ``error``
    (the client raised; ``payload``: the reason), ``death`` (the worker of ``slot`` died;
    ``job`` lost, or None), ``ready`` (a restarted worker of ``slot`` waits for a job) or
    ``wait`` (nothing yet)."""

    kind: str
    slot: int = -1
    job: Job | None = None
    payload: Any = None
    time: float = 0.0
    detail: str = ""  # ``error``: the full traceback, when the transport has one
    busy: float = 0.0  # ``done``: the seconds the job really computed (real transports)


@runtime_checkable
class AsyncTransport(Protocol):
    """How jobs reach clients and results come back (simulated clock, worker processes).

    ``send`` starts ``job`` (duration ``seconds`` of the compute-time model) and returns an
    exception if the client failed at once (None otherwise); ``next(max_time)`` blocks until
    the next :class:`Event`, None when nothing more can happen before ``max_time``;
    ``restart(slot)`` replaces a dead worker (it reports ``ready``)."""

    def start(self) -> None: ...

    def now(self) -> float: ...

    def send(self, job: Job, state: ServerState, client_state: Params | None,
             ctx: RoundContext, seconds: float) -> BaseException | None: ...

    def next(self, max_time: float | None) -> Event | None: ...

    def restart(self, slot: int) -> None: ...

    def resume(self, time: float) -> None: ...

    def close(self) -> None: ...


def drive(server: AsyncServer, transport: AsyncTransport, compute_time: ComputeTimeModel, *,
          steps: int | None, max_time: float | None, progress: bool | str = False,
          checkpoint: AsyncCheckpoint | None = None, checkpoint_every: int = 0,
          resume: bool = False) -> list[float]:
    """The one asynchronous loop (Algorithm 3) over any transport: keep every slot busy with
    a newly sampled client, apply each result the moment it arrives (staleness, counting and
    evaluation cadence in :class:`AsyncServer`), until ``steps`` updates were applied or
    ``max_time`` passed. A client that fails is counted and its slot relaunched; a dead
    worker's job is lost and the slot relaunched once its replacement is ready. Returns the
    ``busy`` seconds of every applied update.

    ``checkpoint``: saved after every ``checkpoint_every``-th applied update and at the end;
    with ``resume`` the run continues from it: the jobs that were in flight are sent again
    with the θ they had received (on the simulated clock the run is then exactly the
    uninterrupted one) and idle slots get new clients."""
    check_budget(steps, max_time)
    M = server.problem.num_clients

    inflight: dict[int, tuple] = {}  # job id -> (job, state, client rows, ctx) sent

    def send(job, state, cs, ctx):
        d = compute_time.job_duration(server.seed, job.job, job.client,
                                      server.num_examples[job.client])
        err = transport.send(job, state, cs, ctx, d)
        if err is None:
            inflight[job.job] = (job, state, cs, ctx)
        return err

    def launch(slot: int) -> None:
        for _ in range(10 * M + 10):
            job = server.dispatch(slot, transport.now())
            err = send(job, *server.job_inputs(job))
            if err is None:
                return
            server.lost(job, transport.now(), err)
            server.faults.raise_if_systematic(server.concurrency)
        raise ClientFaultError(f"slot {slot}: every client dispatched failed; first: "
                               f"{server.faults.first_error_text}")

    bar = None
    busy: list[float] = []
    try:
        transport.start()
        loaded = checkpoint.load() if resume and checkpoint is not None else None
        if loaded is not None:  # this run's kind of state (the fresh server's), or one line
            snap, client_state, jobs = check_async(
                loaded, server.state, server.problem.num_clients, server.concurrency,
                checkpoint.path, like_clients=server.client_state,
                fixed=getattr(server.algorithm, "fixed_extra", ()))
            server.restore(snap, client_state)
            transport.resume(server.time)
            for job, state, cs in sorted(jobs, key=lambda j: j[0].job):
                ctx = RoundContext(server.seed, job.job)
                if (err := send(job, state, cs, ctx)) is not None:
                    server.lost(job, transport.now(), err)
        bar = _progress(progress, steps, max_time, server.algorithm.name)
        if bar is not None and loaded is not None:
            bar.update(server.arrivals if steps is not None else server.time)
        busy_slots = {job.slot for job, _, _, _ in inflight.values()}
        for slot in range(server.concurrency):
            if slot not in busy_slots and (steps is None or server.arrivals < steps):
                launch(slot)  # (a resumed run that had finished launches nothing)
        while steps is None or server.arrivals < steps:
            check_stalled(server.faults, waiting=any(  # a client not yet failed computing
                int(v[0].client) not in server.failed_clients for v in inflight.values()))
            ev = transport.next(max_time)
            if ev is None:
                break
            if ev.kind == "wait":
                continue
            if ev.job is not None:
                inflight.pop(ev.job.job, None)
            if ev.kind == "ready":
                launch(ev.slot)
                continue
            if ev.kind == "death":
                if ev.job is not None:
                    server.lost(ev.job, ev.time, death=True)
                try:
                    transport.restart(ev.slot)
                except ClientFaultError as e:
                    raise ClientFaultError(f"{e}; first: {server.faults.cause()}"
                                           ) from None
                continue
            if ev.kind == "error":
                server.lost(ev.job, ev.time, ev.payload)
                f = server.faults
                # raising client code in every slot before any success: a bug, not a fault
                # (a network transport's lost replies carry no traceback and do not count)
                if ev.detail and f.succeeded == 0 and f.failed >= server.concurrency:
                    raise RuntimeError(f"every slot's first client failed; first error:\n"
                                       f"{ev.detail}")
            elif server.arrive(ev.job, ev.payload, ev.time):
                busy.append(ev.busy)
                if bar is not None:
                    bar.update(1 if steps is not None else ev.time - bar.n)
                if checkpoint is not None and checkpoint_every and not server.diverged \
                        and server.arrivals % checkpoint_every == 0:
                    checkpoint.save(server, inflight)
            if (steps is not None and server.arrivals >= steps) or server.diverged:
                break
            launch(ev.job.slot)
        if checkpoint is not None and checkpoint_every and not server.diverged:
            checkpoint.save(server, inflight)
        check_end(server.faults)
    finally:
        if bar is not None:
            bar.close()
        transport.close()
    return busy


class SimulatedClock:
    """The in-process transport: each job is computed when it is sent and arrives ``seconds``
    later on a simulated clock (ties: by job number)."""

    real_time = False  # its clock is simulated

    def __init__(self, problem, algorithm: Algorithm) -> None:
        self.problem, self.algorithm = problem, algorithm
        self.heap: list = []
        self.t = 0.0

    def start(self) -> None:
        """Nothing to start."""

    def now(self) -> float:
        """The simulated time of the last arrival."""
        return self.t

    def send(self, job, state, client_state, ctx, seconds):
        """Compute the job's client update now; it arrives ``seconds`` later."""
        try:
            res = checked(self.algorithm.client_update(state, self.problem,
                                                       np.asarray([job.client]), ctx,
                                                       client_state),
                          np.asarray([job.client]), state.theta, client_state)
        except Exception as e:  # noqa: BLE001 - a failing client is skipped
            return e
        # dispatch_time: now, or for a job sent again on resume, when it was first sent
        heapq.heappush(self.heap, (job.dispatch_time + seconds, job.job, job, res))
        return None

    def next(self, max_time):
        """The earliest arrival, unless it comes after ``max_time``."""
        if not self.heap or (max_time is not None and self.heap[0][0] > max_time):
            return None
        t, _, job, res = heapq.heappop(self.heap)
        self.t = t
        return Event("done", job.slot, job, res, t)

    def restart(self, slot: int) -> None:
        """Simulated workers never die."""

    def resume(self, time: float) -> None:
        """Continue the clock at ``time`` (jobs sent again keep their dispatch times)."""
        self.t = float(time)

    def close(self) -> None:
        """Nothing to stop."""



def _transport(run: Run):
    """The transport the run's executor names: an :class:`AsyncTransport` itself, a factory
    of one (``mode.transport(problem, algorithm, concurrency)``, e.g.
    :class:`partialfl.runtime.processes.AsyncWorkers`), or for an in-process mode
    (``Vmap``/``Loop``) the :class:`SimulatedClock`."""
    mode = run.executor.mode
    if isinstance(mode, AsyncTransport):
        return mode
    make = getattr(mode, "transport", None)
    if make is not None:
        return make(run.problem, run.algorithm, run.schedule.concurrency)
    if isinstance(mode, Vmap | Loop):
        return SimulatedClock(run.problem, run.algorithm)
    raise TypeError(f"the asynchronous runtime runs on a simulated clock (executor mode Vmap() "
                    f"or Loop()), on worker processes (runtime.processes.AsyncWorkers) or on "
                    f"an AsyncTransport, not on {mode!r}")


def _checkpoint(run: Run, model: ComputeTimeModel) -> AsyncCheckpoint | None:
    """The run's :class:`AsyncCheckpoint`: its own, or one at its path checked against the
    run's fingerprint (problem, algorithm, seed, concurrency, compute-time model)."""
    c = run.checkpoint
    if c is None or isinstance(c.to, AsyncCheckpoint):
        return None if c is None else c.to
    extra = {"concurrency": int(run.schedule.concurrency), "compute_time": model}
    if c.fingerprint:
        extra["config"] = c.fingerprint
    fp = run_fingerprint(run.problem, run.algorithm, run.seed, None, extra)
    return AsyncCheckpoint(c.to, fp, c.private, device=run.checkpoint_device)


def run_arrivals(run: Run) -> AsyncRunResult:
    """Run Algorithm 3 (see :mod:`partialfl.runtime.asynchronous`) until
    ``run.schedule.steps`` updates were applied or the next arrival would come after
    ``max_time`` (lost jobs do not count as steps), on the transport the run's executor
    names (:func:`_transport`).

    ``run.evaluation.fn(algorithm, state, problem, client_state, ctx)`` is logged (with
    ``step``, ``round``, ``time``) before the first and after every ``every``-th arrival and
    at the end. With ``run.checkpoint`` the run is saved every ``every`` applied updates and
    at the end, and resumed from it (:func:`drive`, :class:`AsyncCheckpoint`); on the
    simulated clock a resumed run gives the uninterrupted run's θ, records and events. On a
    real-time transport (worker processes) ``result.seconds`` is the time since the workers
    were ready and ``steps["busy"]`` the seconds each applied job really computed.
    """
    if not isinstance(run.schedule, Arrivals):
        raise TypeError(f"run_arrivals runs Arrivals(...), not {type(run.schedule).__name__}")
    t0 = _time.perf_counter()
    sched, ev = run.schedule, run.evaluation
    model = sched.compute_time or ComputeTimeModel()
    model.check(run.problem.num_clients)
    ck = _checkpoint(run, model)
    resume = run.checkpoint is not None and run.checkpoint.resume
    resuming = resume and ck is not None and ck.codec.exists()
    server = AsyncServer(run.problem, run.algorithm, concurrency=sched.concurrency,
                         seed=run.seed, theta0=run.theta0, evaluate=ev.fn, eval_every=ev.every,
                         logger=None if resuming else ev.logger,  # restore() replays the log
                         record_events=sched.record_events,
                         max_failure_fraction=run.max_failure_fraction,
                         mode=run.executor.kernel_mode)
    server.logger = ev.logger
    transport = _transport(run)
    busy = drive(server, transport, model, steps=sched.steps, max_time=sched.max_time,
                 progress=ev.progress, checkpoint=ck,
                 checkpoint_every=0 if run.checkpoint is None else run.checkpoint.every,
                 resume=resume)
    if not getattr(transport, "real_time", False):
        return server.result(_time.perf_counter() - t0)
    out = server.result(transport.now())
    out.steps["busy"] = np.asarray(busy, dtype=float)
    return out


def run_async(
    problem,
    algorithm: Algorithm,
    *,
    steps: int | None = None,
    max_time: float | None = None,
    concurrency: int = 1,
    compute_time: ComputeTimeModel | None = None,
    seed: int = 0,
    theta0: Params | None = None,
    evaluate=None,
    eval_every: int = 1,
    logger=None,
    progress: bool | str = False,
    record_events: bool = True,
    max_failure_fraction: float = 0.5,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    private_checkpoints: bool = True,
) -> AsyncRunResult:
    """:func:`run_arrivals` of the :class:`~partialfl.runtime.run.Run` these keywords
    describe, on the simulated clock (the keyword form, kept for its callers): ``steps``,
    ``max_time``, ``concurrency``, ``compute_time``, ``record_events`` make the
    :class:`~partialfl.runtime.run.Arrivals`; ``evaluate``, ``eval_every``, ``logger``,
    ``progress`` the :class:`~partialfl.runtime.run.Evaluation`; ``checkpoint`` (a path),
    ``checkpoint_every`` (applied updates), ``resume``, ``private_checkpoints`` the
    :class:`~partialfl.runtime.run.Checkpointing`."""
    ck = None if checkpoint is None else Checkpointing(checkpoint, checkpoint_every, resume,
                                                       private_checkpoints)
    return run_arrivals(Run(problem, algorithm,
                            Arrivals(steps, max_time, concurrency, compute_time, record_events),
                            seed=seed, theta0=theta0, executor=Executor.of(problem),
                            evaluation=Evaluation(evaluate, eval_every, logger, progress),
                            checkpoint=ck, max_failure_fraction=max_failure_fraction))
