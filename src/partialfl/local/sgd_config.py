"""The client SGD settings (registry ``local`` component ``sgd``); the loop itself is
:func:`partialfl.local.sgd.run_sgd`. This module imports no array library beyond numpy, so a
run specification naming ``sgd`` stays cheap to read."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from partialfl.local.base import LocalResult
from partialfl.registry import option, register
from partialfl.types import Params


@dataclass(frozen=True)
class SGDConfig:
    """Minibatch SGD epochs on the client's data (model problems): the client optimizer of
    every model algorithm, and FFGG's fine-tuner."""

    lr: float = option(0.01, "stepsize η > 0")
    epochs: int = option(1, "passes over the client's data (ignored when steps is given)")
    batch_size: int = option(32, "minibatch size")
    steps: int | None = option(None, "exact number of minibatch steps instead of epochs")
    clip_norm: float | None = option(None, "clip each step's gradient to this norm")

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, int | float) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"client lr must be a positive finite number, got {self.lr!r}")
        if not isinstance(self.epochs, int) or self.epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer, got {self.epochs!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 0):
            raise ValueError(f"steps must be None or a non-negative integer, got {self.steps!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be None or > 0, got {self.clip_norm!r}")

    def run(self, problem, cohort, theta: Params, w: Params, train: str, *, seed: int,
            round_: int, stream: str, shift: Params | None = None) -> LocalResult:
        """:func:`~partialfl.local.sgd.run_sgd` with this configuration (the
        :class:`~partialfl.local.base.LocalTrainer` interface)."""
        from partialfl.local.sgd import run_sgd

        return run_sgd(problem, cohort, theta, w, train=train, cfg=self, seed=seed,
                       round_=round_, stream=stream, shift=shift)

    def stepsizes(self, problem, cohort) -> np.ndarray:
        """η = ``lr`` for every client of the cohort ``[k]``."""
        return np.full(len(cohort), float(self.lr))

    # -- the local component interface (partialfl.algorithms.context) -------------------
    def trainer(self, **over) -> SGDConfig:
        """This trainer with some settings replaced (e.g. ``steps=K``)."""
        return dataclasses.replace(self, **over) if over else self

    def finetuner(self, w_init: str):
        """FFGG's fine-tuner: SGD on w alone from ``w_init``."""
        from partialfl.local.sgd import SGDFineTuner

        return SGDFineTuner(self, w_init)


@register("local", "sgd", options=SGDConfig, trainer=True)
def _sgd(opts: SGDConfig, ctx=None) -> SGDConfig:
    """Minibatch SGD epochs on the client's data (model problems): the client optimizer of
    every model algorithm, and FFGG's fine-tuner."""
    return opts
