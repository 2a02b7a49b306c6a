"""Small pieces every local-training algorithm shares (no array library, no key literal)."""

from __future__ import annotations

import numpy as np

from partialfl import arrays
from partialfl.local.base import one_of
from partialfl.problems.base import check_w_init
from partialfl.types import Params

WEIGHTINGS = ("uniform", "examples")


def loss_metric(loss) -> dict:
    """A client's reported training loss (the allowed per-client metric ``train_loss``,
    :mod:`partialfl.privacy`; ``[k]``), or nothing when its trainer gives none."""
    return {} if loss is None else {"train_loss": loss}


def check_weighting(weighting: str) -> str:
    """``weighting`` if it is one of :data:`WEIGHTINGS`, else a ValueError naming them."""
    return one_of(weighting, WEIGHTINGS, "weighting")


check_init = check_w_init  # w initialisations: the problems' W_INITS


def client_weights(problem, cohort, weighting: str) -> np.ndarray:
    """Aggregation weights ``[k]``: 1 per client (``uniform``) or its n_m (``examples``)."""
    if weighting == "examples":
        return np.asarray(problem.num_examples(cohort)).astype(np.float64)
    return np.ones(len(cohort))


def delta(local: Params, shared: Params) -> Params:
    """Per-client change ``local[n] − shared[n]`` (``local`` stacked ``[k, ...]``, ``shared``
    not), over the names of ``shared``."""
    return {n: local[n] - shared[n][None] for n in shared}


def pick(tree: Params, names) -> Params:
    """The leaves of ``tree`` with the given names (in that order)."""
    return {n: tree[n] for n in names}


def repeat_tree(tree: Params, k: int) -> Params:
    """Every leaf copied to ``k`` stacked rows."""
    return {n: arrays.repeat_rows(v, k) for n, v in tree.items()}


class DeployAll:
    """Mixin: ``deployed`` (every client) is the cohort-scoped ``deploy`` on all clients, so
    an algorithm writes only ``deploy(state, problem, cohort, client_state rows, ctx)``."""

    def deployed(self, state, problem, client_state, ctx):
        """:meth:`deploy` on every client."""
        return self.deploy(state, problem, np.arange(problem.num_clients), client_state, ctx)


def finetuned_w(local, problem, cohort, theta: Params, w_init: str, seed: int,
                round_: int, mode=None) -> Params:
    """What a stateless client deploys: w from ``w_init``, then ``local``'s run on w alone with
    θ fixed (stream ``"finetune"``; ``mode``: the kernels' batching mode)."""
    w = problem.init_w(cohort, w_init, seed, round_)
    return local.run(problem, cohort, theta, w, "w", seed=seed, round_=round_,
                     stream="finetune", mode=mode).w
