"""Synchronous rounds with client sampling (the loop of Algorithms 1, 4, 5 and baselines).

Round r: sample a cohort C_r (uniformly without replacement, from generator(seed, "sample",
r); all clients in order under full participation), run the clients' updates under the run's
executor (its mode maps the cohort; its kernel mode reaches the clients' computations in
``RoundContext.mode``), apply the server update; every ``eval_every`` rounds evaluate and
log. The loop takes a :class:`~partialfl.runtime.run.Run` (:func:`run_sync`);
:func:`run_rounds` is its keyword form. Hooks an algorithm
may have (the DP wrapper, :mod:`partialfl.algorithms.dp`): ``sample_cohort(seed, r, M, k)``
draws its own cohorts, ``server_update_empty(state, ctx)`` is its step for a round in which
no update arrived, ``round_metrics(state)`` adds entries to every record. Client state of
stateful baselines is held here, on the client side. Runs can checkpoint and resume exactly:
all randomness is derived from (seed, round, client), never from a running generator.

Trust (see :mod:`partialfl.runtime.faults` and :mod:`partialfl.io`): every cohort's result
goes through the message path :func:`~partialfl.runtime.faults.receive` (privacy check,
non-finite updates skipped); a client that raises is skipped (the cohort is re-run one
client at a time to isolate it), unless it raised a data error (a corrupt client store),
which stops the run; the run aborts only past ``max_failure_fraction``.
Checkpoints are safetensors + JSON (never pickle), validated on resume against the run's
fingerprint (problem, algorithm, seed, cohort size); with ``private_checkpoints`` (default)
the clients' state (e.g. FedAlt's w_m, Scaffold's c_m) goes to a separate file labelled
``.client-side`` and never into the server's checkpoint.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from partialfl import rng as prng
from partialfl.aggregation.common import ZeroWeightsError
from partialfl.aggregation.protection import (
    UnprotectedError,
    UnprotectedWarning,
    cohort_checked,
    tolerated,
)
from partialfl.algorithms.base import (
    UNPROTECTED,
    Algorithm,
    RoundContext,
    ServerState,
    concat_results,
    skipped_step,
)
from partialfl.batching import Executor
from partialfl.runtime.checkpoint import (  # noqa: F401 - ResumeError: part of this API
    Checkpoint,
    ResumeError,
    check_fingerprint,
    run_fingerprint,
)
from partialfl.runtime.clients import MalformedResult, odd_results, run_clients
from partialfl.runtime.cohort_pool import ClientsFailed, WorkerError
from partialfl.runtime.faults import FaultLog, check_end, receive
from partialfl.runtime.logging import base_record, train_record
from partialfl.runtime.resume_check import CheckpointError, check_sync
from partialfl.runtime.run import Checkpointing, Evaluation, Evaluator, Rounds, Run
from partialfl.sampling import sample_cohort
from partialfl.types import Params

__all__ = ["Checkpointer", "Evaluator", "FileCheckpoint", "InProcess", "ResumeError",
           "RunResult", "SyncTransport", "check_fingerprint", "run_rounds", "run_sync",
           "sample_cohort"]


@dataclass
class RunResult:
    """What :func:`run_rounds` returns: the final server state, the client states (stateful
    algorithms), the metric records of every evaluation and the wall-clock seconds."""

    state: ServerState
    client_state: Params | None
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    faults: FaultLog | None = None
    stopped: bool = False  # True: ``stop(history)`` (or divergence) ended the run early
    diverged: str = ""  # why θ became non-finite after a server step (the run stopped there)


@runtime_checkable
class SyncTransport(Protocol):
    """How a round's cohort reaches its clients and their results come back: in this process
    or worker processes (:class:`InProcess`), or over a network (the Flower ServerApp's
    transport). Returns the cohort's :class:`ClientResult` (None if nothing usable arrived)
    and the cohort positions it holds; lost clients are counted by the transport."""

    def run_round(self, algorithm, state: ServerState, problem, cohort: np.ndarray,
                  ctx: RoundContext, client_state: Params | None, faults: FaultLog
                  ) -> tuple[Any, np.ndarray]: ...


class InProcess:
    """The cohort run here under a batching mode (vmap, loop, worker processes: see
    :func:`partialfl.batching.map_clients`). Failing clients are skipped and counted: a
    worker pool reports exactly which ones failed (:class:`ClientsFailed`); under another
    mode a cohort that raises is re-run one client at a time to isolate them."""

    def __init__(self, mode) -> None:
        self.mode = mode

    def run_round(self, algorithm, state, problem, cohort, ctx, client_state, faults):
        """The cohort's ClientResult (None if nobody succeeded) and the positions it holds."""
        mode, cs = self.mode, client_state
        try:
            res = run_clients(algorithm, state, problem, cohort, ctx, cs, mode)
            return res, np.arange(len(cohort))
        except ClientsFailed as e:
            return _survivors(e, cohort, ctx, faults)
        except Exception as e:  # noqa: BLE001 - isolate the failing client(s)
            if len(cohort) == 1:
                faults.client_error(f"client {int(cohort[0])} in round {ctx.round}", e)
                faults.raise_if_systematic(1)
                return None, np.arange(0)
        out, pos = [], []
        for i, m in enumerate(cohort):
            one = None if cs is None else {n: v[i:i + 1] for n, v in cs.items()}
            try:
                out.append(run_clients(algorithm, state, problem, cohort[i:i + 1], ctx, one,
                                       mode))
                pos.append(i)
            except Exception as e:  # noqa: BLE001
                faults.client_error(f"client {int(m)} in round {ctx.round}", e)
        out, pos = _agreeing(out, pos, cohort, ctx, faults)
        if not out:
            faults.raise_if_systematic(len(cohort))
        return (concat_results(out) if out else None), np.asarray(pos, dtype=np.int64)


def _agreeing(out: list, pos: list, cohort, ctx, faults: FaultLog) -> tuple[list, list]:
    """The one-client results that agree in structure with most others (the odd ones
    counted as failed clients: :func:`partialfl.runtime.clients.odd_results`)."""
    odd = odd_results(out) if len(out) > 1 else {}
    for j, why in odd.items():
        faults.client_error(f"client {int(cohort[pos[j]])} in round {ctx.round}",
                            MalformedResult(why))
    keep = [j for j in range(len(out)) if j not in odd]
    return [out[j] for j in keep], [pos[j] for j in keep]


def _survivors(e: ClientsFailed, cohort, ctx, faults: FaultLog):
    """The clients a worker pool ran successfully; the failed ones counted (a raising
    client's traceback kept as its error, so a bug in every client is re-raised)."""
    for i, (kind, why) in sorted(e.failures.items()):
        where = f"client {int(cohort[i])} in round {ctx.round}"
        if kind == "death":
            faults.worker_death(where, why)
        else:
            faults.client_error(where, e.errors.get(i) or
                                WorkerError(f"{where} failed in a worker:\n{why}"))
    out, kept = _agreeing([r for r in e.results if r is not None],
                          [i for i, r in enumerate(e.results) if r is not None], cohort, ctx,
                          faults)
    pos = np.asarray(kept, dtype=np.int64)
    if len(pos) == 0:
        faults.raise_if_systematic(len(cohort))
        return None, pos
    return concat_results(out), pos


@runtime_checkable
class Checkpointer(Protocol):
    """Where a run's state is saved and resumed from (:class:`FileCheckpoint`, or a Flower
    ServerApp's out-dir checkpoint). ``load`` returns ``(state, client_state, history,
    grad_evals, fault counters)``, or None when there is nothing to resume."""

    def save(self, state: ServerState, client_state: Params | None, history: list[dict],
             grad_evals: int, faults: dict) -> None: ...

    def load(self) -> tuple | None: ...


class FileCheckpoint:
    """The synchronous loop's state in a :class:`~partialfl.runtime.checkpoint.Checkpoint`
    at ``path`` (crash-consistent generations, validated against the run's ``fingerprint``);
    with ``private`` the client state goes to the client-side file. Tensors are loaded onto
    ``device`` (None: where they were, if this machine has it, else the CPU). ``extra``: the
    transport's own bookkeeping, saved with its ``state()`` and given back to its
    ``restore(saved)`` on load (the Flower ServerApp's report), as in
    :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`."""

    def __init__(self, path: str | Path, fingerprint: dict | None, private: bool = True,
                 device=None, extra=None) -> None:
        self.codec = Checkpoint(path, fingerprint, kind="sync", private=private)
        self.path, self.device, self.extra = self.codec.path, device, extra

    def __str__(self) -> str:
        return str(self.path)

    def save(self, state, client_state, history, grad_evals, faults) -> None:
        """Commit the run state as a new generation."""
        self.codec.save({"state": state, "history": history, "grad_evals": int(grad_evals),
                         "faults": faults}, client_state,
                        extra=None if self.extra is None else self.extra.state(),
                        progress={"round": state.round})

    def load(self):
        """The saved run state, or None if there is no checkpoint yet."""
        saved = self.codec.load(self.device)
        if saved is None:
            return None
        s = saved.server
        if not isinstance(s, dict) or not {"state", "history", "grad_evals"} <= set(s):
            raise CheckpointError(f"checkpoint {self.path}: the server file is not a partialfl "
                                  "run state")
        if self.extra is not None:
            self.extra.restore(saved.extra or {})
        return s["state"], saved.client, s["history"], s["grad_evals"], s.get("faults", {})


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
    train_logger=None,
    progress: bool | str = False,
    checkpoint: str | Path | Checkpointer | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    on_round: Callable[[int, ServerState], None] | None = None,
    max_failure_fraction: float = 0.5,
    private_checkpoints: bool = True,
    fingerprint: dict | None = None,
    stop: Callable[[list[dict]], bool] | None = None,
) -> RunResult:
    """:func:`run_sync` of the :class:`~partialfl.runtime.run.Run` these keywords describe
    (the keyword form, kept for its callers): ``backend`` is the executor's mode (a batching
    mode or a :class:`SyncTransport`; None: the problem's own mode), on the problem's device;
    ``evaluate``, ``eval_every``, ``logger``, ``progress``, ``train_logger`` make the
    :class:`~partialfl.runtime.run.Evaluation`; ``checkpoint`` (a path or a
    :class:`Checkpointer`), ``checkpoint_every``, ``resume``, ``private_checkpoints``,
    ``fingerprint`` the :class:`~partialfl.runtime.run.Checkpointing`; ``clients_per_round``,
    ``stop``, ``on_round`` the :class:`~partialfl.runtime.run.Rounds`."""
    ck = None if checkpoint is None else Checkpointing(
        checkpoint, checkpoint_every, resume, private_checkpoints, fingerprint)
    return run_sync(Run(problem, algorithm, Rounds(rounds, clients_per_round, stop, on_round),
                        seed=seed, theta0=theta0, executor=Executor.of(problem, backend),
                        evaluation=Evaluation(evaluate, eval_every, logger, progress,
                                              train_logger),
                        checkpoint=ck, max_failure_fraction=max_failure_fraction))


def _checkpointer(run: Run) -> Checkpointer | None:
    """The run's checkpointer: its own object, or a :class:`FileCheckpoint` at its path
    (checked against the run's fingerprint)."""
    c = run.checkpoint
    if c is None or isinstance(c.to, Checkpointer):
        return None if c is None else c.to
    fp = run_fingerprint(run.problem, run.algorithm, run.seed, run.schedule.clients_per_round,
                         c.fingerprint)
    return FileCheckpoint(c.to, fp, c.private, run.checkpoint_device)


def run_sync(run: Run) -> RunResult:
    """Run ``run.schedule.rounds`` synchronous rounds (see the module docstring); returns the
    final server state, the client state and the metric history.

    ``run.evaluation.fn(algorithm, state, problem, client_state, ctx)`` returns a dict that
    is logged at round 0 (before training) and after every ``every``-th round and the last
    (with the common keys of :func:`~partialfl.runtime.logging.base_record`).
    ``run.schedule.stop(history)``, asked after every evaluation (and on resume), ends the
    run early when it returns True (e.g. :func:`partialfl.pipeline.stopping.plateaued`).
    ``run.executor.mode``: a batching mode (the cohort run here, :class:`InProcess`) or a
    :class:`SyncTransport`.
    """
    if not isinstance(run.schedule, Rounds):
        raise TypeError(f"run_sync runs Rounds(...), not {type(run.schedule).__name__}")
    problem, algorithm, seed = run.problem, run.algorithm, run.seed
    sched, ev = run.schedule, run.evaluation
    rounds, k = sched.rounds, sched.clients_per_round
    M = problem.num_clients
    # hooks of algorithms that sample their own cohorts and release a step every round (DP)
    sample = getattr(algorithm, "sample_cohort", sample_cohort)
    skip = getattr(algorithm, "server_update_empty", None)
    if rounds:
        sample(seed, 0, M, k)  # validate early (a 0-round run samples nothing)
    mode = run.executor.mode
    transport = mode if isinstance(mode, SyncTransport) else InProcess(mode)
    getattr(mode, "new_run", lambda: None)()  # a reused worker pool checks its problem copy
    faults = FaultLog(run.max_failure_fraction)
    ckpt = _checkpointer(run)
    every = 0 if run.checkpoint is None else run.checkpoint.every
    resume = run.checkpoint is not None and run.checkpoint.resume
    loaded = ckpt.load() if resume and ckpt is not None else None
    theta0 = (run.theta0 if run.theta0 is not None
              else problem.init_theta(prng.generator(seed, "init")))
    state = algorithm.init(problem, theta0)
    client_state = algorithm.init_client_state(problem)
    history, grad_evals = [], 0
    if loaded is not None:  # this run's kind of state (a fresh one's shapes), or one line
        check_sync(loaded, state, client_state, rounds, ckpt,
                   fixed=getattr(algorithm, "fixed_extra", ()))
        state, client_state, history, grad_evals, saved_faults = loaded
        faults.restore(saved_faults)
        if ev.logger is not None:
            for rec in history:
                ev.logger.log(rec)

    def _eval(st: ServerState, elapsed: float) -> None:
        rec = base_record(st.round, st.round, elapsed, grad_evals, faults.record())
        if ev.fn is not None:
            rec.update(ev.fn(algorithm, st, problem, client_state, run.context(st.round)))
        if hasattr(algorithm, "round_metrics"):  # e.g. DP's ε spent so far
            rec.update(algorithm.round_metrics(st))
        if st.extra.get(UNPROTECTED):  # steps skipped for want of protection
            rec[UNPROTECTED] = int(st.extra[UNPROTECTED])
        history.append(rec)
        if ev.logger is not None:
            ev.logger.log(rec)
        if bar is not None:  # round and ETA are the bar's own; show the last metric too
            bar.set_postfix(_postfix(rec))  # redrawn now: evaluations are rare

    t0 = time.perf_counter()
    it = range(state.round, rounds)
    bar = None
    if ev.progress:
        from tqdm.auto import tqdm

        it = bar = tqdm(it, desc=ev.progress if isinstance(ev.progress, str) else algorithm.name,
                        initial=state.round, total=rounds, mininterval=0.5, leave=False,
                        unit="round")
    if not history:
        _eval(state, 0.0)
    stop = sched.stop
    stopped = stop is not None and bool(stop(history))
    diverged = ""
    if stopped:  # a resumed run that had already stopped
        it = range(0)
        if bar is not None:
            bar.close()
    for r in it:
        t_round = time.perf_counter()
        ctx = run.context(r)
        cohort = sample(seed, r, M, k)
        cs = None if client_state is None else {n: v[cohort] for n, v in client_state.items()}
        result, _ = (transport.run_round(algorithm, state, problem, cohort, ctx, cs, faults)
                     if len(cohort) else (None, np.arange(0)))
        sent = None if result is None else result.updates
        if result is not None:
            result, _ = receive(result, state, algorithm, faults, f"round {r}")
        if result is None and skip is not None:  # nobody sampled or every client lost
            state = skip(state, ctx)
        elif result is None:  # every client of the round was lost: θ stays
            state = ServerState(state.theta, state.opt_state, state.round + 1,
                                dict(state.extra))
        else:
            if result.client_state is not None and client_state is not None:
                ids = np.asarray(result.updates.cohort)  # the rows' own clients (a wrapper
                for n, v in result.client_state.items():  # may have dropped some)
                    client_state[n][ids] = v
            old, state = state, _step(algorithm, state, result.updates, ctx, len(cohort), r)
            grad_evals += result.updates.grad_evals
            bad = faults.server_step(f"round {r}", old.theta, state.theta, result.updates)
            if bad:  # θ is not finite: a named warning, the last record shows it, no save
                diverged = faults.diverged(f"round {r}", bad)
        faults.check()
        if ev.train_logger is not None:
            kept = None if result is None else result.updates.cohort
            ev.train_logger.log(train_record(r + 1, sent, kept, problem,
                                             time.perf_counter() - t_round))
        if sched.on_round is not None:
            sched.on_round(r, state)
        if state.round % ev.every == 0 or state.round == rounds or diverged:
            _eval(state, time.perf_counter() - t0)
            stopped = stop is not None and bool(stop(history))
        if diverged:
            break
        if ckpt is not None and every and (
            state.round % every == 0 or state.round == rounds or stopped
        ):
            ckpt.save(state, client_state, history, grad_evals, faults.state())
        if stopped:
            break
    check_end(faults)
    return RunResult(state, client_state, history, time.perf_counter() - t0, faults,
                     stopped or bool(diverged), diverged)


def _step(algorithm, state: ServerState, updates, ctx, sampled: int, r: int) -> ServerState:
    """The server step of round ``r``. When failed clients were dropped, a robust rule keeps
    the f it tolerates among the ``sampled`` cohort (:func:`~partialfl.aggregation.protection.
    cohort_checked`: protected whichever clients failed); where it cannot tolerate that f among
    the k left, the round's step is skipped (θ stays), warned and counted in
    ``state.extra['rounds_unprotected']``, as a round that lost every client: a failing client
    is never fatal. With the whole cohort the rule's refusal stands. A rule that weighs its
    inputs and gets weights summing to 0 (clients without examples, or a SuperNode saying so:
    :class:`~partialfl.aggregation.common.ZeroWeightsError`, whatever wraps the rule) skips
    the step too: nothing to average."""
    try:
        f = None
        if len(updates.cohort) < sampled:
            f = tolerated(getattr(algorithm, "aggregator", None), sampled)
        if f is None:
            return algorithm.server_update(state, updates, ctx)
        with cohort_checked(f):
            return algorithm.server_update(state, updates, ctx)
    except ZeroWeightsError as e:
        warnings.warn(f"round {r}: {e}; the round's step is skipped (θ stays)",
                      RuntimeWarning, stacklevel=2)
        return skipped_step(state)
    except UnprotectedError as e:
        if len(updates.cohort) >= sampled:
            raise
        warnings.warn(f"round {r}: {len(updates.cohort)} of {sampled} clients left after the "
                      f"failed ones were dropped, too few for the robust rule ({e}); the "
                      "round's step is skipped (θ stays)", UnprotectedWarning, stacklevel=2)
        return skipped_step(state)


def _postfix(rec: dict) -> dict[str, str]:
    """The progress bar's metric: the first of test accuracy, loss or distance logged."""
    for k in ("test_acc", "eval_acc", "test_loss", "rel_dist2", "grad_norm2", "loss"):
        v = rec.get(k)
        if isinstance(v, int | float):
            return {k: f"{v:.4g}"}
    return {}
