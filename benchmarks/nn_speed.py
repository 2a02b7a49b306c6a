"""Client updates per second of one FFGG round on FEMNIST: sequential vs vmap backend.

One FFGG round = 10 sampled writers, each fine-tunes its personal w for one epoch of SGD
(batch 32, θ fixed) and then computes ∇_θ of its loss on all its training data (LEAF's CNN by
default). Both backends run in this one process, interleaved, from the same θ and seed:

* ``sequential``: ``SequentialBackend`` + ``ModelProblem(vectorize=False)`` — one client at a
  time, plain (un-padded) minibatches;
* ``vmap``: ``BatchedBackend`` + ``ModelProblem(vectorize=True)`` — ``torch.func.vmap`` over
  the cohort with padded, masked minibatches.

It prints the seconds per round, client updates per second, the largest |θ_vmap − θ_seq|
after one round, and the achieved FLOP/s (useful FLOPs of the round counted with
``torch.utils.flop_counter`` on the sequential path, over the measured time) against the peak
of a 2048×2048 float32 matrix multiply measured in the same run.

    .venv/bin/python benchmarks/nn_speed.py [--model leaf_cnn] [--split output]
        [--threads 1] [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.model import model_ffgg
from partialfl.data.femnist import load_femnist_npz
from partialfl.local.sgd import SGDConfig
from partialfl.models import make_model
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, sample_cohort
from partialfl.split import make_split


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an n×n float32 matmul (2n³ FLOPs)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def plain_floor(split, x: torch.Tensor, y: torch.Tensor, batch: int, chunk: int) -> float:
    """Seconds for the arithmetic of one FFGG round done with plain autograd on ONE module,
    with every client's examples pooled: one epoch of minibatch forward/backward with only w
    trainable, then forward/backward over all examples with only θ trainable. No per-client
    bookkeeping, no functorch; a backend that does this arithmetic cannot beat it by much."""
    model = split.model
    personal = set(split.personal_names)
    params = dict(model.named_parameters())

    def train(names: set[str], bs: int) -> None:
        for n, p in params.items():
            p.requires_grad_(n in names)
            p.grad = None
        for i in range(0, len(y), bs):
            torch.nn.functional.cross_entropy(model(x[i:i + bs]), y[i:i + bs]).backward()

    t = time.perf_counter()
    train(personal, batch)
    train(set(params) - personal, chunk)
    took = time.perf_counter() - t
    for p in params.values():
        p.requires_grad_(True)
        p.grad = None
    return took


def one_round(backend, alg, state, problem, cohort, ctx):
    res = backend.run(alg, state, problem, cohort, ctx, None)
    return alg.server_update(state, res.updates, ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="leaf_cnn")
    ap.add_argument("--split", default="output")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=64,
                    help="examples per client per pass in the full-data gradient")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    data = load_femnist_npz(args.data_dir)
    split = make_split(make_model(args.model, 62, seed=0), args.split, seed=0)
    problems = {
        "sequential": ModelProblem(split, data, vectorize=False, chunk=args.chunk),
        "vmap": ModelProblem(split, data, vectorize=True, chunk=args.chunk),
    }
    backends = {"sequential": SequentialBackend(), "vmap": BatchedBackend()}
    alg = model_ffgg(SGDConfig(lr=0.01, epochs=1, batch_size=32))
    theta0 = problems["sequential"].init_theta()
    state = alg.init(problems["sequential"], theta0)
    cohort = sample_cohort(0, 0, data.num_clients, args.clients)
    ctx = RoundContext(0, 0)

    # same θ after one round
    out = {k: one_round(backends[k], alg, state, problems[k], cohort, ctx) for k in backends}
    diff = max((out["vmap"].theta[n] - out["sequential"].theta[n]).abs().max().item()
               for n in theta0)
    # useful FLOPs of one round (sequential path: no padding)
    with FlopCounterMode(display=False) as fc:
        one_round(backends["sequential"], alg, state, problems["sequential"], cohort, ctx)
    flops = fc.get_total_flops()

    store = problems["sequential"]._store["train"]
    rows = np.concatenate([store.offsets[m] + np.arange(store.sizes[m]) for m in cohort])
    xs, ys = store.x[torch.from_numpy(rows)], store.y[torch.from_numpy(rows)]
    times: dict[str, list[float]] = {k: [] for k in backends}
    peaks, floors = [], []
    for _ in range(args.repeats):
        peaks.append(matmul_peak())
        floors.append(plain_floor(split, xs, ys, 32, max(args.chunk, 256)))
        for k in backends:  # interleaved, so load changes hit both
            t = time.perf_counter()
            one_round(backends[k], alg, state, problems[k], cohort, ctx)
            times[k].append(time.perf_counter() - t)
    peak = max(peaks)
    n_ex = int(problems["sequential"].num_examples(cohort).sum())
    print(f"FFGG round, {args.model}, split {args.split!r} "
          f"({split.counts()['personal_params']:,} personal / "
          f"{split.counts()['global_params']:,} global), {args.clients} clients "
          f"({n_ex} examples), 1 fine-tuning epoch + full-data ∇θ, torch threads "
          f"{args.threads}; best of {args.repeats}")
    print(f"useful work per round: {flops / 1e9:.2f} GFLOP; matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s")
    print(f"{'backend':12s} {'s/round':>9s} {'updates/s':>10s} {'GFLOP/s':>9s} {'% peak':>7s}")
    best = {k: min(v) for k, v in times.items()}
    for k, t in best.items():
        print(f"{k:12s} {t:9.3f} {args.clients / t:10.2f} {flops / t / 1e9:9.1f} "
              f"{100 * flops / t / peak:7.1f}")
    print(f"vmap speed-up over sequential: {best['sequential'] / best['vmap']:.2f}x "
          f"(median of repeats {np.median(times['sequential']) / np.median(times['vmap']):.2f}x)")
    floor = min(floors)
    print(f"plain-autograd floor (same arithmetic on one module, clients pooled): "
          f"{floor:.3f} s -> at most {best['sequential'] / floor:.2f}x over sequential for "
          f"any backend doing this arithmetic")
    print(f"max |θ_vmap − θ_sequential| after one round: {diff:.2e}")


if __name__ == "__main__":
    main()
