"""Runtimes: who calls the algorithm's client and server functions, and when."""

from partialfl.runtime.backends import BatchedBackend, SequentialBackend
from partialfl.runtime.logging import JsonlLogger, read_jsonl
from partialfl.runtime.sync import RunResult, run_rounds, sample_cohort

__all__ = [
    "BatchedBackend",
    "JsonlLogger",
    "RunResult",
    "SequentialBackend",
    "read_jsonl",
    "run_rounds",
    "sample_cohort",
]
