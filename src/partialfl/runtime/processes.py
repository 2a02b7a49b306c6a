"""Asynchronous training on real concurrency: Algorithm 3 with worker processes.

One worker process per slot (``concurrency`` of them, started with the ``spawn`` method and
made single-threaded: OMP/MKL/OpenBLAS thread counts 1, ``torch.set_num_threads(1)`` when
torch is loaded). The server (this process) sends each worker the θ its new client receives;
the worker really computes ``algorithm.client_update`` for that client and then sleeps until
the client's compute time — ``compute_time.job_duration(...) × time_unit`` seconds, so slow
devices are really slow — has passed, and returns the result. The server applies results in
the order they arrive (one pipe per worker) and hands the slot to a newly sampled client. The
bookkeeping (sampling, staleness, event log, evaluation) is the one of
:class:`partialfl.runtime.asynchronous.AsyncServer`; times are real seconds since the start.

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

import numpy as np

from partialfl.algorithms.base import Algorithm
from partialfl.runtime.asynchronous import (
    AsyncRunResult,
    AsyncServer,
    ComputeTimeModel,
    _check_budget,
    _progress,
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
) -> AsyncRunResult:
    """Run Algorithm 3 with ``concurrency`` worker processes until ``steps`` updates were
    applied or ``max_time`` real seconds passed. ``time_unit``: real seconds per unit of the
    compute-time model. ``result.seconds`` is the wall time; ``steps["busy"]`` the seconds
    each applied job really computed."""
    _check_budget(steps, max_time)
    if not (time_unit >= 0):
        raise ValueError(f"time_unit must be >= 0 seconds, got {time_unit!r}")
    model = compute_time or ComputeTimeModel()
    model.check(problem.num_clients)
    server = AsyncServer(problem, algorithm, concurrency=concurrency, seed=seed, theta0=theta0,
                         evaluate=evaluate, eval_every=eval_every, logger=logger,
                         record_events=record_events,
                         max_failure_fraction=max_failure_fraction)
    ctx_mp = mp.get_context("spawn")
    tasks: list = [None] * concurrency
    readers: list = [None] * concurrency
    workers: list = [None] * concurrency

    def start(slot: int) -> None:
        tasks[slot] = ctx_mp.Queue()
        reader, writer = ctx_mp.Pipe(duplex=False)
        with _single_threaded_children():
            w = ctx_mp.Process(target=_worker, args=(slot, problem, algorithm, tasks[slot],
                                                     writer),
                               daemon=True, name=f"partialfl-async-{slot}")
            w.start()
        writer.close()  # the worker holds the only writing end: EOF when it dies
        workers[slot], readers[slot] = w, reader

    for s in range(concurrency):
        start(s)
    jobs: dict[int, object] = {}
    pending: dict[int, int] = {}  # slot -> job id in flight
    respawns = [0] * concurrency
    closed: set[int] = set()
    busy: list[float] = []

    def launch(slot: int) -> None:
        job = server.dispatch(slot, _time.perf_counter() - t0)
        state, cs, ctx = server.job_inputs(job)
        secs = time_unit * model.job_duration(seed, job.job, job.client,
                                              server.num_examples[job.client])
        jobs[job.job] = job
        pending[slot] = job.job
        tasks[slot].put((job.job, job.client, state, ctx, cs, secs))

    def bury(slot: int) -> None:
        """Worker ``slot`` died: lose its job, start a fresh worker (or close the slot)."""
        now = _time.perf_counter() - t0
        jid = pending.pop(slot, None)
        if jid is not None:
            server.lost(jobs.pop(jid), now, death=True)
        w = workers[slot]
        w.join(0.5)
        if w.is_alive():
            w.terminate()
            w.join(1.0)
        readers[slot].close()
        tasks[slot].cancel_join_thread()
        tasks[slot].close()
        if respawns[slot] < max_respawns:
            respawns[slot] += 1
            start(slot)  # it says "ready" through its pipe, then gets a job
        else:
            closed.add(slot)
            if len(closed) == concurrency:
                raise ClientFaultError(
                    f"every asynchronous worker died ({max_respawns} restarts per slot); "
                    f"first: {server.faults.first_error_text}")

    bar = None
    try:
        _wait_ready(workers, readers, poll_seconds)
        t0 = _time.perf_counter()  # the clock starts once every worker is up
        bar = _progress(progress, steps, max_time, algorithm.name)
        for s in range(concurrency):
            launch(s)
        while steps is None or server.arrivals < steps:
            live = {readers[s]: s for s in range(concurrency) if s not in closed}
            for s in list(live.values()):  # dead without EOF yet (e.g. killed mid-send)
                if not workers[s].is_alive() and not readers[s].poll():
                    bury(s)
            live = {readers[s]: s for s in range(concurrency) if s not in closed}
            ready = mp_connection.wait(list(live), timeout=poll_seconds)
            if max_time is not None and _time.perf_counter() - t0 > max_time:
                break
            for conn in ready:
                slot = live[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    bury(slot)
                    continue
                now = _time.perf_counter() - t0
                if msg[0] == "ready":  # a restarted worker
                    launch(slot)
                    continue
                job_id = msg[2]
                if pending.get(slot) != job_id:
                    continue  # a late message of a job already counted as lost
                del pending[slot]
                if msg[0] == "error":
                    server.lost(jobs.pop(job_id), now, msg[3].strip().splitlines()[-1])
                    f = server.faults
                    if f.succeeded == 0 and f.failed >= concurrency:  # a bug, not a fault
                        raise RuntimeError(f"every worker's first client failed; first "
                                           f"traceback:\n{msg[3]}")
                else:
                    res, secs = msg[3], msg[4]
                    if server.arrive(jobs.pop(job_id), res, now):
                        busy.append(secs)
                        if bar is not None:
                            bar.update(1 if steps is not None else now - bar.n)
                if steps is not None and server.arrivals >= steps:
                    break
                launch(slot)
    finally:
        if bar is not None:
            bar.close()
        _shutdown(workers, tasks, readers)
    out = server.result(_time.perf_counter() - t0)
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
