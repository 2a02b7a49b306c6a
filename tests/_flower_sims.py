"""Flower test helpers: run configs of small least-squares specs (:func:`ls_run`), the
in-process reference of a run config (:func:`in_process`), and one simulated federation
(2 SuperNodes, least squares) running every Flower run the trust tests need (faults, privacy,
security, checkpoint/resume) — one Ray start-up for all of them. Import ``flower_runs`` into a
test module to use it (session scope: computed once)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings

import pytest

from partialfl.config import deep_merge


def quiet(fn, *a):
    """``fn(*a)`` with warnings and log records below ERROR silenced (a hostile run's
    expected noise)."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*a)
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def importable(folder, **modules: str):
    """Each ``name=source`` written as ``folder/name.py``, importable inside the block (a
    researcher's plugin modules)."""
    for name, text in modules.items():
        (folder / f"{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


#: the paper's Example 1 at a tiny size: FFGG with 5 conjugate-gradient steps, w from zero
LS_SPEC = {"seed": 3, "problem": {"name": "least-squares", "num_clients": 8, "n": 200,
                                  "d_theta": 10, "d_w": 5, "seed": 3},
           "method": {"algorithm": "ffgg", "w_init": "zero"},
           "personalize": {"client": {"name": "cg", "tau": 5}}}


def ls_spec(rounds: int = 3, k: int | None = None, eval_every: int = 0, **over) -> dict:
    """:data:`LS_SPEC` with ``rounds``, ``k`` clients per round, ``eval_every`` and the
    tables ``over`` merged in (``personalize={...}`` merges into the stage)."""
    stage = {"rounds": rounds, "clients_per_round": k, "eval_every": eval_every}
    return deep_merge(LS_SPEC, deep_merge({"personalize": stage}, over))


def ls_run(rounds: int = 3, k: int | None = None, eval_every: int = 0, spec=None,
           **flower) -> dict:
    """A run config: the spec of :func:`ls_spec` (``spec``: more spec tables) and Flower's
    own keys ``flower`` (snake or kebab case)."""
    return {"spec": ls_spec(rounds, k, eval_every, **(spec or {})),
            **{key.replace("_", "-"): v for key, v in flower.items()}}


def in_process(run_config: dict, **kw):
    """``(built run, RunResult)`` of the run config's spec in process
    (:func:`partialfl.pipeline.closed_form.run_closed_form`: what `partialfl run` runs)."""
    from partialfl.build import build
    from partialfl.flower.config import parse_run_config
    from partialfl.pipeline.closed_form import run_closed_form

    spec = parse_run_config({k: v for k, v in run_config.items() if k in ("spec", "set")}).run
    built = build(spec)
    return built, run_closed_form(spec, built=built, **kw)


SMALL = {"eval_every": 0}
ASYNC_1 = {"rounds": 6, "spec": {"asynchronous": {"rule": "fedasync", "concurrency": 1},
                                 "personalize": {"server": {"lr": 0.05}}}}
ASYNC_2 = deep_merge(ASYNC_1, {"spec": {"asynchronous": {"concurrency": 2}}})
ADAM = {"spec": {"personalize": {"server": {"optimizer": "adam", "lr": 0.05}}}}
RUNS = {
    # a client sends NaN weights in round 1: refused, counted, skipped; evaluation on
    "nan": ls_run(3, eval_every=1, fault_injection="nan:partition=1,round=1"),
    # reference for resume: 4 rounds, uninterrupted
    "full": ls_run(4, **ADAM),
    # the same, checkpointed every round and stopped (as if killed) after round 1 ...
    "interrupted": ls_run(4, **ADAM, checkpoint_every=1, fault_injection="stop:round=1"),
    # ... and resumed from its checkpoint
    "resumed": ls_run(4, **ADAM, resume=True, checkpoint_every=1),
    # asynchronous mode, one task in flight (sequential, so deterministic): uninterrupted,
    # checkpointed every server step and stopped after step 3, resumed
    "async-full": ls_run(**ASYNC_1),
    "async-interrupted": ls_run(**ASYNC_1, checkpoint_every=1, fault_injection="stop:round=2"),
    "async-resumed": ls_run(**ASYNC_1, checkpoint_every=1, resume=True),
    # two tasks in flight: one is in flight at the checkpoint and is sent again on resume
    "async2-interrupted": ls_run(**ASYNC_2, checkpoint_every=1,
                                 fault_injection="stop:round=2"),
    "async2-resumed": ls_run(**ASYNC_2, checkpoint_every=1, resume=True),
    # resuming with no checkpoint in out-dir is refused
    "async-missing": ls_run(**ASYNC_1, resume=True),
    # SuperNode of partition 1 lost from round 1 on, tolerated (50% <= 0.6)
    "lost": ls_run(3, spec={"max_failure_fraction": 0.6},
                   fault_injection="crash:partition=1,round=1; crash:partition=1,round=2"),
    # the same loss with a 30% failure budget: the run aborts with a reason
    "abort": ls_run(3, spec={"max_failure_fraction": 0.3},
                    fault_injection="crash:partition=1,round=1; crash:partition=1,round=2"),
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
