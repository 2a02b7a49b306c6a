"""A user's own components, registered from a module outside the package (the test folder):
a toy algorithm with one option and a toy aggregation rule. ``plugins = ["toy_plugin"]`` in a
run spec (with ``--allow-code``) makes them runnable by name everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialfl.aggregation.common import to_numpy
from partialfl.aggregation.compose import AggregatorOptions, register_rule
from partialfl.algorithms.base import Algorithm, ClientResult, Deployed
from partialfl.registry import option, register
from partialfl.types import ClientUpdates


class Toy(Algorithm):
    """``steps`` GD steps on w from 0 with θ fixed (stepsize ``lr``), then ∇_θ f_m(θ, w)."""

    name = "toy"

    def __init__(self, steps: int, lr: float, server_opt=None, aggregator=None) -> None:
        super().__init__(server_opt, aggregator)
        self.steps, self.lr = steps, lr

    def _w(self, problem, cohort, theta, seed):
        w = problem.init_w(cohort, "zero", seed, -1)
        for _ in range(self.steps):
            g = problem.grad_w(cohort, theta, w)
            w = {n: (v - self.lr * g[n]) if n in g else v for n, v in w.items()}
        return w

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        w = self._w(problem, cohort, state.theta, ctx.seed)
        g = problem.grad_theta(cohort, state.theta, w)
        return ClientResult(ClientUpdates(g, np.ones(len(cohort)), np.asarray(cohort),
                                          self.steps + 1))

    def deploy(self, state, problem, cohort, client_state, ctx):
        return Deployed(state.theta, self._w(problem, cohort, state.theta, ctx.seed))


@dataclass(frozen=True)
class ToyOptions:
    """The toy's fine-tuning."""

    steps: int = option(3, "GD steps on w")
    lr: float = option(0.05, "their stepsize")


@register("algorithm", "toy", options=ToyOptions, split="personal", sends="gradient")
def _toy(opts: ToyOptions, ctx) -> Toy:
    """A toy FFGG: GD steps on w from zero, then the θ-gradient."""
    return Toy(opts.steps, opts.lr, ctx.server_opt, ctx.aggregator)


@dataclass(frozen=True)
class DropLargest:
    """The mean of the rows after dropping the ``drop`` rows of largest norm."""

    drop: int = 1

    def __call__(self, vectors, weights=None):
        X, back = to_numpy(vectors)  # numpy or torch in, the same kind out
        X = X.astype(np.float64)
        keep = np.argsort(np.linalg.norm(X, axis=1))[: max(1, len(X) - self.drop)]
        return back(X[np.sort(keep)].mean(0).astype(np.asarray(X).dtype))


@dataclass(frozen=True)
class DropOptions(AggregatorOptions):
    """How many rows to drop."""

    drop: int = option(1, "rows of largest norm dropped before the mean")


register_rule("drop-largest", DropLargest, DropOptions,
              doc="The mean after dropping the rows of largest norm (a toy rule).")
