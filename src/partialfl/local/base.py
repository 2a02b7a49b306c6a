"""What every local trainer shares: the result of a local run and the trainer interface.

A *local trainer* is the client optimizer of an algorithm that trains on its own data for a
while (FedAvg / Local GD, Scaffold, FedAlt, FedSim, Local FFGG): full-gradient steps
(:class:`partialfl.local.gd.GDConfig`, any problem) or minibatch SGD epochs
(:class:`partialfl.local.sgd.SGDConfig`, model problems). Algorithms call only
:meth:`LocalTrainer.run`, so one algorithm runs with either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from partialfl.types import Params

#: what a local run trains: w only, θ only, both at once, or per step a w-step then a θ-step
TRAIN_MODES = ("w", "theta", "both", "alternate")


def one_of(value: str, allowed, what: str) -> str:
    """``value`` if it is in ``allowed``, else a ValueError naming ``what`` and every allowed
    value."""
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
    return value


def check_train(train: str) -> str:
    """``train`` if it is one of :data:`TRAIN_MODES`, else a ValueError naming them."""
    return one_of(train, TRAIN_MODES, "train mode")


@dataclass(frozen=True)
class LocalResult:
    """``theta`` is per client ``[k, ...]`` if it was trained, else the θ that was given;
    ``w`` is stacked ``[k, ...]``; ``steps`` the most local gradient steps of a client (what
    the round costs); ``loss`` the mean training loss per client over the run (``[k]``, nan
    without a step), or None when the trainer does not measure it (full-gradient steps);
    ``client_steps`` the steps each client took ``[k]`` (None: ``steps`` for all)."""

    theta: Params
    w: Params
    steps: int
    loss: np.ndarray | None
    client_steps: np.ndarray | None = None


class LocalTrainer(Protocol):
    """A client optimizer: ``run`` trains ``train`` (see :data:`TRAIN_MODES`) on every client
    of the cohort from θ (shared ``[...]``) and w (stacked), with randomness from
    (seed, stream, round, client); ``shift`` (stacked, over the trained names) is subtracted
    from every gradient (Scaffold's control-variate correction); ``mode``: the batching mode
    of the problem's kernels (the run's, ``RoundContext.mode``; None: the problem's
    default)."""

    def run(self, problem, cohort: np.ndarray, theta: Params, w: Params, train: str, *,
            seed: int, round_: int, stream: str, shift: Params | None = None, mode=None
            ) -> LocalResult: ...

    def stepsizes(self, problem, cohort: np.ndarray) -> np.ndarray:
        """The stepsize η of each client of the cohort ``[k]``."""
        ...


def check_tau(tau) -> int:
    """``tau`` as an int if it is an integer >= 1, else a ValueError."""
    if isinstance(tau, bool) or not isinstance(tau, int | np.integer) or tau < 1:
        raise ValueError(f"local steps tau must be an integer >= 1, got {tau!r}")
    return int(tau)
