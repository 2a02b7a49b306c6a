"""One simulated federation (2 SuperNodes, least squares) running every Flower run the trust
tests need (faults, privacy, security, checkpoint/resume) — one Ray start-up for all of them.
Import ``flower_runs`` into a test module to use it (session scope: computed once)."""

from __future__ import annotations

import time

import pytest

SMALL = {"ls-clients": 8, "ls-n": 200, "ls-d-theta": 10, "ls-d-w": 5, "local-steps": 5,
         "seed": 3, "eval-every": 0}
ASYNC_1 = {**SMALL, "mode": "async", "buffer-size": 1, "concurrency": 1, "num-rounds": 6,
           "server-lr": 0.05}
ASYNC_2 = {**ASYNC_1, "concurrency": 2}
RUNS = {
    # a client sends NaN weights in round 1: refused, counted, skipped; evaluation on
    "nan": {**SMALL, "num-rounds": 3, "eval-every": 1,
            "fault-injection": "nan:partition=1,round=1"},
    # reference for resume: 4 rounds, uninterrupted
    "full": {**SMALL, "num-rounds": 4, "server-opt": "adam", "server-lr": 0.05},
    # the same, checkpointed every round and stopped (as if killed) after round 1 ...
    "interrupted": {**SMALL, "num-rounds": 4, "server-opt": "adam", "server-lr": 0.05,
                    "checkpoint-every": 1, "fault-injection": "stop:round=1"},
    # ... and resumed from its checkpoint
    "resumed": {**SMALL, "num-rounds": 4, "server-opt": "adam", "server-lr": 0.05,
                "resume": True, "checkpoint-every": 1},
    # asynchronous mode, one task in flight (sequential, so deterministic): uninterrupted,
    # checkpointed every server step and stopped after step 3, resumed
    "async-full": ASYNC_1,
    "async-interrupted": {**ASYNC_1, "checkpoint-every": 1, "fault-injection": "stop:round=2"},
    "async-resumed": {**ASYNC_1, "checkpoint-every": 1, "resume": True},
    # two tasks in flight: one is in flight at the checkpoint and is sent again on resume
    "async2-interrupted": {**ASYNC_2, "checkpoint-every": 1, "fault-injection": "stop:round=2"},
    "async2-resumed": {**ASYNC_2, "checkpoint-every": 1, "resume": True},
    # resuming with no checkpoint in out-dir is refused
    "async-missing": {**ASYNC_1, "resume": True},
    # SuperNode of partition 1 lost from round 1 on, tolerated (50% <= 0.6)
    "lost": {**SMALL, "num-rounds": 3, "max-failure-fraction": 0.6,
             "fault-injection": "crash:partition=1,round=1; crash:partition=1,round=2"},
    # the same loss with a 30% failure budget: the run aborts with a reason
    "abort": {**SMALL, "num-rounds": 3, "max-failure-fraction": 0.3,
              "fault-injection": "crash:partition=1,round=1; crash:partition=1,round=2"},
}


@pytest.fixture(scope="session")
def flower_runs(tmp_path_factory):
    """``{name: (run_config, report or exception, received messages)}`` for :data:`RUNS`."""
    pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")
    ray = pytest.importorskip("ray", reason="Flower's simulation engine needs "
                              "'flwr[simulation]' (ray)")
    from partialfl.flower.simulation import run_simulations

    base = tmp_path_factory.mktemp("flower_trust")
    runs = {k: dict(v) for k, v in RUNS.items()}
    for k in ("full", "lost", "abort"):
        runs[k]["out-dir"] = str(base / k)
    for k in ("", "async-", "async2-"):
        runs[f"{k}interrupted"]["out-dir"] = runs[f"{k}resumed"]["out-dir"] = \
            str(base / f"{k}resume")
    for k in ("async-full", "async-missing"):
        runs[k]["out-dir"] = str(base / k)
    received = {k: [] for k in runs}
    t0 = time.perf_counter()
    reports = run_simulations(list(runs.values()), num_supernodes=2, num_cpus=2,
                              message_hooks=[received[k].append for k in runs],
                              raise_errors=False)
    out = {k: (runs[k], rep, received[k]) for k, rep in zip(runs, reports)}
    out["seconds"] = time.perf_counter() - t0
    yield out
    if ray.is_initialized():
        ray.shutdown()
