"""Running many jobs (a reproduction table's pipelines) in worker processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_jobs(fn: Callable[[Any], Any], jobs: list, workers: int,
             progress: bool | str = False, *, start_method: str = "spawn",
             ordered: bool = False, setup: Callable[[], None] | None = None) -> list:
    """``[fn(job) for job in jobs]``, in this process (``workers`` ≤ 1, in order) or in
    ``workers`` worker processes (``start_method``; completion order unless ``ordered``;
    ``fn`` and the jobs must pickle, so a worker rebuilds its task from the job). A
    reproduction table runs its (method, seed) pipelines this way: on a 2-core machine two
    1-thread processes beat one 2-thread process and degrade gracefully when something else
    competes for the cores. ``progress``: a label for a progress bar over finished jobs;
    ``setup``: called in each worker when it starts.

    The workers end with this process (killed or not) and ignore Ctrl-C, which ends the
    call here (the workers are stopped, KeyboardInterrupt raised); a worker that dies ends it
    with :class:`JobsFailed` (one line on the command line)."""
    if workers <= 1:
        return [fn(j) for j in jobs]
    import multiprocessing as mp
    import os
    import threading
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    out: list = [None] * len(jobs) if ordered else []
    main = threading.current_thread() is threading.main_thread()
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context(start_method),
                             initializer=_bound_to_parent, initargs=(os.getpid(), main, setup))
    try:
        futs = {ex.submit(fn, j): i for i, j in enumerate(jobs)}
        it = as_completed(futs)
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=len(futs), desc=progress if isinstance(progress, str)
                      else "runs")
        for n, f in enumerate(it):
            try:
                r = f.result()
            except BrokenProcessPool:
                raise JobsFailed(f"a worker process died (killed, or out of memory) while "
                                 f"{len(jobs) - n} of {len(jobs)} jobs were unfinished "
                                 f"(job {futs[f]} among them); the finished ones are kept: "
                                 "run the same command again to finish the rest") from None
            if ordered:
                out[futs[f]] = r
            else:
                out.append(r)
    except BaseException:  # an interrupt or a failed job: stop the others now (killed
        # before the shutdown, which forgets the processes)
        for p in list((getattr(ex, "_processes", None) or {}).values()):
            p.kill()
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown()
    return out


class JobsFailed(RuntimeError):
    """A worker process of :func:`run_jobs` died; the command line prints it in one line."""


def _bound_to_parent(parent: int, deathsig: bool, setup: Callable[[], None] | None) -> None:
    """A job worker's initializer: it ends with the process that started it (a killed study
    left its workers training its run folders, and a resumed study wrote the same folders
    beside them): the parent watcher of the client pools and, on Linux when the pool was
    started from the main thread, the kernel's death signal; it ignores Ctrl-C (the parent
    stops it); then ``setup``."""
    import signal

    from partialfl.runtime.worker import _die_with_parent, kill_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if deathsig:
        kill_with_parent()
    _die_with_parent(parent)
    if setup is not None:
        setup()


__all__ = ["JobsFailed", "run_jobs"]
