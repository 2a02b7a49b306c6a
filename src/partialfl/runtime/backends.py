"""Execution backends for a cohort's client updates.

* :class:`BatchedBackend` hands the whole cohort to ``algorithm.client_update`` at once (the
  problem vectorises over clients: batched numpy for closed forms, ``torch.func.vmap`` for
  models where supported).
* :class:`SequentialBackend` runs one client at a time and stacks the results — the
  reference path; results must agree with the batched one.
* ``processes`` (:class:`partialfl.runtime.cohort_pool.ProcessBackend`) spreads the cohort's
  clients over worker processes; same results as the sequential backend, bit for bit.
"""

from __future__ import annotations

import numpy as np

from partialfl.algorithms.base import ClientResult
from partialfl.types import ClientUpdates


def _cat(xs):
    if hasattr(xs[0], "detach"):
        import torch

        return torch.cat(xs, 0)
    return np.concatenate(xs, 0)


def concat_results(results: list[ClientResult]) -> ClientResult:
    """Stack per-client results along the client axis (cohort order preserved)."""
    ups = [r.updates for r in results]
    u0 = ups[0]
    updates = ClientUpdates(
        vectors={n: _cat([u.vectors[n] for u in ups]) for n in u0.vectors},
        weights=np.concatenate([np.asarray(u.weights) for u in ups]),
        cohort=np.concatenate([np.asarray(u.cohort) for u in ups]),
        grad_evals=max(u.grad_evals for u in ups),
        metrics={n: np.concatenate([np.asarray(u.metrics[n]) for u in ups]) for n in u0.metrics},
        extra={e: {n: _cat([u.extra[e][n] for u in ups]) for n in u0.extra[e]} for e in u0.extra},
    )
    cs = None
    if results[0].client_state is not None:
        cs = {n: _cat([r.client_state[n] for r in results]) for n in results[0].client_state}
    return ClientResult(updates, cs)


class BatchedBackend:
    """Hands the whole cohort to the algorithm in one call (vectorised over clients)."""

    name = "batched"

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """The cohort's client update in one call."""
        return algorithm.client_update(state, problem, cohort, ctx, client_state)


class SequentialBackend:
    """Runs one client at a time and concatenates the results (the reference path; same result
    as the batched backend)."""

    name = "sequential"

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """Each client's update on its own (with its row of the client state), concatenated."""
        out = []
        for i, m in enumerate(cohort):
            cs = None
            if client_state is not None:
                cs = {n: v[i : i + 1] for n, v in client_state.items()}
            out.append(algorithm.client_update(state, problem, np.asarray([m]), ctx, cs))
        return concat_results(out)


def _processes():
    from partialfl.runtime.cohort_pool import ProcessBackend

    return ProcessBackend()


BACKENDS = {"batched": BatchedBackend, "sequential": SequentialBackend, "processes": _processes}


def make_backend(name: str):
    """A backend by name (``batched`` or ``sequential``); a clear error for other names."""
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; allowed: {', '.join(sorted(BACKENDS))}"
        ) from None
