"""A cohort's client updates under a batching mode (:func:`partialfl.batching.map_clients`).

:class:`ClientCall` is ``algorithm.client_update`` for some positions of a cohort, with those
clients' rows of the client state; it is a picklable value, so a pool (worker processes) can
run it. :class:`CohortRunner` gives every mode the runtime's ``run(algorithm, state, problem,
cohort, ctx, client_state)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from partialfl.algorithms.base import ClientResult, RoundContext, ServerState, concat_results
from partialfl.batching import map_clients
from partialfl.privacy import PrivacyError, scalars_refusal, tree_refusal
from partialfl.types import ClientUpdates, Params


def error_text(err: BaseException | str) -> str:
    """``"Type: message"`` of a client's error, even when its ``str()`` raises (a client's
    exception is its own code: formatting it must not fail the run)."""
    if isinstance(err, str):
        return err
    try:
        return f"{type(err).__name__}: {err}"
    except Exception:  # noqa: BLE001 - any failure of the client's __str__
        return f"{type(err).__name__}: <its message could not be formatted>"


class MalformedResult(ValueError):
    """A client computation returned something that is not its clients' result (see
    :func:`checked`): a failure of that computation, skipped and counted like a raise."""


def _rows(tree, k: int, where: str) -> str | None:
    for n, v in (tree or {}).items():
        shape = getattr(v, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != k:
            return f"{where}[{n!r}] has shape {shape}, not one row per client ({k})"
    return None


def checked(res, clients: np.ndarray, theta=None) -> ClientResult:
    """``res`` if it is a result for (some of, each at most once) the asked ``clients``: a
    :class:`ClientResult` whose rows — vectors, metrics, extras and client state — number
    its clients; else :class:`MalformedResult` (vectors that are not θ-shaped rows of θ's
    leaves: the privacy screen's :class:`~partialfl.privacy.PrivacyError`). Checked
    where a client's computation returns (a worker, a thread, the simulated clock), so one
    client can neither break the concatenation of a cohort's rows nor write rows under
    another client's id (its personal state included)."""
    if not isinstance(res, ClientResult) or not isinstance(res.updates, ClientUpdates):
        raise MalformedResult(f"the client computation returned {type(res).__name__}, not a "
                              "ClientResult")
    u = res.updates
    ids = np.asarray(u.cohort).reshape(-1)
    asked = set(np.asarray(clients).reshape(-1).tolist())
    if (len(ids) and ids.dtype.kind not in "iu") or len(set(ids.tolist())) != len(ids) or \
            not set(ids.tolist()) <= asked:
        raise MalformedResult(f"the result is for clients {ids.tolist()[:8]}, asked for "
                              f"{sorted(asked)[:8]} (each at most once)")
    k = len(ids)
    if theta:  # rows that are not θ-shaped, a grad_evals out of range: the privacy
        # screen's refusal, raised here (the merged cohort's message would refuse them all)
        why = scalars_refusal(u, k) or tree_refusal(u.vectors, theta, k, "vectors")
        if why is not None:
            raise PrivacyError(why)
    why = (_rows(u.vectors, k, "vectors") or _rows(u.metrics, k, "metrics")
           or next(filter(None, (_rows(t, k, f"extra[{e!r}]") for e, t in u.extra.items())),
                   None)
           or _rows(res.client_state, k, "client_state"))
    if why is not None:
        raise MalformedResult(f"malformed client result: {why}")
    return res


def rows(tree: Params | None, pos: np.ndarray) -> Params | None:
    """The rows ``pos`` (consecutive positions, as :func:`partialfl.batching.groups` makes
    them) of a tree stacked over the cohort; None stays None."""
    if tree is None:
        return None
    sl = slice(int(pos[0]), int(pos[-1]) + 1)
    return {n: v[sl] for n, v in tree.items()}


@dataclass(frozen=True)
class ClientCall:
    """``algorithm.client_update(state, problem, cohort[pos], ctx, client_state[pos])``."""

    algorithm: Any
    problem: Any
    state: ServerState
    cohort: np.ndarray
    ctx: RoundContext
    client_state: Params | None = None

    def __call__(self, pos: np.ndarray) -> ClientResult:
        return checked(self.algorithm.client_update(self.state, self.problem, self.cohort[pos],
                                                    self.ctx, rows(self.client_state, pos)),
                       self.cohort[pos], getattr(self.state, "theta", None))


def run_clients(algorithm, state: ServerState, problem, cohort, ctx: RoundContext,
                client_state: Params | None, mode) -> ClientResult:
    """The cohort's :class:`ClientResult` (cohort order) with its clients mapped as ``mode``
    says."""
    cohort = np.asarray(cohort)
    call = ClientCall(algorithm, problem, state, cohort, ctx, client_state)
    return map_clients(call, cohort, mode, combine=concat_results)


class CohortRunner:
    """Mixin of the runtime's modes: ``run`` = :func:`run_clients` with this mode."""

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """The cohort's client update, its clients mapped as this mode says."""
        return run_clients(algorithm, state, problem, cohort, ctx, client_state, self)

