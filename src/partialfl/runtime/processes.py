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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time as _time
import traceback
from contextlib import contextmanager

import numpy as np

from partialfl.algorithms.base import Algorithm
from partialfl.runtime.asynchronous import (
    AsyncRunResult,
    AsyncServer,
    ComputeTimeModel,
    _check_budget,
    _progress,
)
from partialfl.types import Params

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


@contextmanager
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
        except BaseException:  # report, don't hang the server
            results.put(("error", slot, job_id, traceback.format_exc()))
            return
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
    poll_seconds: float = 5.0,
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
                         record_events=record_events)
    ctx_mp = mp.get_context("spawn")
    results = ctx_mp.Queue()
    tasks = [ctx_mp.Queue() for _ in range(concurrency)]
    with _single_threaded_children():
        workers = [ctx_mp.Process(target=_worker, args=(s, problem, algorithm, tasks[s], results),
                                  daemon=True, name=f"partialfl-async-{s}")
                   for s in range(concurrency)]
        for w in workers:
            w.start()
    jobs: dict[int, object] = {}
    busy: list[float] = []

    def launch(slot: int) -> None:
        job = server.dispatch(slot, _time.perf_counter() - t0)
        state, cs, ctx = server.job_inputs(job)
        secs = time_unit * model.job_duration(seed, job.job, job.client,
                                              server.num_examples[job.client])
        jobs[job.job] = job
        tasks[slot].put((job.job, job.client, state, ctx, cs, secs))

    bar = None
    try:
        _wait_ready(workers, results, poll_seconds)
        t0 = _time.perf_counter()  # the clock starts once every worker is up
        bar = _progress(progress, steps, max_time, algorithm.name)
        for s in range(concurrency):
            launch(s)
        while steps is None or server.arrivals < steps:
            try:
                msg = results.get(timeout=poll_seconds)
            except queue.Empty:
                dead = [w.name for w in workers if not w.is_alive()]
                if dead:
                    raise RuntimeError(f"asynchronous worker(s) {dead} died") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"worker {msg[1]} failed on job {msg[2]}:\n{msg[3]}")
            _, slot, job_id, res, secs = msg
            now = _time.perf_counter() - t0
            if max_time is not None and now > max_time:
                break
            server.arrive(jobs.pop(job_id), res, now)
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
        q.cancel_join_thread()  # never block on data nobody will read
        q.close()
