"""The fixed cost of a round in partialfl's modes: clients that do no work.

Each client of the cohort (``peers.py``'s 10 FEMNIST writers) returns at once an update of
the EMNIST CNN's θ shapes (6 tensors, 115,646 floats, as FedAvg sends), so a round's time is
what the mode itself costs: handing the clients out, bringing their results back, stacking
them. The same zero-work clients also return that update as numpy arrays, and a one-float
update, to separate the cost of moving the result from the cost of dispatching the client.
Interleaved, best and median of ``--repeats``; ``backend.run`` (the clients' part of a round).

    python benchmarks/peers/overhead.py [--repeats 30] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from partialfl_runner import backend, build  # noqa: E402

WRITERS = [8, 14, 20, 25, 38, 39, 50, 57, 71, 78]  # peers.py's cohort (nn_speed.py's)


class Instant:
    """The wrapped algorithm, with a client that returns ``kind`` at once: ``tensor`` (θ's
    shapes, torch), ``numpy`` (θ's shapes, numpy) or ``tiny`` (one float)."""

    def __init__(self, base, kind: str) -> None:
        self.base, self.kind = base, kind

    def __getattr__(self, n):
        return getattr(self.base, n)

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        import torch

        from partialfl.algorithms.base import ClientResult
        from partialfl.types import ClientUpdates

        k = len(cohort)
        if self.kind == "tiny":
            vec = {"x": np.zeros((k, 1), np.float32)}
        elif self.kind == "numpy":
            vec = {n: np.zeros((k, *v.shape), np.float32) for n, v in state.theta.items()}
        else:
            vec = {n: torch.zeros((k, *v.shape)) for n, v in state.theta.items()}
        return ClientResult(ClientUpdates(vec, np.ones(k), np.asarray(cohort), 1), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["sequential", "processes", "threads"])
    args = ap.parse_args()
    import torch

    from partialfl.algorithms.base import RoundContext

    torch.set_num_threads(1)
    problem, alg, theta0 = build(WRITERS, 0.5, 32, "fedavg", False)
    state = alg.init(problem, theta0)
    cohort, ctx = np.arange(len(WRITERS)), RoundContext(0, 0)
    # one backend per (mode, kind): a process pool restarts for another algorithm object
    runs = {(m, kind): (backend(m, args.workers), Instant(alg, kind)) for m in args.modes
            for kind in ("tensor", "numpy", "tiny")}
    for be, a in runs.values():
        be.run(a, state, problem, cohort, ctx)  # start the pools, warm up
    times: dict = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, (be, a) in runs.items():
            t = time.perf_counter()
            be.run(a, state, problem, cohort, ctx)
            times[key].append(time.perf_counter() - t)
    print(f"{len(WRITERS)} zero-work clients per round, {args.workers} workers; ms per round "
          f"(best / median of {args.repeats})")
    print(f"{'mode':11s} {'θ-shaped tensors':>18s} {'θ-shaped numpy':>16s} {'one float':>12s}")
    for m in args.modes:
        cells = [f"{min(times[m, k]) * 1e3:6.1f} / {np.median(times[m, k]) * 1e3:6.1f}"
                 for k in ("tensor", "numpy", "tiny")]
        print(f"{m:11s} {cells[0]:>18s} {cells[1]:>16s} {cells[2]:>12s}")
    for be, _ in runs.values():
        getattr(be, "close", lambda: None)()


if __name__ == "__main__":
    main()
