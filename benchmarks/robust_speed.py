"""Robust aggregation speed: partialfl's rules vs the reference library byzfl (0.0.11).

n = 25 input vectors of dimension d = 10⁶ (float64, standard normal, f of them shifted far
away), one thread (BLAS, OpenMP and torch), each rule called ``--repeats`` times on numpy
input, ours and byzfl's alternately (so both see the same machine load); the best time is
kept. byzfl is optional (``pip install byzfl==0.0.11 --no-deps``; loaded without its package
``__init__``, which needs torchvision for its own benchmark). The load average is printed
before and after.

byzfl's pre-aggregators (NNM, ARC, static clipping) modify the array they are given; each
library gets a fresh copy every call, and ours clip that copy in place too (``out=``; the
rules never modify a caller's array otherwise).

Pairs (ours ↔ byzfl) with the conventions aligned (see :mod:`partialfl.aggregation.rules`):
Krum(f) ↔ Krum(f + 1); multi-Krum (m = n − f − 1) ↔ MultiKrum(f + 1); GM ↔ GeometricMedian
(ours: smoothed Weiszfeld to tol 1e-7, byzfl: its default 3 steps); NNM ↔ NNM; CM ↔ Median;
TM ↔ TrMean; CC (zero start, τ = 1, 3 iterations) ↔ CenteredClipping; MoNNA trusting input 0
(``index=0``) ↔ MoNNA (idx 0); MDA, Meamed, CAF, SMEA, ARC, static clipping ↔ the same names.

Prints one line per rule: seconds for each library and byzfl/ours (> 1: ours is faster).

    python benchmarks/robust_speed.py [--d 1000000] [--n 25] [--f 2] [--repeats 3] [--rules krum,gm]
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy loads its BLAS

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from partialfl.aggregation import (  # noqa: E402
    ARC,
    CAF,
    MDA,
    SMEA,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Meamed,
    Mean,
    MoNNA,
    NearestNeighborMixing,
    StaticClipping,
    TrimmedMean,
)


def pairs(n: int, f: int, byzfl):
    """name -> (ours, byzfl's or None)."""
    A, P, _ = byzfl if byzfl else (None, None, None)
    delta = f / n + 1e-9  # ⌊δn⌋ = f
    theirs = {}
    if A is not None:
        theirs = {
            "krum": A.Krum(f + 1), "multi-krum": A.MultiKrum(f + 1),
            "gm": A.GeometricMedian(), "nnm": P.NNM(f), "cm": A.Median(), "tm": A.TrMean(f),
            "cc": A.CenteredClipping(L=3, tau=1.0), "mda": A.MDA(f), "monna": A.MoNNA(f),
            "meamed": A.Meamed(f), "caf": A.CAF(f), "smea": A.SMEA(f), "arc": P.ARC(f),
            "clip": P.Clipping(1.0),
        }
    rules = {
        "krum": Krum(delta), "multi-krum": Krum(delta, m=n - f - 1), "gm": GeometricMedian(),
        "cm": CoordinateMedian(), "tm": TrimmedMean(delta),
        "cc": CenteredClipping(tau=1.0, iters=3, init="zero"), "mda": MDA(delta),
        "monna": MoNNA(delta, index=0), "meamed": Meamed(delta), "caf": CAF(delta),
        "smea": SMEA(delta),
    }
    ours = {k: (lambda Y, r=r: r(Y, None)) for k, r in rules.items()}
    ours |= {"nnm": NearestNeighborMixing(Mean(), delta).transform}
    for name, pre in (("arc", ARC(Mean(), delta)), ("clip", StaticClipping(Mean(), 1.0))):
        ours[name] = lambda Y, pre=pre: pre.transform(Y, out=Y)  # in place, as byzfl
    return {k: (v, theirs.get(k)) for k, v in ours.items()}


def best_times(fns, X, repeats: int) -> list[float]:
    """The best time of each function over ``repeats`` rounds, the functions alternating."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            Y = X.copy()  # byzfl's pre-aggregators modify their input in place
            t0 = time.perf_counter()
            fn(Y)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=25)
    ap.add_argument("--d", type=int, default=1_000_000)
    ap.add_argument("--f", type=int, default=2, help="Byzantine inputs (shifted far away)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rules", default="krum,gm,nnm,multi-krum,cm,tm,cc,mda,monna,meamed,caf,"
                                       "arc,clip,smea")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _byzfl import load_byzfl

    byzfl = load_byzfl()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    X = np.random.default_rng(0).standard_normal((args.n, args.d))
    X[: args.f] += 100.0
    table = pairs(args.n, args.f, byzfl)
    print(f"n = {args.n}, d = {args.d:,}, f = {args.f}, one thread, best of {args.repeats} "
          f"(interleaved); byzfl {'found' if byzfl else 'NOT installed'}; load average "
          f"{_load()}")
    print(f"{'rule':<11} {'partialfl s':>12} {'byzfl s':>10} {'byzfl/ours':>11}")
    for name in args.rules.split(","):
        ours, theirs = table[name]
        if theirs is None:
            t_ours, = best_times([ours], X, args.repeats)
            print(f"{name:<11} {t_ours:12.3f} {'-':>10} {'-':>11}", flush=True)
            continue
        t_ours, t_theirs = best_times([ours, theirs], X, args.repeats)
        print(f"{name:<11} {t_ours:12.3f} {t_theirs:10.3f} {t_theirs / t_ours:11.2f}", flush=True)
    print(f"load average after: {_load()}")


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
