"""The worker process's side of a :class:`~partialfl.runtime.pool.WorkerPool`: its loop
(:func:`work`: one task at a time, results on its own pipe, quits on None or when the process
that started it is gone) and how it detaches into a session of its own."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from dataclasses import replace

import numpy as np

from partialfl.runtime.slots import SlotReader, SlotWriter


def _detach(deathsig: bool = True) -> None:
    """Put this worker in a session of its own, bound to die with its parent.

    Why: Linux groups runnable processes by session (autogroup) and shares the CPUs fairly
    between the groups, so on a busy machine N workers in their parent's session share ONE
    group's slice while N processes in sessions of their own (as ``torchrun`` starts its
    ranks) get N slices: measured on a loaded 2-core machine, a FedAvg round's median went
    from 0.64 s to 0.41 s; on a quiet machine nothing changes. A worker outside the parent's
    process group no longer gets the terminal's signals (Ctrl-C reaches the parent, which
    closes the pool) nor a kill of the group, so on Linux it asks the kernel for SIGKILL
    when its parent dies (``PR_SET_PDEATHSIG``); elsewhere it still quits within a second of
    its parent when idle (see :func:`work`). The kernel sends that signal when the *thread*
    that started the worker ends: a pool started in another thread than the main one
    (``deathsig`` False) relies on the parent watcher (:func:`_die_with_parent`) alone, or
    its workers died with that thread while the pool still held them (round 29)."""
    with contextlib.suppress(OSError):
        os.setsid()
    if deathsig:
        kill_with_parent()


def kill_with_parent() -> None:
    """On Linux, ask the kernel to SIGKILL this process when the thread that started it ends
    (``PR_SET_PDEATHSIG``); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


GUARD = "partialfl.runtime.forkserver_guard"


_GUARDED: list[bool] = []  # whether the forkserver this process runs was started guarded


def guard_forkserver(ctx, on: bool = True) -> bool:
    """Before a forkserver starts: preload :mod:`partialfl.runtime.forkserver_guard` in it
    (``on``; else not), so it dies with this process and its workers with it. Only from the
    main thread: the kernel's death signal follows the thread that starts the forkserver.
    Returns whether a pool asking ``on`` gets workers that die with this process: False
    when a forkserver started without the guard (from another thread) is running — its
    preload cannot change (the pool then spawns its workers instead)."""
    from multiprocessing import forkserver

    fs = forkserver._forkserver
    if getattr(fs, "_forkserver_pid", None) is not None and _GUARDED:  # running
        return _GUARDED[-1] or not on
    mods = list(getattr(fs, "_preload_modules", None) or ["__main__"])
    want = [m for m in mods if m != GUARD] + ([GUARD] if on else [])
    if want != mods:
        ctx.set_forkserver_preload(want)
    _GUARDED.append(on)  # the preload the next forkserver start uses
    return True


def _parent_alive(parent: int) -> bool:
    """Whether the process that started this worker still runs. Not ``os.getppid()``: a
    worker started from the forkserver is the forkserver's child (an idle worker took that
    for its parent's death and quit after a second: its next client was counted failed);
    multiprocessing's parent sentinel names the process that asked for the worker."""
    p = mp.parent_process()
    if p is not None:
        return p.is_alive()
    return os.getppid() == parent


def _die_with_parent(parent: int) -> None:
    """End this worker the moment the process that started it ends, also in the middle of a
    client (a thread waiting on multiprocessing's parent sentinel). ``PR_SET_PDEATHSIG``
    alone names the *forkserver* for a worker started from it, which outlives a killed
    parent while its children run: such workers computed on for as long as their clients
    took (round 26). The watcher is a Python thread: a client inside one C call that holds
    the GIL throughout ends when that call returns (torch's kernels release it)."""
    import threading

    def watch() -> None:
        p = mp.parent_process()
        if p is not None:
            p.join()
        else:  # not started by multiprocessing: ask once a second
            while os.getppid() == parent:
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="partialfl-parent-watch", daemon=True).start()


def work(problem, algorithm, tasks, out, parent: int, own_session: bool = True,
         deathsig: bool = True) -> None:
    """A worker's loop (see the module docstring): quits on None or when the parent is gone
    (``deathsig``: started from the parent's main thread, see :func:`_detach`)."""
    if own_session:
        _detach(deathsig)
    _die_with_parent(parent)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    theta = None
    inbox, outbox = SlotReader(), SlotWriter()
    out.send(("ready",))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if not _parent_alive(parent):
                return
            continue
        if task is None:
            return
        tid, client, packed, seconds, new_theta = task
        start = time.perf_counter()
        try:
            state, ctx, cs = inbox.unpack(packed)
            if new_theta is not None:
                theta = new_theta if isinstance(new_theta, dict) else theta
                state = replace(state, theta=theta)
            res = algorithm.client_update(state, problem, np.asarray([client]), ctx, cs)
            busy = time.perf_counter() - start
            if seconds > busy:
                time.sleep(seconds - busy)
            out.send(("ok", tid, outbox.pack(res), busy))
        except Exception as e:  # report it: the client is skipped, the worker lives on
            out.send(("error", tid, traceback.format_exc(), _portable(e)))


def _portable(e: BaseException) -> BaseException | None:
    """``e`` if it survives pickling (so the parent can tell what it was), else None."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - an exception that does not travel: its text does
        return None
    return e
