"""Running many jobs (a reproduction table's pipelines) in worker processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_jobs(fn: Callable[[Any], Any], jobs: list, workers: int,
             progress: bool | str = False) -> list:
    """``[fn(job) for job in jobs]``, in this process (``workers`` ≤ 1, in order) or in
    ``workers`` spawned processes (completion order; ``fn`` and the jobs must pickle, so a
    worker rebuilds its task from the job). A reproduction table runs its (method, seed)
    pipelines this way: on a 2-core machine two 1-thread processes beat one 2-thread process
    and degrade gracefully when something else competes for the cores. ``progress``: a
    label for a progress bar over finished jobs."""
    if workers <= 1:
        return [fn(j) for j in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    out = []
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(fn, j) for j in jobs]
        it = as_completed(futs)
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=len(futs), desc=progress if isinstance(progress, str)
                      else "runs")
        for f in it:
            out.append(f.result())
    return out


__all__ = ["run_jobs"]
