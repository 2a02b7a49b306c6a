"""Which client a free worker of a pool mode (threads, processes) runs next.

A round ends when the last worker finishes, so the clients are split into one list per
worker with totals of training examples as equal as possible (a client's time is about
proportional to its examples): longest-processing-time-first, then moves and swaps between the
most and the least loaded list while they shorten the longest. Each worker runs its own
list largest first; a worker whose list is empty takes the smallest client left in the
longest remaining list (stealing), so a slow or dead worker's clients still get run and the
plan adapts when the workers do not run at the same speed (a busy machine). On the FEMNIST
cohort of ``benchmarks/peers.py`` (10 writers, 1,505 examples, 2 workers) the planned lists
hold 757 and 748 examples, where handing out the largest client first to whichever worker is
free gives 775 and 730 (3 % more than half the work for the slower one).

The schedule only decides where and when a client runs, never what it computes: results are
collected in cohort order, bit for bit the sequential backend's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

#: cohorts up to this size get the move/swap refinement (LPT alone is within a client of
#: balance on larger ones, and the refinement is quadratic in a list's length)
REFINE_MAX = 256


def client_sizes(fn, groups: list[np.ndarray]) -> list[int]:
    """Training examples of each group of a :class:`~partialfl.runtime.clients.ClientCall`
    whose problem counts them (``num_examples``), else 1 per group (cohort order)."""
    from partialfl.runtime.clients import ClientCall

    count = getattr(getattr(fn, "problem", None), "num_examples", None)
    if not isinstance(fn, ClientCall) or count is None or not groups:
        return [1] * len(groups)
    per_client = np.asarray(count(fn.cohort[np.concatenate(groups)]), dtype=np.int64)
    ends = np.cumsum([len(g) for g in groups])
    return [int(per_client[e - len(g):e].sum()) for g, e in zip(groups, ends)]


def balance(sizes: Sequence[int], workers: int) -> list[list[int]]:
    """Positions of ``sizes`` in ``workers`` lists with near-equal totals (see the module
    docstring), each largest first (ties in position order)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i))
    lists: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in order:  # LPT
        w = loads.index(min(loads))
        lists[w].append(i)
        loads[w] += int(sizes[i])
    if workers > 1 and len(sizes) <= REFINE_MAX:
        for _ in range(4 * len(sizes)):
            if not _improve(sizes, lists, loads):
                break
    return [sorted(lst, key=lambda i: (-int(sizes[i]), i)) for lst in lists]


def _improve(sizes, lists, loads) -> bool:
    """One move or swap between the most loaded list and another that lowers the larger of
    the two loads the most; False when none lowers it."""
    hi = loads.index(max(loads))
    best, how = loads[hi], None
    for lo in range(len(lists)):
        gap = loads[hi] - loads[lo]
        if lo == hi or gap <= 0:
            continue
        for a in lists[hi]:
            for b in (None, *lists[lo]):
                d = int(sizes[a]) - (0 if b is None else int(sizes[b]))
                if 0 < d < gap and loads[hi] - min(d, gap - d) < best:
                    best, how = loads[hi] - min(d, gap - d), (lo, a, b)
    if how is None:
        return False
    lo, a, b = how
    moved = int(sizes[a]) - (0 if b is None else int(sizes[b]))
    lists[hi].remove(a)
    lists[lo].append(a)
    if b is not None:
        lists[lo].remove(b)
        lists[hi].append(b)
    loads[hi] -= moved
    loads[lo] += moved
    return True


class Schedule:
    """The plan of one round (see the module docstring): :meth:`take` the next group for
    worker ``w``; :meth:`give_back` groups a worker received but never ran (it died)."""

    def __init__(self, sizes: Sequence[int], workers: int) -> None:
        self.sizes = [int(s) for s in sizes]
        self.queues = [deque(lst) for lst in balance(self.sizes, workers)]
        self.loads = [sum(self.sizes[i] for i in q) for q in self.queues]

    @classmethod
    def of(cls, fn, groups: list[np.ndarray], workers: int) -> Schedule:
        """The schedule of ``fn``'s ``groups`` on ``workers`` workers."""
        return cls(client_sizes(fn, groups), workers)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues)

    def take(self, w: int) -> int | None:
        """Worker ``w``'s next group: the largest left in its list, else the smallest left in
        the longest list; None when every group was handed out."""
        if w < len(self.queues) and self.queues[w]:
            i = self.queues[w].popleft()
            self.loads[w] -= self.sizes[i]
            return i
        left = [v for v in range(len(self.queues)) if self.queues[v]]
        if not left:
            return None
        v = max(left, key=lambda u: (self.loads[u], -u))
        i = self.queues[v].pop()
        self.loads[v] -= self.sizes[i]
        return i

    def give_back(self, w: int, groups: Sequence[int]) -> None:
        """Groups handed to worker ``w`` that it never ran: first in its list again (another
        worker takes them if ``w`` does not come back)."""
        w = min(w, len(self.queues) - 1)
        for i in reversed(list(groups)):
            self.queues[w].appendleft(i)
            self.loads[w] += self.sizes[i]
