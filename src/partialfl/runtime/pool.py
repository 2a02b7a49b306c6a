"""Worker processes for client computations: the one pool of the synchronous ``processes``
backend (:mod:`partialfl.runtime.cohort_pool`) and of the asynchronous runtime on real
concurrency (:mod:`partialfl.runtime.processes`).

A :class:`WorkerPool` keeps ``workers`` persistent processes, each holding its own copy of
the problem and the algorithm as they were when the pool started (forked: shared
copy-on-write; spawned: pickled; ``client_update`` must be pure) and running ONE torch
thread (BLAS single-threaded too). A :class:`Task` is ONE client:
``algorithm.client_update(state, problem, [client], ctx, client_state)``; the worker then
sleeps until ``seconds`` have passed since the task started (the asynchronous runtime's
device speed; 0 for rounds) and sends back the :class:`ClientResult`. The caller hands tasks
to idle workers (:meth:`WorkerPool.idle`, :meth:`WorkerPool.send`): load balancing is
dynamic, and the caller always knows which task each worker runs.

θ travels in shared memory: each worker maps its own shared copy of θ's tensors, which the
parent overwrites before handing it a task computed from another θ (a new dict or a changed
tensor); only the client id, the round context, the server state's extras and the client's
state rows go through the worker's task queue, their arrays in the worker's inbound
shared-memory slots (:mod:`partialfl.runtime.slots`). Results come back on the worker's own
pipe (a shared queue's lock could be left held by a worker killed mid-write), their arrays
in its outbound slots, copied out on arrival. A worker holds at most
:data:`~partialfl.runtime.slots.SLOTS` tasks (the slots' reuse depends on it). θ of numpy
arrays travels with each task (in the slots).

Liveness, so that nothing waits forever: :meth:`WorkerPool.next` returns within its
``timeout`` (None: when an event comes, checking the workers every ``poll`` seconds); a worker
that dies (a raise outside the client, ``os._exit``, SIGKILL, out of memory) is reported as a
``death`` of its task within ``poll`` seconds (EOF of its pipe, or its exit code); a task
running past ``task_timeout`` is killed and reported likewise; a worker that does not start
within ``start_timeout`` is a start failure; workers quit when the parent is gone. A client
that raises is an ``error`` event and its worker lives on. :meth:`WorkerPool.restart`
replaces a dead worker (at most ``max_respawns`` times per worker, then it is retired); a
closed pool refuses tasks (:class:`WorkerError`) and is never reused.

Start method (:func:`default_start_method`): ``fork`` where it is safe (a CPU-only torch, no
thread pool of ours running); with a GPU autograd refuses to run in a forked child (seen on an
H200), so workers are *spawned* (``ModelProblem`` pickles without its functorch transforms).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import weakref
from dataclasses import dataclass, replace
from multiprocessing import connection as mp_connection
from typing import Any

from partialfl.algorithms.base import RoundContext, ServerState
from partialfl.runtime.clients import RunSetupError, error_text
from partialfl.runtime.slots import SLOTS, SlotReader, SlotWriter
from partialfl.runtime.worker import guard_forkserver, work
from partialfl.types import Params

START_METHODS = ("fork", "spawn", "forkserver")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
#: the name prefix of every worker process (:func:`in_worker`)
WORKER_NAME = "partialfl-worker"


class WorkerError(RuntimeError):
    """A worker pool cannot go on: a worker failed to start, every worker died, or the pool
    is closed (the message says which)."""


class WorkerStartError(WorkerError, RunSetupError):
    """A worker process that could not start: the run's set-up failed (one line), never
    counted as client failures."""


def default_workers() -> int:
    """The CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)


LIVE_THREAD_POOLS: weakref.WeakSet = weakref.WeakSet()  # ThreadBackends whose threads run


def default_start_method() -> str:
    """``fork`` if torch sees no accelerator (see the module docstring), else ``spawn``;
    ``forkserver`` while a thread pool runs (a fork copies the locks its threads hold)."""
    import torch

    methods = mp.get_all_start_methods()
    mps = getattr(torch.backends, "mps", None)
    if "fork" not in methods or torch.cuda.is_available() or (mps and mps.is_available()):
        return "spawn"
    return ("forkserver" if "forkserver" in methods else "spawn") if LIVE_THREAD_POOLS else "fork"


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def in_worker() -> bool:
    """Whether this process is a worker of a :class:`WorkerPool`."""
    return mp.current_process().name.startswith(WORKER_NAME)


@dataclass(frozen=True)
class Task:
    """One client's computation: ``client_update(state, problem, [client], ctx,
    client_state)``, reported ``seconds`` after it started at the earliest."""

    id: int
    client: int
    state: ServerState
    ctx: RoundContext
    client_state: Params | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class PoolEvent:
    """What :meth:`WorkerPool.next` reports about ``worker``: ``done`` (``payload``: the
    task's ClientResult, ``busy``: seconds it computed), ``error`` (the client raised;
    ``payload``: its traceback; ``error``: the exception itself, when it pickles — a data
    error, :func:`~partialfl.runtime.faults.is_data_error`, is re-raised), ``death``
    (the worker is gone; ``task``: the task it ran, or None; ``payload``: why;
    ``unstarted``: tasks it had queued, never run) or ``ready`` (a restarted worker waits
    for a task)."""

    kind: str
    worker: int
    task: int | None = None
    payload: Any = None
    busy: float = 0.0
    unstarted: tuple[int, ...] = ()  # death: the tasks queued behind ``task`` (not run)
    error: BaseException | None = None  # error: the exception raised in the worker


@contextlib.contextmanager
def _single_threaded_children():
    """Spawned children read the environment at start: make their BLAS single-threaded."""
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


def _is_tensor(v) -> bool:
    return hasattr(v, "share_memory_")


def _theta_key(theta: Params) -> tuple:
    """Identifies θ's values: its leaves and their in-place version counters."""
    return tuple((n, id(v), v._version) for n, v in theta.items())


_LIVE = ("starting", "ready")


class WorkerPool:
    """``workers`` persistent worker processes for one (problem, algorithm) pair (see the
    module docstring). Worker states: ``starting``, ``ready`` (takes tasks; runs them in the
    order sent), ``dead`` (until :meth:`restart`), ``retired``. ``own_session``: each worker
    in a session of its own, dying with its parent (:func:`partialfl.runtime.worker._detach`)."""

    def __init__(self, problem, algorithm, workers: int, *, start_method: str | None = None,
                 poll: float = 0.2, task_timeout: float | None = None,
                 start_timeout: float = 600.0, max_respawns: int = 3,
                 own_session: bool = True) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        method = start_method or default_start_method()
        if method not in START_METHODS:
            raise ValueError(f"unknown start method {method!r}; allowed: "
                             f"{', '.join(START_METHODS)}")
        for name, v in (("poll", poll), ("start_timeout", start_timeout),
                        ("task_timeout", 1.0 if task_timeout is None else task_timeout)):
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        cm = mp
        if "torch" in sys.modules:  # its reductions: tensors through shared memory
            import torch.multiprocessing as cm
        self.ctx = cm.get_context(method)
        if method == "forkserver" and not guard_forkserver(self.ctx, on=_in_main_thread()):
            # a forkserver that does not die with this process is already running: spawned
            # workers (children of this process) do
            self.ctx = cm.get_context("spawn")
        self.problem, self.algorithm, self.n = problem, algorithm, workers
        self.key = (id(problem), id(algorithm))  # ``problem``/``algorithm`` kept alive above
        self.poll, self.task_timeout, self.start_timeout = poll, task_timeout, start_timeout
        self.max_respawns, self.own_session = max_respawns, own_session
        self.procs: list = [None] * workers
        self.tasks: list = [None] * workers
        self.readers: list = [None] * workers
        self.status = ["off"] * workers
        self.started = [0.0] * workers
        self.pending: list[list[int]] = [[] for _ in range(workers)]  # task ids, in order
        self.since = [0.0] * workers  # when the worker's first pending task started
        self.theta: list[dict | None] = [None] * workers  # each worker's shared θ
        self.held: list[tuple | None] = [None] * workers  # (key, leaves) of its values
        self.has_theta = [False] * workers  # the worker process maps its shared θ
        self.outboxes: list[SlotWriter | None] = [None] * workers  # tasks → worker w
        self.inboxes: list[SlotReader | None] = [None] * workers  # worker w's results →
        self.respawns = [0] * workers
        self.ready_queue: list[int] = []
        self._liveness_at = 0.0  # when next() checks the workers' liveness again
        self.closed = False
        for w in range(workers):
            try:
                self._spawn(w)
            except (pickle.PicklingError, AttributeError, TypeError, RuntimeError) as e:
                # (spawn pickles the run: torch refuses a non-leaf tensor with RuntimeError)
                self.close()
                raise RunSetupError(
                    f"the run cannot be sent to {self.ctx.get_start_method()!r} worker "
                    f"processes ({str(e).splitlines()[0][:200]}): define the model and the "
                    "algorithm at module level, or use start method 'fork'") from None

    # -- workers ---------------------------------------------------------------------------
    def _spawn(self, w: int) -> None:
        self.tasks[w] = self.ctx.Queue()
        reader, writer = self.ctx.Pipe(duplex=False)
        with _single_threaded_children():
            p = self.ctx.Process(target=work, daemon=True, name=f"{WORKER_NAME}-{w}",
                                 args=(self.problem, self.algorithm, self.tasks[w], writer,
                                       os.getpid(), self.own_session, _in_main_thread()))
            p.start()
        writer.close()  # the worker holds the only writing end: EOF when it dies
        self.procs[w], self.readers[w] = p, reader
        self.status[w], self.started[w] = "starting", time.monotonic()
        self.has_theta[w] = False  # a new process does not map the shared θ yet
        self.outboxes[w], self.inboxes[w] = SlotWriter(), SlotReader()  # fresh slots too

    def fits(self, problem, algorithm) -> bool:
        """Whether this open pool runs ``problem`` and ``algorithm`` (the same objects)."""
        return not self.closed and (id(problem), id(algorithm)) == self.key

    def idle(self) -> list[int]:
        """The workers waiting for a task."""
        return self.free(1)

    def free(self, depth: int) -> list[int]:
        """The started workers holding fewer than ``depth`` tasks (a second task queued
        behind the running one keeps a worker busy while the parent reads its result)."""
        return [w for w in range(self.n)
                if self.status[w] == "ready" and len(self.pending[w]) < depth]

    def busy(self) -> int:
        """The number of tasks in flight."""
        return sum(len(p) for p in self.pending)

    def live(self) -> int:
        """The workers that are not dead or retired."""
        return sum(s in _LIVE for s in self.status)

    def wait_ready(self) -> None:
        """Block until every starting worker is ready; :class:`WorkerError` if one dies or
        does not start within ``start_timeout`` (a start failure is a bug, not a fault)."""
        while any(s == "starting" for s in self.status):
            ev = self.next(self.poll)
            if ev is not None and ev.kind == "death":
                self.close()
                why = (str(ev.payload).strip().splitlines() or [""])[-1]
                raise WorkerStartError(f"worker process {WORKER_NAME}-{ev.worker} failed to "
                                       f"start: {why}")

    def send(self, w: int, task: Task) -> None:
        """Hand ``task`` to started worker ``w`` (queued behind its pending tasks, which
        must have been sent the same θ; at most :data:`~partialfl.runtime.slots.SLOTS`)."""
        self._check_open()
        if self.status[w] != "ready":
            raise WorkerError(f"worker {w} is {self.status[w]}, not ready for a task")
        if len(self.pending[w]) >= SLOTS:
            raise WorkerError(f"worker {w} already holds {SLOTS} tasks (the most its "
                              "shared-memory slots allow)")
        state, new_theta = task.state, None
        if state.theta and all(_is_tensor(v) for v in state.theta.values()):
            if self.pending[w] and (self.held[w] is None or
                                    self.held[w][0] != _theta_key(state.theta)):
                raise WorkerError(f"worker {w} has tasks pending on another θ")
            new_theta = self._share_theta(w, state.theta)
            state = replace(state, theta={})
        packed = self.outboxes[w].pack((replace(state, opt_state=None), task.ctx,
                                        task.client_state))
        self.tasks[w].put((task.id, int(task.client), packed, float(task.seconds), new_theta))
        if not self.pending[w]:
            self.since[w] = time.monotonic()
        self.pending[w].append(task.id)

    def _share_theta(self, w: int, theta: Params):
        """Worker ``w``'s shared θ set to ``theta``: the shared tensors if the worker does
        not hold them yet, else True (it holds them; their values are updated here)."""
        shm, key = self.theta[w], _theta_key(theta)
        if shm is None or shm.keys() != theta.keys() or any(
                shm[n].shape != v.shape or shm[n].dtype != v.dtype for n, v in theta.items()):
            shm = self.theta[w] = {n: v.detach().clone().share_memory_()
                                   for n, v in theta.items()}
            self.has_theta[w] = False
        elif self.held[w] is None or self.held[w][0] != key:
            for n, v in theta.items():
                shm[n].copy_(v.detach())
        self.held[w] = (key, list(theta.values()))  # keeps the ids in the key alive
        if self.has_theta[w]:
            return True
        self.has_theta[w] = True
        return shm

    def restart(self, w: int) -> bool:
        """Replace dead worker ``w`` (it reports ``ready``); False if it was retired instead
        (``max_respawns`` restarts used)."""
        self._check_open()
        if self.status[w] != "dead":
            raise WorkerError(f"worker {w} is {self.status[w]}, not dead")
        if self.respawns[w] >= self.max_respawns:
            self.status[w] = "retired"
            return False
        self.respawns[w] += 1
        self._spawn(w)
        return True

    # -- events ----------------------------------------------------------------------------
    def next(self, timeout: float | None = None) -> PoolEvent | None:
        """The next event (see :class:`PoolEvent`), or None when none came within ``timeout``
        seconds; :class:`WorkerError` when no worker is left."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self.ready_queue:
                w = self.ready_queue.pop(0)
                if self.status[w] in _LIVE:
                    return self._read(w)
            now = time.monotonic()
            if now >= self._liveness_at:  # at most once per poll interval while events flow
                ev = self._check_liveness()  # (a death with EOF is read at once anyway)
                if ev is not None:
                    return ev  # check again at the next call: another may be gone too
                self._liveness_at = now + self.poll
            live = {self.readers[w]: w for w in range(self.n) if self.status[w] in _LIVE}
            if not live:
                raise WorkerError(f"no worker process is left (each died; "
                                  f"{self.max_respawns} restarts per worker)")
            left = self.poll if deadline is None else min(self.poll,
                                                          deadline - time.monotonic())
            ready = mp_connection.wait(list(live), timeout=max(0.0, left))
            self.ready_queue.extend(live[c] for c in ready)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                return None

    def _read(self, w: int) -> PoolEvent:
        try:
            msg = self.readers[w].recv()
        except (EOFError, OSError):
            return self._died(w, self._exit_reason(w))
        if msg[0] == "ready":
            self.status[w] = "ready"
            return PoolEvent("ready", w)
        tid = self.pending[w].pop(0)
        self.since[w] = time.monotonic()  # the next pending task starts now
        if msg[0] == "ok":
            try:
                res = self.inboxes[w].unpack(msg[2])
            except Exception as e:  # noqa: BLE001 - the client's result, not this process
                return PoolEvent("error", w, tid, "its result could not be read here "
                                 f"({error_text(e)})")
            return PoolEvent("done", w, tid, res, busy=float(msg[3]))
        return PoolEvent("error", w, tid, msg[2], error=msg[3])

    def _check_liveness(self) -> PoolEvent | None:
        now = time.monotonic()
        for w in range(self.n):
            s = self.status[w]
            if s not in _LIVE:
                continue
            if not self.procs[w].is_alive() and not self.readers[w].poll():
                return self._died(w, self._exit_reason(w))  # gone without EOF yet
            if s == "starting" and now - self.started[w] > self.start_timeout:
                self._kill(w)
                return self._died(w, f"did not start within {self.start_timeout} s")
            if (self.pending[w] and self.task_timeout is not None
                    and now - self.since[w] > self.task_timeout):
                self._kill(w)
                return self._died(w, f"ran its task longer than {self.task_timeout} s "
                                     "(killed)")
        return None

    def _exit_reason(self, w: int) -> str:
        p = self.procs[w]
        p.join(1.0)
        code = p.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name} (exit code {code})"
        return f"died (exit code {code})"

    def _kill(self, w: int) -> None:
        p = self.procs[w]
        with contextlib.suppress(OSError):
            p.kill()
        p.join(2.0)

    def _died(self, w: int, reason: str) -> PoolEvent:
        tasks, self.pending[w] = self.pending[w], []
        self.status[w] = "dead"
        self._release(w)
        return PoolEvent("death", w, tasks[0] if tasks else None, reason,
                         unstarted=tuple(tasks[1:]))

    def _release(self, w: int) -> None:
        """Free a gone worker's process, queue and pipe (never block on them)."""
        p = self.procs[w]
        if p.is_alive():
            self._kill(w)
        p.join(1.0)
        with contextlib.suppress(ValueError, OSError):
            self.tasks[w].cancel_join_thread()
            self.tasks[w].close()
        with contextlib.suppress(OSError):
            self.readers[w].close()
        self.ready_queue = [v for v in self.ready_queue if v != w]

    def _check_open(self) -> None:
        if self.closed:
            raise WorkerError("the worker pool is closed (a closed pool is never reused)")

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker: a sentinel each, their pipes drained so none blocks on a full
        one, joined; one still alive after ``timeout`` seconds is killed. Idempotent."""
        if self.closed:
            return
        self.closed = True
        gone = [w for w in range(self.n) if self.status[w] in _LIVE]
        for w in gone:
            with contextlib.suppress(ValueError, OSError):
                self.tasks[w].put(None)
        deadline = time.monotonic() + timeout
        while any(self.procs[w].is_alive() for w in gone) and time.monotonic() < deadline:
            conns = [self.readers[w] for w in gone if not self.readers[w].closed]
            for conn in mp_connection.wait(conns, timeout=0.05):
                with contextlib.suppress(EOFError, OSError):
                    conn.recv()
        for w in gone:
            self._release(w)
            self.status[w] = "retired"
        self.pending = [[] for _ in range(self.n)]
