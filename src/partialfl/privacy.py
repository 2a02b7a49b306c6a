"""Privacy by construction: what a client may send to the server.

Only global quantities leave a client. A message (:class:`~partialfl.types.ClientUpdates`)
may carry

* ``vectors`` and every ``extra`` payload: trees whose leaf names are global parameters (the
  names of the server's θ) — never a personal parameter's name;
* ``metrics``: one scalar per client, already aggregated over the client's own examples
  (shape ``[k]``), and only under a name listed in :data:`CLIENT_METRICS` (or an
  algorithm's ``client_metrics``). Such metrics stay on the client side of the simulator:
  :func:`server_view` drops them before the server sees the message, unless the algorithm
  names them in ``server_metrics`` (what its server step really uses).

:func:`check_updates` enforces this; the simulator's message path
(:func:`partialfl.runtime.faults.receive`) calls it for every message, in every runtime.
Anything else — per-example lists, a vector-valued metric such as w, a personal name —
raises :class:`PrivacyError` naming it.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from partialfl.types import ClientUpdates

#: per-client scalars a client may report (each aggregated over its own examples)
CLIENT_METRICS = frozenset({"train_loss"})


class PrivacyError(ValueError):
    """A client message carries something that is not allowed to leave a client."""


def _allowed_metrics(algorithm) -> frozenset[str]:
    return CLIENT_METRICS | frozenset(getattr(algorithm, "client_metrics", ())) | \
        frozenset(getattr(algorithm, "server_metrics", ()))


def check_updates(updates: ClientUpdates, global_names: Collection[str],
                  algorithm=None) -> None:
    """Raise :class:`PrivacyError` unless ``updates`` carries only global trees and allowed
    per-client scalar metrics (see the module docstring)."""
    names = set(global_names)
    trees = {"vectors": updates.vectors, **{f"extra[{e!r}]": t for e, t in
                                            updates.extra.items()}}
    for where, tree in trees.items():
        bad = sorted(set(tree) - names)
        if bad:
            raise PrivacyError(f"client message field {where} carries {bad[:5]}, which are "
                               f"not global parameters (allowed: {sorted(names)[:8]})")
    k = len(updates.cohort)
    allowed = _allowed_metrics(algorithm)
    for name, v in updates.metrics.items():
        if name not in allowed:
            raise PrivacyError(f"client metric {name!r} is not allowed to leave a client; "
                               f"allowed: {', '.join(sorted(allowed))}")
        shape = tuple(np.shape(v))
        if shape != (k,):
            raise PrivacyError(f"client metric {name!r} must be one scalar per client (shape "
                               f"({k},)), got shape {shape}: per-example or vector values "
                               "may not leave a client")


def server_view(updates: ClientUpdates, algorithm=None) -> ClientUpdates:
    """The message as the server receives it: client-side metrics removed (only the names in
    ``algorithm.server_metrics`` pass)."""
    keep = frozenset(getattr(algorithm, "server_metrics", ()))
    if set(updates.metrics) <= keep:
        return updates
    return ClientUpdates(updates.vectors, updates.weights, updates.cohort, updates.grad_evals,
                         {n: v for n, v in updates.metrics.items() if n in keep},
                         updates.extra)
