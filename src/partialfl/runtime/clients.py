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

from partialfl import arrays
from partialfl.algorithms.base import ClientResult, RoundContext, ServerState, concat_results
from partialfl.batching import map_clients
from partialfl.privacy import PrivacyError, scalars_refusal, tree_refusal
from partialfl.types import ClientUpdates, Params


class RunSetupError(ValueError):
    """An error of the run's set-up, not of a client (a worker pool that cannot start): it
    stops the run in one line, never skipped and counted as client failures."""


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


def _layout(tree) -> tuple:
    """A tree's structure: each leaf's name, row shape, dtype and kind (numpy or torch)."""
    return tuple(sorted((str(n), tuple(np.shape(v))[1:], str(getattr(v, "dtype", type(v))),
                         arrays.is_torch(v)) for n, v in tree.items()))


def _state_refusal(got, sent: Params) -> str | None:
    """Why a result's client state does not fit the rows it was computed from (None: it
    does): the same leaves, each with the same row shape and dtype. (A leaf left out was
    lost for every other client of the cohort, or crashed the merge; one more, or a complex
    or object row, crashed the write-back or was cast into the runtime's state.)"""
    if got is None or not isinstance(got, dict):
        return f"client_state is {type(got).__name__}, not the leaves {sorted(sent)}"
    if _layout(got) != _layout(sent):
        return (f"client_state has the leaves {list(_layout(got))[:4]}, not the rows it was "
                f"given {list(_layout(sent))[:4]} (names, row shapes, dtypes)")
    return None


def structure(res: ClientResult) -> tuple:
    """What must agree between the results of one cohort before they are stacked: the
    names, row shapes and dtypes of the vectors, metrics, extras and client state."""
    u = res.updates
    return (_layout(u.vectors), _layout(u.metrics),
            tuple(sorted((str(e), _layout(t)) for e, t in u.extra.items())),
            None if res.client_state is None else _layout(res.client_state))


def odd_results(results: list[ClientResult]) -> dict[int, str]:
    """The positions whose :func:`structure` differs from the one most results share (ties:
    the earliest), with why. :func:`~partialfl.algorithms.base.concat_results` stacks by
    the first result's names, so one client's differing result once crashed the round
    (KeyError) or, placed first, silently dropped a field of every other client."""
    sigs = [structure(r) for r in results]
    counts: dict[tuple, int] = {}
    for s in sigs:
        counts[s] = counts.get(s, 0) + 1
    ref = max(counts, key=lambda s: (counts[s], -sigs.index(s)))
    return {i: "malformed client result: its fields (names, row shapes, dtypes) differ from "
               "those of the cohort's other clients"
            for i, s in enumerate(sigs) if s != ref}


def concat_checked(results: list[ClientResult]) -> ClientResult:
    """:func:`~partialfl.algorithms.base.concat_results` of results that agree in
    :func:`structure`; :class:`MalformedResult` if some do not (the runtime then isolates
    the clients and skips the odd ones: :func:`odd_results`)."""
    odd = odd_results(results)
    if odd:
        raise MalformedResult(f"{len(odd)} of {len(results)} client results differ in "
                              "structure from the others")
    return concat_results(results)


def checked(res, clients: np.ndarray, theta=None, client_state: Params | None = None
            ) -> ClientResult:
    """``res`` (rows in the asked order) if it is a result for (some of, each at most once)
    the asked ``clients``: a
    :class:`ClientResult` whose rows — vectors, metrics, extras and client state — number
    its clients; else :class:`MalformedResult` (vectors that are not θ-shaped rows of θ's
    leaves: the privacy screen's :class:`~partialfl.privacy.PrivacyError`). Checked
    where a client's computation returns (a worker, a thread, the simulated clock), so one
    client can neither break the concatenation of a cohort's rows nor write rows under
    another client's id (its personal state included). ``client_state``: the rows the
    computation was given; the result's client state must have their structure
    (:func:`_state_refusal`)."""
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
    if why is None and client_state is not None:
        why = _state_refusal(res.client_state, client_state)
    if why is not None:
        raise MalformedResult(f"malformed client result: {why}")
    return _in_asked_order(res, ids, clients)


def _in_asked_order(res: ClientResult, ids: np.ndarray, clients) -> ClientResult:
    """``res`` with its rows in the order of the asked ``clients``: the order a computation
    lists its clients in is its own choice, and would otherwise reach the server (log2(k!)
    bits of anything the client holds per message)."""
    where = {int(c): i for i, c in enumerate(np.asarray(clients).reshape(-1).tolist())}
    pos = np.array([where[int(c)] for c in ids.tolist()], dtype=np.int64)
    if (np.diff(pos) > 0).all():
        return res
    perm = np.argsort(pos, kind="stable")
    cs = res.client_state
    return ClientResult(res.updates.select(perm),
                        None if cs is None else {n: v[perm] for n, v in cs.items()})


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
        cs = rows(self.client_state, pos)
        return checked(self.algorithm.client_update(self.state, self.problem, self.cohort[pos],
                                                    self.ctx, cs),
                       self.cohort[pos], getattr(self.state, "theta", None), cs)


def run_clients(algorithm, state: ServerState, problem, cohort, ctx: RoundContext,
                client_state: Params | None, mode) -> ClientResult:
    """The cohort's :class:`ClientResult` (cohort order) with its clients mapped as ``mode``
    says."""
    cohort = np.asarray(cohort)
    call = ClientCall(algorithm, problem, state, cohort, ctx, client_state)
    return map_clients(call, cohort, mode, combine=concat_checked)


class CohortRunner:
    """Mixin of the runtime's modes: ``run`` = :func:`run_clients` with this mode."""

    def run(self, algorithm, state, problem, cohort, ctx, client_state=None) -> ClientResult:
        """The cohort's client update, its clients mapped as this mode says. A direct call
        is a run of its own: a mode that holds copies of the problem (worker processes,
        thread replicas) first checks them (``new_run``), as a run loop does at its start."""
        getattr(self, "new_run", lambda: None)()
        return run_clients(algorithm, state, problem, cohort, ctx, client_state, self)

