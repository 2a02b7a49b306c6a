"""How the clients of a cohort are mapped over: the one place that chooses between a
vectorised call, a Python loop and worker processes.

A *mode* is a value (never a name; :mod:`partialfl.build` maps names to modes):

* :class:`Vmap` — clients in groups, each group in ONE call that vectorises over its clients
  (``torch.func.vmap`` for model problems, batched numpy for closed forms). With
  ``per_client`` (examples a client brings to one call) a group holds at most
  ``max(1, max_examples // per_client)`` clients, else the whole cohort.
* :class:`Loop` — one client per call, in cohort order (the reference path).
* a *pool* — one client per call, run by an executor (``runtime.cohort_pool.ProcessBackend``:
  worker processes); it implements ``map_groups(fn, groups) -> list`` and must return the
  same per-client results as :class:`Loop` (bit for bit).

:func:`map_clients` ``(fn, cohort, mode)`` calls ``fn(positions)`` (indices into the cohort)
once per group and concatenates the results along the client axis, in cohort order. ``fn``
may have a separate one-client kernel (``single``), used for groups of one: a model
problem's plain-autograd step, the same arithmetic whether the mode is a loop or a pool.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

T = TypeVar("T")


class Vmap:
    """Vectorised groups of clients (see the module docstring). ``max_examples``: at most this
    many examples (clients × per-client examples) in one call; None: no limit."""

    name = "vmap"
    vectorized = True

    def __init__(self, max_examples: int | None = None) -> None:
        if max_examples is not None and (not isinstance(max_examples, int | np.integer)
                                         or max_examples < 1):
            raise ValueError(f"max_examples must be a positive integer or None, "
                             f"got {max_examples!r}")
        self.max_examples = None if max_examples is None else int(max_examples)

    def __repr__(self) -> str:
        return f"Vmap(max_examples={self.max_examples})"


class Loop:
    """One client per call, in cohort order (the reference path)."""

    name = "sequential"
    vectorized = False

    def __repr__(self) -> str:
        return "Loop()"


@runtime_checkable
class Pool(Protocol):
    """An executor of one-client calls (e.g. worker processes)."""

    def map_groups(self, fn: Callable[[np.ndarray], Any], groups: list[np.ndarray]
                   ) -> list: ...


def in_process(mode) -> Vmap | Loop:
    """The mode one process uses for its own clients: a :class:`Vmap` stays, anything else
    (a loop, a pool whose workers each run one client) is a :class:`Loop`."""
    return mode if isinstance(mode, Vmap) else Loop()


def groups(k: int, mode, per_client: int | None = None) -> list[np.ndarray]:
    """The positions ``0..k-1`` in the groups ``mode`` runs together (cohort order)."""
    if isinstance(mode, Vmap):
        size = k if per_client is None or mode.max_examples is None \
            else max(1, mode.max_examples // max(1, int(per_client)))
    else:
        size = 1
    size = max(1, size)
    return [np.arange(i, min(k, i + size)) for i in range(0, k, size)]


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate per-group results along the leading client axis: arrays (numpy or torch),
    and dicts / tuples / lists of them, recursively; ``None`` stays None."""
    p0 = parts[0]
    if p0 is None:
        return None
    if isinstance(p0, dict):
        return {n: concat([p[n] for p in parts]) for n in p0}
    if isinstance(p0, tuple | list):
        return type(p0)(concat(list(z)) for z in zip(*parts))
    if isinstance(p0, np.ndarray | np.generic | int | float):
        return np.concatenate([np.atleast_1d(np.asarray(p)) for p in parts], 0)
    torch = sys.modules["torch"]  # a non-numpy leaf is a tensor, so torch is loaded
    return torch.cat(list(parts), 0)


def map_clients(fn: Callable[[np.ndarray], T], cohort: int | Sequence[int] | np.ndarray,
                mode, *, per_client: int | None = None,
                single: Callable[[np.ndarray], T] | None = None,
                combine: Callable[[list[T]], T] = concat) -> T:
    """``fn`` over the clients of ``cohort`` (a size or the client ids) as ``mode`` says.

    ``fn(positions) -> result`` with a leading axis of ``len(positions)``; ``single`` (default
    ``fn``) is called instead for groups of one client; ``combine`` joins the groups' results
    in cohort order (default :func:`concat`; one group's result is returned as is).
    """
    k = int(cohort) if isinstance(cohort, int | np.integer) else len(cohort)
    if k == 0:
        raise ValueError("map_clients needs a non-empty cohort")
    parts = groups(k, mode, per_client)
    if isinstance(mode, Vmap | Loop):
        outs = [(single or fn)(g) if len(g) == 1 else fn(g) for g in parts]
    elif isinstance(mode, Pool):
        outs = mode.map_groups(single or fn, parts)
    else:
        raise TypeError(f"unknown batching mode {mode!r}: a Vmap, a Loop or a pool with "
                        "map_groups(fn, groups)")
    return outs[0] if len(outs) == 1 else combine(outs)
