"""Asynchronous training on real concurrency: Algorithm 3 with worker processes.

One worker process per slot (``concurrency`` of them, started with the ``spawn`` method and
made single-threaded: OMP/MKL/OpenBLAS thread counts 1, ``torch.set_num_threads(1)`` when
torch is loaded). The server (this process) sends each worker the θ its new client receives;
the worker really computes ``algorithm.client_update`` for that client and then sleeps until
the client's compute time — ``compute_time.job_duration(...) × time_unit`` seconds, so slow
devices are really slow — has passed, and returns the result. The server applies results in
the order they arrive (a shared queue) and hands the slot to a newly sampled client. The
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
import queue
import sys
import time as _time
import traceback

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
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(1)
    results.put(("ready", slot))
    while True:
        task = tasks.get()
        if task is None:
            return
        job_id, client, state, ctx, cs, seconds = task
        start = _time.perf_counter()
        try:
            res = algorithm.client_update(state, problem, np.asarray([client]), ctx, cs)
        except Exception:  # report and go on: the server skips this client
            results.put(("error", slot, job_id, traceback.format_exc()))
            continue
        busy = _time.perf_counter() - start
        if seconds > busy:
            _time.sleep(seconds - busy)
        results.put(("ok", slot, job_id, res, busy))


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
    results = ctx_mp.Queue()
    tasks: list = [None] * concurrency
    workers: list = [None] * concurrency

    def start(slot: int) -> None:
        tasks[slot] = ctx_mp.Queue()
        with _single_threaded_children():
            w = ctx_mp.Process(target=_worker, args=(slot, problem, algorithm, tasks[slot],
                                                     results),
                               daemon=True, name=f"partialfl-async-{slot}")
            w.start()
        workers[slot] = w

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

    def reap() -> None:
        """Detect dead workers: lose their job, start a fresh worker (or close the slot)."""
        for slot, w in enumerate(workers):
            if slot in closed or w.is_alive():
                continue
            now = _time.perf_counter() - t0
            jid = pending.pop(slot, None)
            if jid is not None:
                server.lost(jobs.pop(jid), now, death=True)
            w.join(0.1)
            tasks[slot].cancel_join_thread()
            tasks[slot].close()
            if respawns[slot] < max_respawns:
                respawns[slot] += 1
                start(slot)  # it says "ready" through the results queue, then gets a job
            else:
                closed.add(slot)
        if len(closed) == concurrency:
            raise ClientFaultError(f"every asynchronous worker died ({max_respawns} restarts "
                                   f"per slot); first: {server.faults.first_error_text}")

    bar = None
    try:
        _wait_ready(workers, results, poll_seconds)
        t0 = _time.perf_counter()  # the clock starts once every worker is up
        bar = _progress(progress, steps, max_time, algorithm.name)
        for s in range(concurrency):
            launch(s)
        while steps is None or server.arrivals < steps:
            reap()
            try:
                msg = results.get(timeout=poll_seconds)
            except queue.Empty:
                if max_time is not None and _time.perf_counter() - t0 > max_time:
                    break
                continue
            now = _time.perf_counter() - t0
            if max_time is not None and now > max_time:
                break
            if msg[0] == "ready":  # a restarted worker
                launch(msg[1])
                continue
            slot, job_id = msg[1], msg[2]
            if pending.get(slot) != job_id:
                continue  # a late message of a job already counted as lost
            del pending[slot]
            if msg[0] == "error":
                server.lost(jobs.pop(job_id), now, msg[3].strip().splitlines()[-1])
            else:
                res, secs = msg[3], msg[4]
                if server.arrive(jobs.pop(job_id), res, now):
                    busy.append(secs)
                    if bar is not None:
                        bar.update(1 if steps is not None else now - bar.n)
            launch(slot)
    finally:
        if bar is not None:
            bar.close()
        _shutdown(workers, tasks, results)
    out = server.result(_time.perf_counter() - t0)
    out.steps["busy"] = np.asarray(busy, dtype=float)
    return out


def _wait_ready(workers, results, poll_seconds: float) -> None:
    ready = 0
    while ready < len(workers):
        try:
            msg = results.get(timeout=poll_seconds)
        except queue.Empty:
            dead = [w.name for w in workers if not w.is_alive()]
            if dead:
                raise RuntimeError(f"asynchronous worker(s) {dead} died at start") from None
            continue
        if msg[0] != "ready":
            raise RuntimeError(f"unexpected message from a starting worker: {msg[0]!r}")
        ready += 1


def _shutdown(workers, tasks, results, timeout: float = 10.0) -> None:
    """Stop our workers: a sentinel each, drain results so none blocks on a full pipe, then
    join; a worker still alive after ``timeout`` seconds is terminated."""
    for q in tasks:
        with contextlib.suppress(ValueError, OSError):  # the queue of a dead worker is closed
            q.put(None)
    deadline = _time.monotonic() + timeout
    while any(w.is_alive() for w in workers) and _time.monotonic() < deadline:
        try:
            results.get(timeout=0.05)
        except queue.Empty:
            pass
    for w in workers:
        if w.is_alive():
            w.terminate()
        w.join(1.0)
    for q in (*tasks, results):
        with contextlib.suppress(ValueError, OSError):
            q.cancel_join_thread()  # never block on data nobody will read
            q.close()
