"""Synchronous rounds with client sampling (the loop of Algorithms 1, 4, 5 and baselines).

Round r: sample a cohort C_r (uniformly without replacement, from generator(seed, "sample",
r); all clients in order under full participation), run the clients' updates on a backend,
apply the server update; every ``eval_every`` rounds evaluate and log. Client state of
stateful baselines is held here, on the client side. Runs can checkpoint and resume exactly:
all randomness is derived from (seed, round, client), never from a running generator.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import rng as prng
from partialfl.algorithms.base import Algorithm, RoundContext, ServerState
from partialfl.runtime.backends import BatchedBackend
from partialfl.types import Params

Evaluator = Callable[[Algorithm, ServerState, Any, "Params | None", RoundContext], dict]


def sample_cohort(seed: int, round_: int, num_clients: int, k: int | None) -> np.ndarray:
    """The clients of round ``round_``: all (k None or = M) or k drawn without replacement."""
    if k is None or k == num_clients:
        return np.arange(num_clients)
    if not isinstance(k, int | np.integer) or not 1 <= k <= num_clients:
        raise ValueError(f"clients_per_round must be in [1, {num_clients}], got {k!r}")
    return np.sort(prng.generator(seed, "sample", round_).choice(num_clients, k, replace=False))


@dataclass
class RunResult:
    """What :func:`run_rounds` returns: the final server state, the client states (stateful
    algorithms), the metric records of every evaluation and the wall-clock seconds."""

    state: ServerState
    client_state: Params | None
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    stopped: bool = False  # True: ``stop(history)`` ended the run before ``rounds``


def run_rounds(
    problem,
    algorithm: Algorithm,
    rounds: int,
    *,
    clients_per_round: int | None = None,
    seed: int = 0,
    theta0: Params | None = None,
    backend=None,
    evaluate: Evaluator | None = None,
    eval_every: int = 1,
    logger=None,
    progress: bool | str = False,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    on_round: Callable[[int, ServerState], None] | None = None,
    stop: Callable[[list[dict]], bool] | None = None,
) -> RunResult:
    """Run ``rounds`` synchronous rounds; returns the final server state and metric history.

    ``evaluate(algorithm, state, problem, client_state, ctx)`` returns a dict that is logged
    at round 0 (before training) and after every ``eval_every``-th round and the last.
    ``stop(history)``, asked after every evaluation (and on resume), ends the run early when
    it returns True (e.g. :func:`partialfl.experiments.stopping.plateaued`); a function of the
    logged history only, so a resumed run stops at the same round.
    """
    if not isinstance(rounds, int | np.integer) or rounds < 0:
        raise ValueError(f"rounds must be a non-negative integer, got {rounds!r}")
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    M = problem.num_clients
    if clients_per_round is not None:
        sample_cohort(seed, 0, M, clients_per_round)  # validate early
    backend = backend or BatchedBackend()
    ckpt = Path(checkpoint) if checkpoint else None

    if resume and ckpt is not None and ckpt.exists():
        with open(ckpt, "rb") as f:
            saved = pickle.load(f)
        state, client_state, history = saved["state"], saved["client_state"], saved["history"]
        if logger is not None:
            for rec in history:
                logger.log(rec)
    else:
        theta0 = theta0 if theta0 is not None else problem.init_theta(prng.generator(seed, "init"))
        state = algorithm.init(problem, theta0)
        client_state = algorithm.init_client_state(problem)
        history = []
    grad_evals = history[-1]["local_grads"] if history else 0

    def _eval(st: ServerState, elapsed: float) -> None:
        rec: dict[str, Any] = {"round": st.round, "local_grads": grad_evals, "time": elapsed}
        if evaluate is not None:
            rec.update(evaluate(algorithm, st, problem, client_state,
                                RoundContext(seed, st.round)))
        history.append(rec)
        if logger is not None:
            logger.log(rec)

    t0 = time.perf_counter()
    if not history:
        _eval(state, 0.0)
    stopped = stop is not None and bool(stop(history))
    it = range(state.round, rounds) if not stopped else range(0)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=progress if isinstance(progress, str) else algorithm.name,
                  initial=state.round, total=rounds, mininterval=0.5, leave=False)
    for r in it:
        ctx = RoundContext(seed, r)
        cohort = sample_cohort(seed, r, M, clients_per_round)
        cs = None if client_state is None else {n: v[cohort] for n, v in client_state.items()}
        result = backend.run(algorithm, state, problem, cohort, ctx, cs)
        if result.client_state is not None and client_state is not None:
            for n, v in result.client_state.items():
                client_state[n][cohort] = v
        state = algorithm.server_update(state, result.updates, ctx)
        grad_evals += result.updates.grad_evals
        if on_round is not None:
            on_round(r, state)
        if state.round % eval_every == 0 or state.round == rounds:
            _eval(state, time.perf_counter() - t0)
            stopped = stop is not None and bool(stop(history))
        if ckpt is not None and checkpoint_every and (
            state.round % checkpoint_every == 0 or state.round == rounds or stopped
        ):
            save_checkpoint(ckpt, state, client_state, history)
        if stopped:
            break
    return RunResult(state, client_state, history, time.perf_counter() - t0, stopped)


def save_checkpoint(path: Path, state, client_state, history) -> None:
    """Atomic write: a crash mid-write never leaves a truncated checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"state": state, "client_state": client_state, "history": history}, f)
    os.replace(tmp, path)
