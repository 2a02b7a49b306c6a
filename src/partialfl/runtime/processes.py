"""Asynchronous training on real concurrency: Algorithm 3 with worker processes.

One worker process per slot (``concurrency`` of them, started with the ``spawn`` method and
made single-threaded: OMP/MKL/OpenBLAS thread counts 1, ``torch.set_num_threads(1)`` when
torch is loaded). The server (this process) sends each worker the θ its new client receives;
the worker really computes ``algorithm.client_update`` for that client and then sleeps until
the client's compute time — ``compute_time.job_duration(...) × time_unit`` seconds, so slow
devices are really slow — has passed, and returns the result. The server applies results in
the order they arrive (one pipe per worker) and hands the slot to a newly sampled client. The
loop is :func:`partialfl.runtime.asynchronous.drive` (the simulated runtime's) with the
:class:`WorkerProcesses` transport; times are real seconds since the start.

Faults: a client that raises in a worker is reported and skipped (the worker lives on); a
worker process that dies is detected within ``poll_seconds`` even while other workers keep
delivering — its job is counted as lost (``worker_deaths``), its client freed, and a fresh
worker is started for the slot (a slot whose workers died ``max_respawns`` times is
closed; the run goes on with fewer workers). Aborts only past ``max_failure_fraction``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time as _time
import traceback
from multiprocessing import connection as mp_connection
from pathlib import Path

import numpy as np

from partialfl.algorithms.base import Algorithm
from partialfl.runtime.asynchronous import (
    AsyncRunResult,
    ComputeTimeModel,
    Event,
    _check_budget,
    async_server,
    drive,
)
from partialfl.runtime.faults import ClientFaultError
from partialfl.types import Params

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


@contextlib.contextmanager
def _single_threaded_children():
    """Spawned children inherit the environment at start: make their BLAS single-threaded."""
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update({k: "1" for k in _THREAD_VARS})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(slot: int, problem, algorithm, tasks, results) -> None:
    """``results``: this worker's own pipe (a shared queue's lock could be left held by a
    worker that dies mid-write, silencing every other worker)."""
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(1)
    results.send(("ready", slot))
    while True:
        task = tasks.get()
        if task is None:
            return
        job_id, client, state, ctx, cs, seconds = task
        start = _time.perf_counter()
        try:
            res = algorithm.client_update(state, problem, np.asarray([client]), ctx, cs)
        except Exception:  # report and go on: the server skips this client
            results.send(("error", slot, job_id, traceback.format_exc()))
            continue
        busy = _time.perf_counter() - start
        if seconds > busy:
            _time.sleep(seconds - busy)
        results.send(("ok", slot, job_id, res, busy))


class WorkerProcesses:
    """The transport of :func:`run_processes`: one spawned worker process per slot; times are
    real seconds since every worker was ready (see the module docstring)."""

    def __init__(self, problem, algorithm: Algorithm, concurrency: int, time_unit: float,
                 poll_seconds: float, max_respawns: int) -> None:
        self.problem, self.algorithm = problem, algorithm
        self.n, self.time_unit, self.poll = concurrency, time_unit, poll_seconds
        self.max_respawns = max_respawns
        self.ctx = mp.get_context("spawn")
        self.tasks: list = [None] * concurrency
        self.readers: list = [None] * concurrency
        self.workers: list = [None] * concurrency
        self.jobs: dict[int, object] = {}
        self.pending: dict[int, int] = {}  # slot -> job id in flight
        self.respawns = [0] * concurrency
        self.closed: set[int] = set()
        self.queue: list = []
        self.t0 = _time.perf_counter()
        self.first_error = ""

    def _spawn(self, slot: int) -> None:
        self.tasks[slot] = self.ctx.Queue()
        reader, writer = self.ctx.Pipe(duplex=False)
        with _single_threaded_children():
            w = self.ctx.Process(target=_worker, args=(slot, self.problem, self.algorithm,
                                                       self.tasks[slot], writer),
                                 daemon=True, name=f"partialfl-async-{slot}")
            w.start()
        writer.close()  # the worker holds the only writing end: EOF when it dies
        self.workers[slot], self.readers[slot] = w, reader

    def start(self) -> None:
        """Start every worker and wait until all are ready; the clock starts then."""
        for s in range(self.n):
            self._spawn(s)
        _wait_ready(self.workers, self.readers, self.poll)
        self.t0 = _time.perf_counter()

    def now(self) -> float:
        """Real seconds since the start."""
        return _time.perf_counter() - self.t0

    def send(self, job, state, client_state, ctx, seconds):
        """Hand the job to its slot's worker (it sleeps until ``seconds × time_unit``)."""
        self.jobs[job.job] = job
        self.pending[job.slot] = job.job
        self.tasks[job.slot].put((job.job, job.client, state, ctx, client_state,
                                  self.time_unit * seconds))
        return None

    def _death(self, slot: int) -> Event:
        jid = self.pending.pop(slot, None)
        return Event("death", slot, None if jid is None else self.jobs.pop(jid),
                     time=self.now())

    def next(self, max_time):
        """The next message of any worker (deaths detected within ``poll_seconds``)."""
        while not self.queue:
            live = [s for s in range(self.n) if s not in self.closed]
            for s in live:  # dead without EOF yet (e.g. killed mid-send)
                if not self.workers[s].is_alive() and not self.readers[s].poll():
                    return self._death(s)
            by_reader = {self.readers[s]: s for s in live}
            ready = mp_connection.wait(list(by_reader), timeout=self.poll)
            if max_time is not None and self.now() > max_time:
                return None
            for conn in ready:
                self.queue.append((by_reader[conn], conn))
            if not ready:
                return Event("wait")
        slot, conn = self.queue.pop(0)
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return self._death(slot)
        now = self.now()
        if len(msg) == 2:  # ("ready", slot): a restarted worker
            return Event("ready", slot, time=now)
        job_id = msg[2]
        if self.pending.get(slot) != job_id:
            return Event("wait")  # a late message of a job already counted as lost
        del self.pending[slot]
        job = self.jobs.pop(job_id)
        match msg:
            case ("error", _, _, tb):  # the client raised: its traceback
                return Event("error", slot, job, tb.strip().splitlines()[-1], now, tb)
            case ("ok", _, _, result, busy):
                return Event("done", slot, job, result, now, busy=busy)
        raise RuntimeError(f"unexpected message from worker {slot}: {msg[0]!r}")

    def resume(self, time: float) -> None:
        """Continue the clock at ``time`` seconds (a resumed run)."""
        self.t0 = _time.perf_counter() - float(time)

    def restart(self, slot: int) -> None:
        """Worker ``slot`` died: start a fresh one (it says "ready"), or close the slot."""
        self.queue = [q for q in self.queue if q[0] != slot]
        w = self.workers[slot]
        w.join(0.5)
        if w.is_alive():
            w.terminate()
            w.join(1.0)
        self.readers[slot].close()
        self.tasks[slot].cancel_join_thread()
        self.tasks[slot].close()
        if self.respawns[slot] < self.max_respawns:
            self.respawns[slot] += 1
            self._spawn(slot)
        else:
            self.closed.add(slot)
            if len(self.closed) == self.n:
                raise ClientFaultError(
                    f"every asynchronous worker died ({self.max_respawns} restarts per slot)")

    def close(self) -> None:
        """Stop every worker (see :func:`_shutdown`)."""
        _shutdown([w for w in self.workers if w is not None],
                  [q for q in self.tasks if q is not None],
                  [r for r in self.readers if r is not None])


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
    applied or ``max_time`` real seconds passed. ``time_unit``: real seconds per unit of the
    compute-time model. ``result.seconds`` is the wall time; ``steps["busy"]`` the seconds
    each applied job really computed. Checkpoints as in
    :func:`~partialfl.runtime.asynchronous.run_async` (a resumed run sends the jobs in flight
    again; real time is not replayed exactly)."""
    _check_budget(steps, max_time)
    if not (time_unit >= 0):
        raise ValueError(f"time_unit must be >= 0 seconds, got {time_unit!r}")
    server, model, ck = async_server(
        problem, algorithm, concurrency=concurrency, compute_time=compute_time, seed=seed,
        theta0=theta0, evaluate=evaluate, eval_every=eval_every, logger=logger,
        record_events=record_events, max_failure_fraction=max_failure_fraction,
        checkpoint=checkpoint, resume=resume, private_checkpoints=private_checkpoints)
    transport = WorkerProcesses(problem, algorithm, concurrency, time_unit, poll_seconds,
                                max_respawns)
    busy = drive(server, transport, model, steps=steps, max_time=max_time, progress=progress,
                 checkpoint=ck, checkpoint_every=checkpoint_every, resume=resume)
    out = server.result(transport.now())
    out.steps["busy"] = np.asarray(busy, dtype=float)
    return out


def _wait_ready(workers, readers, poll_seconds: float) -> None:
    waiting = {r: w for r, w in zip(readers, workers)}
    while waiting:
        for conn in mp_connection.wait(list(waiting), timeout=poll_seconds):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"asynchronous worker {waiting[conn].name} died at "
                                   "start") from None
            if msg[0] != "ready":
                raise RuntimeError(f"unexpected message from a starting worker: {msg[0]!r}")
            del waiting[conn]
        dead = [w.name for w in waiting.values() if not w.is_alive()]
        if dead and not any(r.poll() for r in waiting):
            raise RuntimeError(f"asynchronous worker(s) {dead} died at start")


def _shutdown(workers, tasks, readers, timeout: float = 10.0) -> None:
    """Stop our workers: a sentinel each, drain their pipes so none blocks on a full one,
    then join; a worker still alive after ``timeout`` seconds is terminated."""
    for q in tasks:
        with contextlib.suppress(ValueError, OSError):  # the queue of a dead worker is closed
            q.put(None)
    deadline = _time.monotonic() + timeout
    while any(w.is_alive() for w in workers) and _time.monotonic() < deadline:
        for conn in mp_connection.wait([r for r in readers if not r.closed], timeout=0.05):
            with contextlib.suppress(EOFError, OSError):
                conn.recv()
    for w in workers:
        if w.is_alive():
            w.terminate()
        w.join(1.0)
    for q in tasks:
        with contextlib.suppress(ValueError, OSError):
            q.cancel_join_thread()  # never block on data nobody will read
            q.close()
    for r in readers:
        r.close()
