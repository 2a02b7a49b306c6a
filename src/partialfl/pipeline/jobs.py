"""Running many pipelines: a reproduction table's (method, seed) jobs in worker processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialfl.pipeline.files import write_json
from partialfl.pipeline.report import jsonable


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


@dataclass
class TableRuns:
    """The (method, seed) runs of a table: ``results[label]`` = one metrics dict per seed (in
    seed order), ``timings["seed{s}/{label}"]`` = seconds of that run, ``seconds`` = the whole
    table's wall-clock time since ``t_start``."""

    results: dict[str, list[dict]]
    timings: dict[str, float]
    seconds: float


def run_table(run_one: Callable[[tuple], tuple[str, int, dict, float]],
              methods: Sequence[tuple[str, Any]], seeds: Sequence[int], job_args: tuple,
              workers: int, out_dir: Path, t_start: float, progress: bool | str = False
              ) -> TableRuns:
    """Run every (seed, method) job of a reproduction table with :func:`run_jobs` and collect
    the results; writes ``out_dir/results.json``. A job is ``(*job_args, seed, method index,
    progress)`` and ``run_one(job)`` returns ``(label, seed, metrics, seconds)``."""
    jobs = [(*job_args, seed, i, bool(progress) and workers <= 1)
            for seed in seeds for i in range(len(methods))]
    done = run_jobs(run_one, jobs, workers, progress)
    results: dict[str, list[dict]] = {label: [] for label, _ in methods}
    timings: dict[str, float] = {}
    for label, seed, m, sec in sorted(done, key=lambda t: t[1]):
        results[label].append(m)
        timings[f"seed{seed}/{label}"] = sec
    seconds = time.perf_counter() - t_start
    write_json(Path(out_dir) / "results.json", jsonable(
        {"results": results, "timings": timings, "total_seconds": seconds}))
    return TableRuns(results, timings, seconds)


__all__ = ["TableRuns", "run_jobs", "run_table"]
