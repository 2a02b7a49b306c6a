"""Runtimes: who calls the algorithm's client and server functions, and when.

A run is one value, :class:`Run` (:mod:`partialfl.runtime.run`): the problem, the algorithm,
a schedule (:class:`Rounds` or :class:`Arrivals`), the executor, the evaluation and the
checkpointing; :func:`execute` runs it in the synchronous loop (:func:`run_sync`) or the
asynchronous one (:func:`~partialfl.runtime.asynchronous.run_arrivals`).
"""

from partialfl.runtime.asynchronous import AsyncRunResult, run_arrivals
from partialfl.runtime.backends import BatchedBackend, SequentialBackend
from partialfl.runtime.logging import JsonlLogger, read_jsonl
from partialfl.runtime.run import Arrivals, Checkpointing, Evaluation, Rounds, Run
from partialfl.runtime.sync import RunResult, run_rounds, run_sync, sample_cohort


def execute(run: Run) -> RunResult | AsyncRunResult:
    """Run ``run`` in the loop its schedule names: :func:`run_sync` for :class:`Rounds`,
    :func:`run_arrivals` for :class:`Arrivals`."""
    return run_sync(run) if isinstance(run.schedule, Rounds) else run_arrivals(run)


__all__ = [
    "Arrivals",
    "AsyncRunResult",
    "BatchedBackend",
    "Checkpointing",
    "Evaluation",
    "JsonlLogger",
    "Rounds",
    "Run",
    "RunResult",
    "SequentialBackend",
    "execute",
    "read_jsonl",
    "run_arrivals",
    "run_rounds",
    "run_sync",
    "sample_cohort",
]
