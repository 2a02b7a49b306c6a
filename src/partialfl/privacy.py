"""Privacy by construction, checked by value: what a client may send to the server.

Only global quantities leave a client, and each value has exactly ONE channel:

====================  ===============================================================
value                 its one channel
====================  ===============================================================
θ's update            ``vectors``: leaves named as θ's leaves, each row θ-shaped, real
(gradient or Δ)       floating point (non-finite rows are skipped as faults)
an algorithm's other  ``extra[name]`` with ``name`` in the algorithm's declared
global payload        ``extra_names`` (Scaffold: ``dc``), a tree of θ's leaf names, each
                      row θ-shaped, real floating point
a per-client summary  ``metrics[name]``, ``name`` in :data:`CLIENT_METRICS` or the
                      algorithm's ``client_metrics``/``server_metrics``: ONE float per
                      client (shape ``[k]``), already aggregated over the client's own
                      examples, finite or NaN ("not computed": no local step, no
                      example — which ``grad_evals`` and ``weights`` tell anyway);
                      dropped before the server (:func:`server_view`) unless listed in
                      ``server_metrics`` (what the server step reads), and then passed
                      as float64 with every NaN the canonical one (no payload bits)
the client's weight   ``weights``: one finite number ≥ 0 per client (its examples)
work done             ``grad_evals``: one integer per message
personal state        nowhere: ``ClientResult.client_state`` (w_m, c_m, Ditto's v_m)
(w, control           stays with the runtime's client side, and is checkpointed only to
variates)             the client-side file (:mod:`partialfl.runtime.checkpoint`)
====================  ===============================================================

Anything else — a personal parameter's name, an undeclared ``extra`` payload, a tree row
that is not θ-shaped, a metric that is not allow-listed, not a float (e.g. a string or
object array carrying w as text), not one per client, or infinite — is refused.
:func:`screen` says which clients of a message may pass and why the others may not; the
simulator's message path (:func:`partialfl.runtime.faults.receive`) calls it for every
message in every runtime, skips and counts the refused clients (``updates_refused``) and
re-raises a :class:`PrivacyError` when a whole cohort is refused before any client passed
(an algorithm that leaks, not a fault). :func:`check_updates` raises on any refusal.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from partialfl import arrays
from partialfl.types import ClientUpdates

#: per-client scalars a client may report (each aggregated over its own examples)
CLIENT_METRICS = frozenset({"train_loss"})

#: the most local gradient evaluations one message may claim (2^53: exact as a float)
MAX_GRAD_EVALS = 2**53


class PrivacyError(ValueError):
    """A client message carries something that is not allowed to leave a client."""


def _allowed_metrics(algorithm) -> frozenset[str]:
    return CLIENT_METRICS | frozenset(getattr(algorithm, "client_metrics", ())) | \
        frozenset(getattr(algorithm, "server_metrics", ()))


def _is_float(v) -> bool:
    """Whether ``v`` is a real floating-point array (numpy or torch)."""
    if arrays.is_torch(v):
        return v.dtype.is_floating_point
    return isinstance(v, np.ndarray | np.generic) and np.asarray(v).dtype.kind == "f"


def tree_refusal(tree, theta: Mapping | Collection[str], k: int, where: str) -> str | None:
    """Why a tree of a message may not pass (None: it may)."""
    bad = sorted(set(tree) - set(theta))
    if bad:
        return (f"client message field {where} carries {bad[:5]}, which are not global "
                f"parameters (allowed: {sorted(theta)[:8]})")
    for n, v in tree.items():
        if not _is_float(v):
            return (f"client message field {where}[{n!r}] is not a real floating-point "
                    f"array (got {type(v).__name__} of {getattr(v, 'dtype', None)})")
        if isinstance(theta, Mapping):
            want = (k, *tuple(np.shape(theta[n])))
            if tuple(v.shape) != want:
                return (f"client message field {where}[{n!r}] has shape {tuple(v.shape)}, "
                        f"not one θ-shaped row per client {want}")
            if arrays.is_torch(v) != arrays.is_torch(theta[n]) or v.dtype != theta[n].dtype:
                # (float64 rows made a float32 θ float64 and every later client failed)
                return (f"client message field {where}[{n!r}] is {type(v).__name__} of "
                        f"{v.dtype}, θ is {type(theta[n]).__name__} of {theta[n].dtype}")
    return None


def scalars_refusal(updates: ClientUpdates, k: int) -> str | None:
    """Why the message's bookkeeping may not pass (None: it may): ``cohort`` one integer id
    per client, ``weights`` one real number per client, ``grad_evals`` one integer — each
    of these channels carries nothing else (e.g. w as a ``[k, d]`` weight or a string)."""
    ids, wts = (np.asarray(arrays.to_numpy(v)) for v in (updates.cohort, updates.weights))
    if ids.shape != (k,) or (k and ids.dtype.kind not in "iu"):
        return (f"client message field cohort must be one integer id per client, got "
                f"{ids.dtype} of shape {ids.shape}")
    if wts.shape != (k,) or (k and wts.dtype.kind not in "iuf"):
        return (f"client message field weights must be one real number per client (shape "
                f"({k},)), got {wts.dtype} of shape {wts.shape}")
    g = updates.grad_evals
    if isinstance(g, bool | np.bool_) or not isinstance(g, int | np.integer):
        return f"client message field grad_evals must be one integer, got {type(g).__name__}"
    if not 0 <= g <= MAX_GRAD_EVALS:  # (a 6000-digit count crashed the run log's JSON)
        shown = int(g) if abs(g) < 10**30 else "a number of more than 30 digits"
        return f"client message field grad_evals must be in [0, {MAX_GRAD_EVALS}], got {shown}"
    return None


def screen(updates: ClientUpdates, theta: Mapping | Collection[str], algorithm=None
           ) -> tuple[np.ndarray, str | None]:
    """``(ok, reason)``: ``ok[i]`` whether client i's message may pass (see the module
    docstring), ``reason`` why the first refused one may not (None if all pass). ``theta``:
    the server's θ (shapes are checked) or just its leaf names."""
    k = len(updates.cohort)
    why = scalars_refusal(updates, k) or tree_refusal(updates.vectors, theta, k, "vectors")
    declared = frozenset(getattr(algorithm, "extra_names", ()))
    for e, tree in updates.extra.items():
        if why is not None:
            break
        if e not in declared:
            why = (f"client message field extra[{e!r}] is not declared by the algorithm "
                   f"(its extra_names: {sorted(declared)})")
        else:
            why = tree_refusal(tree, theta, k, f"extra[{e!r}]")
    allowed = _allowed_metrics(algorithm)
    for name, v in updates.metrics.items():
        if why is not None:
            break
        if name not in allowed:
            why = (f"client metric {name!r} is not allowed to leave a client; allowed: "
                   f"{', '.join(sorted(allowed))}")
        elif not _is_float(v):
            why = (f"client metric {name!r} must be a float per client, got "
                   f"{type(v).__name__} of {getattr(v, 'dtype', None)}")
        elif tuple(v.shape) != (k,):
            why = (f"client metric {name!r} must be one scalar per client (shape ({k},)), got "
                   f"shape {tuple(v.shape)}: per-example or vector values may not leave a "
                   "client")
    if why is not None:  # a refusal of the message's structure: every client of it
        return np.zeros(k, dtype=bool), why
    ok = np.ones(k, dtype=bool)
    neg = _float64(updates.weights).reshape(-1) < 0  # (NaN: a non-finite fault, not this)
    if neg.any():  # a weight counts examples; one below 0 made a robust rule raise
        who = int(updates.cohort[int(np.flatnonzero(neg)[0])])
        why = (f"client message field weights: client {who} sent a negative weight (a "
               "weight counts examples: >= 0)")
        ok &= ~neg
    for name, v in updates.metrics.items():
        fin = ~np.isinf(_float64(v))  # NaN: "not computed" (canonicalised by server_view)
        if not fin.all():
            why = why or (f"client metric {name!r} of client "
                          f"{int(updates.cohort[int(np.flatnonzero(~fin)[0])])} is infinite")
            ok &= fin
    return ok, why


def _float64(v) -> np.ndarray:
    """A float metric as float64 numpy (bf16 and other torch floats included)."""
    if arrays.is_torch(v):
        return v.detach().double().cpu().numpy()
    return np.asarray(v, dtype=np.float64)


def check_updates(updates: ClientUpdates, theta: Mapping | Collection[str],
                  algorithm=None) -> None:
    """Raise :class:`PrivacyError` unless every client of ``updates`` may pass
    (:func:`screen`)."""
    _, why = screen(updates, theta, algorithm)
    if why is not None:
        raise PrivacyError(why)


def _name(n):
    """A str name as an exact ``str`` (a subclass could carry anything in its attributes);
    any other key is left for the screen to refuse."""
    if isinstance(n, str):
        return str.encode(n, "utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
    return n


def values_only(updates: ClientUpdates, theta: Collection[str] = ()) -> ClientUpdates:
    """``updates`` with values only (:func:`partialfl.arrays.plain` for every row, weight
    and id; exact ``str`` names; an exact ``int`` count), every tree in one canonical order
    (:func:`_ordered`: the leaves in ``theta``'s order, other names sorted): what the
    privacy screen checks is then exactly what may reach the server — a subclass cannot
    report another shape than the array it hands over, nor carry a value in an attribute, a
    name, a dtype's metadata or the order it lists its leaves in."""
    g = updates.grad_evals
    return ClientUpdates(
        _ordered({_name(n): arrays.plain(v) for n, v in updates.vectors.items()}, theta),
        arrays.plain(updates.weights), arrays.plain(updates.cohort),
        int.__int__(g) if isinstance(g, int) and not isinstance(g, bool) else g,
        _ordered({_name(n): arrays.plain(v) for n, v in updates.metrics.items()}),
        _ordered({_name(e): _ordered({_name(n): arrays.plain(t) for n, t in tree.items()},
                                     theta)
                  for e, tree in updates.extra.items()}))


def _ordered(tree: dict, first: Collection[str] = ()) -> dict:
    """``tree`` with the names of ``first`` in their order, then the others sorted (names
    that are not ``str`` last, by their text)."""
    head = [n for n in first if n in tree]
    seen = set(head)
    rest = sorted((n for n in tree if n not in seen),
                  key=lambda n: (not isinstance(n, str), str(n)))
    return {n: tree[n] for n in head + rest}


def server_view(updates: ClientUpdates, algorithm=None) -> ClientUpdates:
    """The message as the server receives it: client-side metrics removed (only the names in
    ``algorithm.server_metrics`` pass), every field values only (:func:`partialfl.arrays.
    plain`: no subclass, attribute or larger buffer behind a row; weights float64 and ids
    int64 numpy, whichever allowed dtype the client used; ``grad_evals`` a plain int)."""
    keep = frozenset(getattr(algorithm, "server_metrics", ()))
    metrics = {}
    for n, v in updates.metrics.items():
        if n in keep:  # float64, every NaN the canonical one: no payload bits pass
            a = _float64(v)
            metrics[n] = np.where(np.isnan(a), np.nan, a)
    # plain arrays: an attribute or subclass attached to a row object never reaches the server
    # weights float64 and ids int64 whatever the client chose among the allowed dtypes (the
    # choice itself would carry a few bits)
    return ClientUpdates({n: arrays.plain(v) for n, v in updates.vectors.items()},
                         _float64(updates.weights),
                         np.asarray(arrays.to_numpy(updates.cohort), dtype=np.int64),
                         int(updates.grad_evals), metrics,
                         {n: {m: arrays.plain(t) for m, t in tree.items()}
                          for n, tree in updates.extra.items()})
