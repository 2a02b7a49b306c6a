"""A run as one value: what the two loops take.

:class:`Run` holds the problem, the algorithm, the schedule — :class:`Rounds` (synchronous
rounds, :func:`partialfl.runtime.sync.run_sync`) or :class:`Arrivals` (Algorithm 3,
:func:`partialfl.runtime.asynchronous.run_arrivals`) — and how the run executes, evaluates
and checkpoints, each a small value of its own:

* ``executor`` (:class:`~partialfl.batching.Executor`): the batching mode and the device,
  chosen once (from a spec: :func:`partialfl.build.executor_of`); the loop maps each cohort
  under ``executor.mode`` and hands ``executor.kernel_mode`` to every client computation
  and evaluation in ``RoundContext.mode`` (:meth:`Run.context`);
* :class:`Evaluation`: the evaluator, its cadence, the logger, a progress bar;
* :class:`Checkpointing`: where and how often the run is saved, and whether it resumes.

``execute(run)`` (:func:`partialfl.runtime.execute`) runs either loop. The keyword forms
``run_rounds``, ``run_async`` and ``run_processes`` build a :class:`Run` and call it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.algorithms.base import RoundContext
from partialfl.batching import Executor, is_cpu
from partialfl.types import Params

#: ``evaluate(algorithm, state, problem, client_state, ctx) -> dict`` of metrics
Evaluator = Callable[..., dict]


def _positive_int(v, what: str, low: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {v!r}")


@dataclass(frozen=True)
class Evaluation:
    """What the loop logs: ``fn(algorithm, state, problem, client_state, ctx)`` (None: only
    the common keys, :data:`partialfl.runtime.logging.RECORD_KEYS`) at the start, after every
    ``every``-th round (sync) or applied update (async) and at the end; each record goes to
    ``logger`` (``log(record)``); ``progress``: a progress bar (True, or its label);
    ``train_logger`` (sync): one record per round,
    :func:`~partialfl.runtime.logging.train_record` (training loss, throughput)."""

    fn: Evaluator | None = None
    every: int = 1
    logger: Any = None
    progress: bool | str = False
    train_logger: Any = None

    def __post_init__(self) -> None:
        _positive_int(self.every, "eval_every")


@dataclass(frozen=True)
class Checkpointing:
    """Where the run is saved: ``to`` a path (a crash-consistent
    :class:`~partialfl.runtime.checkpoint.Checkpoint`, validated against the run's
    fingerprint) or a checkpointer object (sync: ``save``/``load``, e.g. the Flower
    ServerApp's; async: an :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`);
    every ``every`` rounds (sync) or applied updates (async) and at the end (0: never);
    ``resume``: continue from it; ``private``: the clients' state in the separate
    client-side file; ``fingerprint``: extra configuration a resumed checkpoint must match."""

    to: str | Path | Any
    every: int = 0
    resume: bool = False
    private: bool = True
    fingerprint: dict | None = None

    def __post_init__(self) -> None:
        _positive_int(self.every, "checkpoint_every", 0)


@dataclass(frozen=True)
class Rounds:
    """The synchronous schedule: ``rounds`` rounds, each of ``clients_per_round`` clients
    sampled without replacement (None: all); ``stop(history)``, asked after every evaluation
    (and on resume), ends the run early when True (a function of the logged history only, so
    a resumed run stops at the same round); ``on_round(r, state)`` after every round."""

    rounds: int
    clients_per_round: int | None = None
    stop: Callable[[list[dict]], bool] | None = None
    on_round: Callable[[int, Any], None] | None = None

    def __post_init__(self) -> None:
        _positive_int(self.rounds, "rounds", 0)


@dataclass(frozen=True)
class Arrivals:
    """The asynchronous schedule (Algorithm 3): ``concurrency`` clients at work, durations
    from ``compute_time`` (a :class:`~partialfl.runtime.asynchronous.ComputeTimeModel`;
    None: 1 per job), until ``steps`` updates were applied or ``max_time`` passed (at least
    one of them); ``record_events``: keep the dispatch/arrival log."""

    steps: int | None = None
    max_time: float | None = None
    concurrency: int = 1
    compute_time: Any = None
    record_events: bool = True

    def __post_init__(self) -> None:
        check_budget(self.steps, self.max_time)


def check_budget(steps: int | None, max_time: float | None) -> None:
    """A ValueError unless ``steps`` (a non-negative integer) and/or ``max_time`` (finite,
    >= 0) is given."""
    if steps is None and max_time is None:
        raise ValueError("give steps (number of applied updates) and/or max_time")
    if steps is not None and not (isinstance(steps, int | np.integer) and steps >= 0):
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if max_time is not None and not (max_time >= 0 and math.isfinite(max_time)):
        raise ValueError(f"max_time must be finite and >= 0, got {max_time!r}")


def same_device(a, b) -> bool:
    """Whether two device names (or ``torch.device`` s) name the same device (``cuda`` and
    ``cuda:0`` do)."""
    ta, _, ia = str(a).partition(":")
    tb, _, ib = str(b).partition(":")
    return ta == tb and (ia or "0") == (ib or "0")


@dataclass(frozen=True)
class Run:
    """One run (see the module docstring): ``problem``, ``algorithm`` and ``schedule``;
    ``seed`` (every random draw derives from it); ``theta0`` (None:
    ``problem.init_theta(generator(seed, "init"))``); ``executor`` (None: the problem's own
    mode on its device, :meth:`Executor.of <partialfl.batching.Executor.of>`);
    ``evaluation``; ``checkpoint`` (None: none); ``max_failure_fraction``: abort when more
    client computations than this fraction failed."""

    problem: Any
    algorithm: Any
    schedule: Rounds | Arrivals
    seed: int = 0
    theta0: Params | None = None
    executor: Executor | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    checkpoint: Checkpointing | None = None
    max_failure_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Rounds | Arrivals):
            raise TypeError(f"schedule must be Rounds(...) or Arrivals(...), got "
                            f"{self.schedule!r}")
        if self.executor is None:
            object.__setattr__(self, "executor", Executor.of(self.problem))
        elif not isinstance(self.executor, Executor):
            raise TypeError(f"executor must be a partialfl.batching.Executor, got "
                            f"{self.executor!r}")
        dev = getattr(self.problem, "device", None)
        if dev is not None and not same_device(dev, self.executor.device):
            raise ValueError(f"the executor runs on {self.executor.device} but the problem's "
                             f"tensors are on {dev}: build the problem on the executor's "
                             "device")
        if dev is None and not is_cpu(self.executor.device):
            raise ValueError(f"{type(self.problem).__name__} computes on the CPU; the "
                             f"executor names {self.executor.device}")

    def context(self, round_: int) -> RoundContext:
        """The :class:`RoundContext` of round (or job) ``round_``: the seed, the round and
        the executor's kernel mode."""
        return RoundContext(self.seed, round_, self.executor.kernel_mode)

    @property
    def checkpoint_device(self):
        """Where a resumed checkpoint's tensors go: the problem's device (None: a problem
        without one keeps them where they were saved)."""
        return getattr(self.problem, "device", None)
