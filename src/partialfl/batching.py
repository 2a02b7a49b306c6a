"""How the clients of a cohort are mapped over: the one place that chooses between a
vectorised call, a Python loop and worker processes.

A *mode* is a value (never a name; :mod:`partialfl.build` maps names to modes):

* :class:`Vmap` — clients in groups, each group in ONE call that vectorises over its clients
  (``torch.func.vmap`` for model problems, batched numpy for closed forms). With
  ``per_client`` (examples a client brings to one call) a group holds at most
  ``max(1, max_examples // per_client)`` clients (default 2048 examples), else the whole
  cohort.
* :class:`Loop` — one client per call, in cohort order (the reference path).
* a *pool* — one client per call, run by an executor (``runtime.cohort_pool.ProcessBackend``:
  worker processes); it implements ``map_groups(fn, groups) -> list`` and must return the
  same per-client results as :class:`Loop` (bit for bit).

:func:`map_clients` ``(fn, cohort, mode)`` calls ``fn(positions)`` (indices into the cohort)
once per group and concatenates the results along the client axis, in cohort order. ``fn``
may have a separate one-client kernel (``single``), used for groups of one: a model
problem's plain-autograd step, the same arithmetic whether the mode is a loop or a pool.

A run chooses its mode ONCE, as an :class:`Executor` (the mode and the device; from the spec:
:func:`partialfl.build.executor_of`). The loop maps each cohort's clients with
``executor.mode`` and hands the in-process mode (:func:`in_process`) down to the client
computations in ``RoundContext.mode``; the algorithm passes it to its local trainer and the
problem's kernels (``mode=``), which group the clients of their call as it says. A problem
never chooses: its ``mode`` keyword defaults to the one it was built with, for calls made
outside a run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

T = TypeVar("T")


#: examples (clients × per-client examples) one vectorised call holds at most by default
MAX_EXAMPLES = 2048


class Vmap:
    """Vectorised groups of clients (see the module docstring). ``max_examples``: at most this
    many examples (clients × per-client examples) in one call; None: no limit."""

    name = "vmap"
    vectorized = True

    def __init__(self, max_examples: int | None = MAX_EXAMPLES) -> None:
        if max_examples is not None and (not isinstance(max_examples, int | np.integer)
                                         or max_examples < 1):
            raise ValueError(f"max_examples must be a positive integer or None, "
                             f"got {max_examples!r}")
        self.max_examples = None if max_examples is None else int(max_examples)

    def __repr__(self) -> str:
        return f"Vmap(max_examples={self.max_examples})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vmap) and other.max_examples == self.max_examples

    def __hash__(self) -> int:
        return hash(("vmap", self.max_examples))


class Loop:
    """One client per call, in cohort order (the reference path)."""

    name = "sequential"
    vectorized = False

    def __repr__(self) -> str:
        return "Loop()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Loop)

    def __hash__(self) -> int:
        return hash("loop")


@runtime_checkable
class Pool(Protocol):
    """An executor of one-client calls (e.g. worker processes)."""

    def map_groups(self, fn: Callable[[np.ndarray], Any], groups: list[np.ndarray]
                   ) -> list: ...


def in_process(mode) -> Vmap | Loop:
    """The mode one process uses for its own clients, as a plain value: a :class:`Vmap`
    (its ``max_examples``), anything else (a loop, a pool whose workers each run one client,
    a transport to remote clients) a :class:`Loop`."""
    return Vmap(mode.max_examples) if isinstance(mode, Vmap) else Loop()


def is_cpu(device) -> bool:
    """Whether ``device`` (a name or a ``torch.device``) is the CPU."""
    return str(device).split(":")[0] == "cpu"


def check_device(mode, device) -> None:
    """A ValueError when ``mode`` runs clients in CPU worker processes (``cpu_only``) and
    ``device`` is not the CPU."""
    if getattr(mode, "cpu_only", False) and not is_cpu(device):
        raise ValueError(f"the {getattr(mode, 'name', type(mode).__name__)} backend runs "
                         f"clients in CPU worker processes; the problem is on {device}: use "
                         "device 'cpu' (or another backend)")


@dataclass(frozen=True)
class Executor:
    """How a run's clients execute, chosen once per run: ``mode`` maps each cohort's clients
    (a :class:`Vmap`, a :class:`Loop`, a pool, or a transport to remote clients) and
    ``device`` is where the problem's tensors live (``cpu``, ``cuda:0``, …). The loop passes
    :attr:`kernel_mode` to every client computation and evaluation (``RoundContext.mode``)."""

    mode: Any = field(default_factory=Vmap)
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", str(self.device))
        check_device(self.mode, self.device)

    @property
    def kernel_mode(self) -> Vmap | Loop:
        """The mode of the clients one call computes (:func:`in_process` of :attr:`mode`)."""
        return in_process(self.mode)

    @classmethod
    def of(cls, problem, mode=None) -> Executor:
        """The executor of ``problem`` when a caller names no device: ``mode`` (None: the
        mode the problem was built with, else :class:`Vmap`) on the problem's device."""
        if mode is None:
            mode = getattr(problem, "mode", None) or Vmap()
        return cls(mode, str(getattr(problem, "device", "cpu")))


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
