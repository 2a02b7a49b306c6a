"""The ``processes`` backend: one round's cohort spread over worker processes.

Workers are forked once per (problem, algorithm) pair, so each holds its own copy of the
module and the data view (built once, copy-on-write), and runs with ONE torch thread. θ lives
in shared memory: every round the parent copies θʳ into shared tensors that all workers map,
so only the cohort's client ids, the round context, the server state's small extras and the
clients' state rows travel through the task queue. Clients are handed out one at a time
(dynamic load balancing); each worker runs exactly what :class:`SequentialBackend` runs for a
client, ``algorithm.client_update(state, problem, [m], ctx, state_rows_m)``, and sends back that
client's :class:`ClientResult` (tensors travel through shared memory).

Bit-exactness: the parent stacks the per-client rows in cohort order, as the sequential
backend does, and the aggregator (mean, or any robust rule) runs on them in the parent. So the
result equals the sequential backend's bit for bit when the sequential run also uses one torch
thread (a client's arithmetic does not depend on which process runs it). Summing inside the
workers would save the transfer of k rows but changes the floating-point summation order,
hence is not done: the rows cost one shared-memory copy per client, small next to a client's
local training.

The workers hold copies of the problem and the algorithm as they were when the pool
started: ``client_update`` must be pure (as :mod:`partialfl.algorithms.base` requires), i.e.
not read algorithm attributes that the server side changes between rounds.

A worker that raises reports its traceback (the parent raises :class:`WorkerError`); a worker
that dies (killed, out of memory) is detected while the parent waits, and the pool is shut
down.

Start method: ``fork`` where it is safe (Linux/macOS with a CPU-only torch: cheapest, the
workers share the parent's module and data copy-on-write). A torch that sees a GPU runs
autograd's device threads in the parent, and autograd then refuses to run in a forked child
("Unable to handle autograd's threading in combination with fork-based multiprocessing", seen
on an H200 machine), so there the workers are *spawned* and receive the problem and the
algorithm pickled (``ModelProblem`` pickles without its functorch transforms and rebuilds
them). ``ProcessBackend(start_method=...)`` forces one.
"""

from __future__ import annotations

import os
import queue
import traceback
import weakref
from dataclasses import replace

import numpy as np

from partialfl import arrays
from partialfl.algorithms.base import ClientResult
from partialfl.runtime.clients import ClientCall, CohortRunner

_POLL_S = 0.2


class WorkerError(RuntimeError):
    """A worker of the process backend failed (its traceback is in the message) or died."""


def default_workers() -> int:
    """The CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)


def _is_tensor(v) -> bool:
    return hasattr(v, "share_memory_")


def _worker(problem, algorithm, theta_shm, tasks, results) -> None:
    import torch

    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            return
        pos, m, state, ctx, cs = task
        try:
            if theta_shm is not None:
                state = replace(state, theta=theta_shm)
            res = algorithm.client_update(state, problem, np.asarray([m]), ctx, cs)
            results.put(("ok", pos, res))
        except BaseException:  # report, never hang the parent
            results.put(("error", pos, traceback.format_exc()))


START_METHODS = ("fork", "spawn", "forkserver")


def default_start_method() -> str:
    """``fork`` unless torch sees an accelerator (see the module docstring), then ``spawn``."""
    import multiprocessing

    import torch

    if "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    mps = getattr(torch.backends, "mps", None)
    if torch.cuda.is_available() or (mps is not None and mps.is_available()):
        return "spawn"
    return "fork"


class _Pool:
    def __init__(self, problem, algorithm, theta, workers: int, start_method: str) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context(start_method)
        self.key = (id(problem), id(algorithm))
        self.owned = (problem, algorithm)  # keep them alive: their ids key the pool
        self.shared = all(_is_tensor(v) for v in theta.values())
        self.theta_shm = ({n: v.detach().clone().share_memory_() for n, v in theta.items()}
                          if self.shared else None)
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(problem, algorithm, self.theta_shm, self.tasks,
                                        self.results), name=f"partialfl-cohort-{i}")
                      for i in range(workers)]
        for p in self.procs:
            p.start()

    def fits(self, problem, algorithm, theta) -> bool:
        if (id(problem), id(algorithm)) != self.key:
            return False
        if not self.shared:
            return not any(_is_tensor(v) for v in theta.values())
        return (theta.keys() == self.theta_shm.keys() and
                all(_is_tensor(v) and v.shape == self.theta_shm[n].shape and
                    v.dtype == self.theta_shm[n].dtype for n, v in theta.items()))

    def run(self, state, cohort, ctx, client_state) -> list[ClientResult]:
        if self.shared:
            for n, v in state.theta.items():
                self.theta_shm[n].copy_(v.detach())
            light = replace(state, theta={}, opt_state=None)
        else:
            light = replace(state, opt_state=None)
        for i, m in enumerate(cohort):
            cs = None if client_state is None else {n: v[i:i + 1]
                                                    for n, v in client_state.items()}
            self.tasks.put((i, int(m), light, ctx, cs))
        out: list[ClientResult | None] = [None] * len(cohort)
        left = len(cohort)
        while left:
            try:
                msg = self.results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    self.close()
                    raise WorkerError(
                        f"worker process {dead[0].name} died (exit code {dead[0].exitcode}) "
                        "during a round; the pool was shut down") from None
                continue
            if msg[0] == "error":
                self.close()
                raise WorkerError(f"client at cohort position {msg[1]} failed in a worker:\n"
                                  f"{msg[2]}")
            out[msg[1]] = _own(msg[2])
            left -= 1
        return out  # type: ignore[return-value]

    def close(self) -> None:
        for _ in self.procs:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):
                break
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
        self.procs = []


def _own(res: ClientResult) -> ClientResult:
    """Copy a result's tensors out of the worker's shared memory segments."""

    def cp(tree):
        return None if tree is None else {n: (arrays.copy(v) if arrays.is_torch(v) else v)
                                          for n, v in tree.items()}

    u = res.updates
    up = replace(u, vectors=cp(u.vectors), extra={e: cp(t) for e, t in u.extra.items()})
    return ClientResult(up, cp(res.client_state))


class ProcessBackend(CohortRunner):
    """Runs a round's clients on ``workers`` forked processes (see the module docstring): a
    pool mode of :func:`partialfl.batching.map_clients` that runs :class:`ClientCall` s.

    The pool starts at the first round and is reused while the problem and the algorithm
    stay the same objects (a new pair restarts it); :meth:`close` (or the end of the
    program) stops it.
    """

    name = "processes"

    def __init__(self, workers: int | None = None, start_method: str | None = None) -> None:
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive integer or None, got {workers!r}")
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"unknown start method {start_method!r}; allowed: "
                             f"{', '.join(START_METHODS)}")
        self.workers = workers or default_workers()
        self.start_method = start_method or default_start_method()
        self._pool: _Pool | None = None
        self._finalizer = None

    def map_groups(self, fn, groups: list[np.ndarray]) -> list[ClientResult]:
        """Each one-client group of ``fn`` (a :class:`ClientCall`) in a worker, cohort order."""
        if not isinstance(fn, ClientCall):
            raise TypeError(f"the processes backend runs client updates (ClientCall), not "
                            f"{type(fn).__name__}")
        dev = getattr(fn.problem, "device", None)
        if dev is not None and getattr(dev, "type", str(dev)) != "cpu":
            raise ValueError(f"the processes backend runs clients in forked CPU workers; the "
                             f"problem is on {dev}: use device 'cpu' (or another backend)")
        state = fn.state
        if self._pool is None or not self._pool.fits(fn.problem, fn.algorithm, state.theta):
            self.close()
            self._pool = _Pool(fn.problem, fn.algorithm, state.theta, self.workers,
                               self.start_method)
            self._finalizer = weakref.finalize(self, self._pool.close)
        pos = np.concatenate(groups)
        cs = None if fn.client_state is None else {n: v[pos] for n, v in
                                                    fn.client_state.items()}
        return self._pool.run(state, fn.cohort[pos], fn.ctx, cs)

    def close(self) -> None:
        """Stop the worker processes (a later round starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
        self._pool, self._finalizer = None, None

    def __enter__(self) -> ProcessBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
