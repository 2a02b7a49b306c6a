"""FFGG round speed on the paper's Example 1: paper-faithful reference vs partialfl.

Same configuration through two paths, in one run (32 clients, n = 10000, d_θ = 100, d_w = 50,
τ = 40 CG iterations from w = 0, server stepsize 1/L, full participation, 50 rounds):

* reference — as the paper describes: per client, SciPy's ``cg`` on the raw n×d matrices
  (operator v ↦ B_mᵀ(B_m v), right-hand side B_mᵀ(y_m − A_mθ), exactly τ iterations), then
  ∇₁f_m = H_mᵀ(H_mθ − b_m) + A_mᵀ(A_mθ + B_m w − y_m); the server averages and steps.
* partialfl — ``run_rounds`` with ``FFGG(ConjugateGradient(40))`` on ``LeastSquaresProblem``
  (sufficient statistics, clients batched, personal coordinates in each Q_m's eigenbasis),
  and the same in the standard basis (dense batched mat-vecs) for comparison.

Prints seconds per round for each path, the speed-up ratios, and the largest relative
difference ‖θʳ_lib − θʳ_ref‖ / ‖θʳ_ref‖ over all rounds.

    python benchmarks/ls_speed.py [--rounds 50] [--tau 40] [--ref-rounds 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.sparse.linalg import LinearOperator, cg

from partialfl.algorithms import FFGG
from partialfl.local import ConjugateGradient
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec, generate_raw
from partialfl.runtime import run_rounds
from partialfl.server import SGD


def reference_rounds(raw, theta0, gamma, tau, rounds):
    """Paper-faithful FFGG: per-client SciPy CG on the raw matrices. Returns all iterates."""
    theta = theta0.copy()
    iterates = []
    for _ in range(rounds):
        grads = []
        for H, b, A, B, y in raw:
            op = LinearOperator((B.shape[1], B.shape[1]), matvec=lambda v, B=B: B.T @ (B @ v),
                                dtype=np.float64)
            w, _ = cg(op, B.T @ (y - A @ theta), x0=np.zeros(B.shape[1]), rtol=0.0, atol=0.0,
                      maxiter=tau)
            grads.append(H.T @ (H @ theta - b) + A.T @ (A @ theta + B @ w - y))
        theta = theta - gamma * np.mean(grads, axis=0)
        iterates.append(theta.copy())
    return iterates


def library_rounds(problem, gamma, tau, rounds):
    iterates = []
    alg = FFGG(ConjugateGradient(tau), SGD(gamma))
    t0 = time.perf_counter()
    run_rounds(problem, alg, rounds, on_round=lambda r, s: iterates.append(s.theta["theta"].copy()))
    return iterates, (time.perf_counter() - t0) / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tau", type=int, default=40)
    ap.add_argument("--ref-rounds", type=int, default=None,
                    help="rounds timed on the reference path (default: all)")
    args = ap.parse_args()
    spec = LeastSquaresSpec()  # the paper's sizes, seed 0
    print(f"Example 1: M={spec.num_clients}, n={spec.n}, d_theta={spec.d_theta}, "
          f"d_w={spec.d_w}; FFGG with tau={args.tau} CG iterations, {args.rounds} rounds")

    t0 = time.perf_counter()
    problem = LeastSquaresProblem(spec)
    t_stats = time.perf_counter() - t0
    standard = LeastSquaresProblem(spec, basis="standard")
    raw = list(generate_raw(spec))
    gamma = 1.0 / problem.L
    theta0 = np.zeros(spec.d_theta)

    ref_rounds = args.ref_rounds or args.rounds
    t0 = time.perf_counter()
    ref = reference_rounds(raw, theta0, gamma, args.tau, ref_rounds)
    t_ref = (time.perf_counter() - t0) / ref_rounds

    lib, t_lib = library_rounds(problem, gamma, args.tau, args.rounds)
    lib_std, t_std = library_rounds(standard, gamma, args.tau, args.rounds)
    # the library's timings are best of 3 (the runs are short)
    t_lib = min(t_lib, *(library_rounds(problem, gamma, args.tau, args.rounds)[1] for _ in "ab"))
    t_std = min(t_std, *(library_rounds(standard, gamma, args.tau, args.rounds)[1]
                         for _ in "ab"))

    def rel_diff(a, b):
        return max(np.linalg.norm(x - y) / np.linalg.norm(y) for x, y in zip(a, b))

    print(f"reference (per-client SciPy CG on raw matrices): {t_ref * 1e3:9.3f} ms/round "
          f"({ref_rounds} rounds)")
    print(f"partialfl, eigenbasis (default):                {t_lib * 1e3:9.3f} ms/round")
    print(f"partialfl, standard basis:                      {t_std * 1e3:9.3f} ms/round")
    print(f"one-off sufficient statistics:                  {t_stats:9.3f} s")
    print(f"speed-up vs reference: {t_ref / t_lib:8.1f}x (eigenbasis), "
          f"{t_ref / t_std:8.1f}x (standard basis)")
    print(f"max relative iterate difference vs reference over {len(ref)} rounds: "
          f"{rel_diff(lib[:len(ref)], ref):.2e} (eigenbasis), "
          f"{rel_diff(lib_std[:len(ref)], ref):.2e} (standard basis)")


if __name__ == "__main__":
    main()
