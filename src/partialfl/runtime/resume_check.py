"""What a resumed run state must be, checked before any loop continues from it.

A checkpoint's files pass their SHA-256 and fingerprint checks (:mod:`.checkpoint`) when they
are the ones the pointer names, but a pointer can be rewritten along with its files (a file
received from someone else, a hand edit). So everything read is also checked against *this*
run: the state a fresh run would start from (``like``) fixes the structure, shapes and
dtypes of θ, the optimizer state, the algorithm's counters and the clients' state; θ and the
clients' floating state are finite; counters are integers in range. One checker for the
synchronous and asynchronous loops, in process and under Flower; each refusal is one line
(``error``: :class:`CheckpointError`, a :class:`~partialfl.config.ConfigError`, or the
caller's own class), never a traceback later in the loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from partialfl.arrays import is_torch, to_numpy
from partialfl.config import ConfigError
from partialfl.runtime.faults import FaultLog


class CheckpointError(ConfigError):
    """A checkpoint whose contents are not a state this run can continue from."""


def line(text: Any, n: int = 300) -> str:
    """``text`` on one line of at most ``n`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def signature(tree: Any) -> Any:
    """The structure of a state tree: dict keys, list lengths, array shapes and dtypes, scalar
    types (what a resumed state must share with a fresh one)."""
    if isinstance(tree, dict):
        return {str(k): signature(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [signature(v) for v in tree]
    if hasattr(tree, "shape"):
        a = to_numpy(tree)
        return ("array", tuple(a.shape), a.dtype.str, is_torch(tree))
    return type(tree).__name__


def _finite(a: Any) -> bool:
    a = to_numpy(a)
    return a.dtype.kind not in "fc" or bool(np.isfinite(a).all())


def _all_finite(tree: Any) -> bool:
    """Whether every floating array and float of ``tree`` (dicts, lists, tuples) is finite."""
    if isinstance(tree, dict):
        return all(_all_finite(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return all(_all_finite(v) for v in tree)
    if hasattr(tree, "shape"):
        return _finite(tree)
    return not isinstance(tree, float) or bool(np.isfinite(tree))


def _scalar_ok(v: Any) -> bool:
    """A state number (a counter, a size, a norm): finite and >= 0."""
    return type(v) not in (int, float) or bool(np.isfinite(v)) and v >= 0


def history_ok(history: Any, last: int) -> bool:
    """Whether ``history`` is a list of records (dicts) of rounds 0..``last`` in order."""
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return False
    rounds = [h.get("round") for h in history]
    return all(type(r) is int and 0 <= r <= last for r in rounds) and rounds == sorted(rounds)


def check_state(state: Any, like: Any, path: Any, error: type = CheckpointError,
                fixed: tuple = ()) -> Any:
    """``state`` if it is a server state shaped like ``like`` (this run's fresh one: θ and
    optimizer state of the same structure, shapes and dtypes, every floating value of θ, the
    optimizer state and the algorithm's state finite, a round >= 0, the algorithm's numbers
    of their types and >= 0, those it declares ``fixed`` (its ``fixed_extra``: set from the
    configuration) equal to ``like``'s); else ``error`` naming ``path``."""
    from partialfl.algorithms.base import ServerState

    if not isinstance(state, ServerState) or not isinstance(state.theta, dict) or \
            not isinstance(state.extra, dict):
        raise error(f"checkpoint {path}: the server state is malformed")
    if type(state.round) is not int or state.round < 0:
        raise error(f"checkpoint {path}: the round must be an integer >= 0")
    for part, got, ref in (("θ", state.theta, like.theta),
                           ("optimizer state", state.opt_state, like.opt_state)):
        if signature(got) != signature(ref):
            raise error(f"checkpoint {path}: the {part} differs in structure, shape or dtype "
                        "from this run's model and optimizer")
    for k, v in state.extra.items():  # the algorithm's own, or counters it adds later
        if k in like.extra and like.extra[k] == () and _buffered(v, like.theta):
            continue  # FedBuff's buffer of updates received
        if k in like.extra and signature(v) != signature(like.extra[k]) or \
                k not in like.extra and type(v) not in (int, float) or \
                not (_all_finite(v) and _scalar_ok(v)):
            raise error(f"checkpoint {path}: algorithm state {str(k)[:40]!r} differs from "
                        "this run's, is not finite or is negative")
        if k in fixed and k in like.extra and v != like.extra[k]:
            raise error(f"checkpoint {path}: algorithm state {str(k)[:40]!r} is {v!r}, but "
                        f"this run's configuration sets {like.extra[k]!r}")
    if not all(_finite(v) for v in state.theta.values()):
        raise error(f"checkpoint {path}: θ is not finite")
    if not _all_finite(state.opt_state):
        raise error(f"checkpoint {path}: the optimizer state is not finite")
    return state


def check_clients(client_state: Any, like: Any, path: Any, error: type = CheckpointError,
                  what: str = "the clients' state") -> Any:
    """``client_state`` if it has the names, shapes and dtypes of ``like`` (this run's fresh
    client state; None: the clients keep none) and its floating leaves are finite; else
    ``error``. A state kept in a :class:`~partialfl.data.client_state.ClientStateStore` is
    compared by names and shapes."""
    if like is None or client_state is None:
        if (like is None) != (client_state is None):
            raise error(f"checkpoint {path}: {what} is "
                        f"{'missing' if client_state is None else 'present'}, but this run's "
                        f"algorithm keeps {'some' if like is not None else 'none'}")
        return client_state
    if not isinstance(client_state, dict) or set(map(str, client_state)) != set(like):
        raise error(f"checkpoint {path}: {what} names other leaves than this run's algorithm "
                    "keeps")
    for n, v in client_state.items():
        ref = like[n]
        same = (signature(v) == signature(ref) if isinstance(like, dict)
                else hasattr(v, "shape") and tuple(v.shape) == tuple(ref.shape))
        if not same or not _finite(v):
            raise error(f"checkpoint {path}: {what} leaf {str(n)[:40]!r} differs in shape or "
                        "dtype from this run's, or is not finite")
    return client_state


def _buffered(buf: Any, theta: dict) -> bool:
    """Whether ``buf`` is a tuple of received updates for ``theta`` (FedBuff's buffer): per
    update n rows of each θ leaf, finite, n finite weights >= 0 and n client ids."""
    from partialfl.types import ClientUpdates

    def ok(u: Any) -> bool:
        if not isinstance(u, ClientUpdates) or not isinstance(u.vectors, dict) or \
                set(u.vectors) != set(theta):
            return False
        w, c = to_numpy(u.weights), to_numpy(u.cohort)
        n = len(w) if w.ndim == 1 else -1
        return (n >= 1 and c.shape == (n,) and c.dtype.kind in "iu"
                and bool(np.isfinite(w).all() and (w >= 0).all())
                and all(to_numpy(v).shape == (n, *to_numpy(theta[k]).shape)
                        and np.isfinite(to_numpy(v)).all() for k, v in u.vectors.items()))

    return isinstance(buf, tuple) and all(ok(u) for u in buf)


def check_faults(faults: Any, path: Any, error: type = CheckpointError) -> dict:
    """The loop's saved fault counters, as :meth:`FaultLog.check_state`, else ``error``."""
    try:
        return FaultLog.check_state(faults)
    except ValueError as e:
        raise error(f"checkpoint {path}: {line(e)}") from None


def check_sync(loaded: tuple, like: Any, like_clients: Any, rounds: int, path: Any,
               error: type = CheckpointError, fixed: tuple = ()) -> tuple:
    """``loaded`` (a synchronous checkpoint's ``(state, client state, history, grad_evals,
    fault counters)``) if the state is this run's kind (:func:`check_state` with ``fixed``,
    :func:`check_clients`), its round at most ``rounds``, the history records of rounds
    0..round in order and the counters integers >= 0; else ``error``."""
    state, client_state, history, grads, faults = loaded
    state = check_state(state, like, path, error, fixed)
    if state.round > rounds:
        raise error(f"checkpoint {path}: round {state.round} is past this run's {rounds} "
                    "rounds")
    check_clients(client_state, like_clients, path, error)
    if not history_ok(history, state.round):
        raise error(f"checkpoint {path} has a malformed history (records of rounds "
                    f"0..{state.round} in order)")
    if type(grads) is not int or grads < 0:
        raise error(f"checkpoint {path}: grad_evals must be an integer >= 0")
    check_faults(faults, path, error)
    return loaded


#: a resumed asynchronous server's bookkeeping (:meth:`AsyncServer.snapshot`)
SNAPSHOT_KEYS = {"state", "busy", "next_job", "arrivals", "grad_evals", "events", "rows",
                 "history", "time", "faults"}
_EVENT_KINDS = ("dispatch", "arrive", "lost")


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _when(v: Any) -> bool:
    return type(v) in (int, float) and v == v and 0 <= v < float("inf")


def check_async(loaded: tuple, like: Any, num_clients: int, concurrency: int, path: Any,
                max_arrivals: int | None = None, like_clients: Any = None,
                error: type = CheckpointError, fixed: tuple = ()) -> tuple:
    """``loaded`` (an asynchronous checkpoint's ``(snapshot, client state, jobs)``) if the
    server's bookkeeping and every job in flight are this run's kind: each state as
    :func:`check_state` (with ``fixed``), the clients' state as :func:`check_clients`
    (``like_clients``: the fresh one) and each job's rows as one client's of it, ``busy``
    one flag per client, the counters integers >= 0 consistent with one record per applied
    update (``arrivals`` rows, round <= arrivals), events and records of their fields'
    types, each job's client and slot in range, busy, its θ version no newer than the
    server's, at most ``max_arrivals`` applied updates; else ``error``."""
    snap, client_state, jobs = loaded
    bad = f"checkpoint {path}: the asynchronous server's bookkeeping"
    if not isinstance(snap, dict) or set(snap) != SNAPSHOT_KEYS:
        raise error(f"{bad} is malformed")
    check_clients(client_state, like_clients, path, error)
    state = check_state(snap["state"], like, path, error, fixed)
    busy = snap["busy"]
    if not hasattr(busy, "shape") or to_numpy(busy).shape != (num_clients,) or \
            to_numpy(busy).dtype != bool:
        raise error(f"{bad}: busy must be {num_clients} flags (one per client)")
    counts = {k: snap[k] for k in ("next_job", "arrivals", "grad_evals")}
    rows, events, history = snap["rows"], snap["events"], snap["history"]
    if not all(_count(v) for v in counts.values()) or not _when(snap["time"]):
        raise error(f"{bad}: next_job, arrivals, grad_evals and time must be numbers >= 0")
    if max_arrivals is not None and snap["arrivals"] > max_arrivals:
        raise error(f"{bad}: {snap['arrivals']} updates applied, past this stage's "
                    f"{max_arrivals}")
    if not (isinstance(rows, list) and len(rows) == snap["arrivals"] >= state.round
            and all(isinstance(r, tuple) and len(r) == 9 and all(_when(x) for x in r)
                    for r in rows)):
        raise error(f"{bad}: the records of applied updates do not match its arrivals and "
                    "round")
    if not (isinstance(events, list) and all(
            isinstance(e, tuple) and len(e) == 6 and e[0] in _EVENT_KINDS
            and _when(e[1]) and all(_count(x) for x in e[2:]) for e in events)):
        raise error(f"{bad}: the event log is malformed")
    if not history_ok(history, state.round):
        raise error(f"{bad}: the history is malformed")
    check_faults(snap["faults"], path, error)
    if not isinstance(jobs, list):
        raise error(f"checkpoint {path}: the jobs in flight are malformed")
    flags = to_numpy(busy)
    slots: set[int] = set()
    for job, st, rows_sent in jobs:
        f = job.__dict__
        if not (all(_count(f[k]) for k in ("job", "client", "slot", "version"))
                and _when(f["dispatch_time"]) and f["job"] < snap["next_job"]
                and f["client"] < num_clients and f["slot"] < concurrency
                and f["slot"] not in slots and f["version"] <= state.round
                and bool(flags[f["client"]])):
            raise error(f"checkpoint {path}: a job in flight is malformed")
        slots.add(f["slot"])
        check_state(st, like, path, error, fixed)
        one = (None if like_clients is None
               else {n: v[[0]] for n, v in like_clients.items()})
        check_clients(rows_sent, one, path, error, "a job's client state")
    return loaded
