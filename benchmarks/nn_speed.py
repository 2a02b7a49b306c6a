"""Seconds per round of FedAvg and FFGG on FEMNIST: sequential, vmap and processes backends
against a plain PyTorch loop.

The setup of issue 11: EMNIST CNN, 10 sampled writers per round, batch 32, client lr 0.5, one
local epoch. FedAvg trains the whole model; FFGG (output split) fine-tunes the personal output
layer for one epoch (θ fixed) and sends ∇_θ on the client's full training data. All runs
happen in this one process (the processes backend forks its workers), interleaved, from the
same θ and seed:

* ``sequential``: ``SequentialBackend`` + ``ModelProblem(vectorize=False)``;
* ``vmap``: ``BatchedBackend`` + ``ModelProblem(vectorize=True)`` (clients batched);
* ``processes``: ``ProcessBackend(workers)`` — the cohort over worker processes, one torch
  thread each (θ equal to sequential bit for bit when sequential runs on one thread);
* ``threads``: ``ThreadBackend(workers)`` — the cohort over threads of this process, one
  torch thread each (same bit-for-bit equality);
* ``plain-loop``: the floor — ONE ``nn.Module``, ``torch.optim.SGD`` (FedAvg: on all
  parameters; FFGG: on the output layer, then one backward over the client's data in chunks
  for ∇θ), the SAME minibatches as the library (its batch plans), no library code in the
  loop.

The last line reads ``processes/sequential: X.XX×  sequential/plain-loop: Y.YY×`` for the
FedAvg round at the first ``--threads`` value: X = sequential seconds / processes seconds
(the speed-up of the process backend), Y = sequential seconds / plain-loop seconds (the
framework overhead); the line before it gives threads/sequential. Timings on a shared
machine are noisy: say so when you report them.

    python benchmarks/nn_speed.py [--threads 1 2] [--workers 2] [--repeats 3]
        [--data-dir DIR | --synthetic] [--quick]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.model import FedAvg, model_ffgg
from partialfl.build import make_model
from partialfl.data.federated import FederatedDataset
from partialfl.local.sgd import SGDConfig, client_plans
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, sample_cohort
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.runtime.threads import ThreadBackend
from partialfl.split import make_split

LR, BATCH, CHUNK = 0.5, 32, 256


def synthetic_femnist(num_clients: int, seed: int = 0, lo: int = 100, hi: int = 300
                      ) -> FederatedDataset:
    """FEMNIST-shaped clients (float32 [n, 1, 28, 28], 62 classes), n ~ U[lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tx, ty, vx, vy = [], [], [], []
    for n in rng.integers(lo, hi, num_clients):
        for xs, ys, k in ((tx, ty, int(n)), (vx, vy, max(1, int(n) // 9))):
            xs.append(torch.randn(k, 1, 28, 28, generator=g))
            ys.append(torch.randint(0, 62, (k,), generator=g))
    return FederatedDataset(tx, ty, vx, vy, [f"s{m}" for m in range(num_clients)], 62,
                            "synthetic FEMNIST-shaped")


def plain_round(alg_name, model: torch.nn.Module, theta, problem, cohort, seed, round_):
    """The floor: one module, torch.optim.SGD, the library's batch plans."""
    stream = "local" if alg_name == "fedavg" else "finetune"
    cfg = SGDConfig(lr=LR, epochs=1, batch_size=BATCH)
    plans = client_plans(problem, cohort, cfg, seed, round_, stream)
    store = problem._store["train"]
    params = dict(model.named_parameters())
    personal = set(problem.w_names)
    out = []
    for m, plan in zip(cohort, plans):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(theta[n] if n in theta else problem.w_pretrained[n])
        trained = [p for n, p in params.items() if alg_name == "fedavg" or n in personal]
        for p in params.values():
            p.requires_grad_(any(p is q for q in trained))
        opt = torch.optim.SGD(trained, lr=LR)
        for b in plan:
            x, y = store.gather(int(m), b)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if alg_name == "ffgg":  # ∇θ of the mean loss over the client's data, in chunks
            for n, p in params.items():
                p.requires_grad_(n not in personal)
                p.grad = None
            n_m = int(problem.num_examples(np.array([m]))[0])
            for j in range(0, n_m, CHUNK):
                x, y = store.gather(int(m), np.arange(j, min(n_m, j + CHUNK)))
                (F.cross_entropy(model(x), y, reduction="sum") / n_m).backward()
        out.append({n: p.detach().clone() for n, p in params.items()})
    for p in params.values():
        p.requires_grad_(True)
    return out


def _runs(alg_name, alg, state, seq_pb, vec_pb, procs, pool, cohort, ctx) -> dict:
    """name -> a function running one round of that backend."""
    floor_model = make_model("emnist_cnn", 62, seed=0)
    runs = {
        "sequential": lambda: SequentialBackend().run(alg, state, seq_pb, cohort, ctx),
        "processes": lambda: procs.run(alg, state, seq_pb, cohort, ctx),
        "threads": lambda: pool.run(alg, state, seq_pb, cohort, ctx),
        "plain-loop": lambda: plain_round(alg_name, floor_model, state.theta, seq_pb, cohort,
                                          0, 0),
    }
    if vec_pb is not None:
        runs["vmap"] = lambda: BatchedBackend().run(alg, state, vec_pb, cohort, ctx)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--synthetic", action="store_true",
                    help="FEMNIST-shaped random clients instead of the real subset")
    ap.add_argument("--no-vmap", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny clients, 1 repeat")
    args = ap.parse_args()

    if args.quick:
        data = synthetic_femnist(max(args.clients, 4), lo=20, hi=40)
        args.repeats = 1
    elif args.synthetic:
        data = synthetic_femnist(100)
    else:
        from partialfl.data.femnist import load_femnist_npz

        data = load_femnist_npz(args.data_dir)
    cohort = sample_cohort(0, 0, data.num_clients, args.clients)
    ctx = RoundContext(0, 0)
    cfg = SGDConfig(lr=LR, epochs=1, batch_size=BATCH)
    n_ex = int(data.train_sizes()[cohort].sum())
    print(f"{data.num_clients} clients ({data.description or 'FEMNIST'}); cohort of "
          f"{args.clients} with {n_ex} train examples; EMNIST CNN, batch {BATCH}, lr {LR}, "
          f"1 epoch; processes: {args.workers} workers x 1 thread; best of {args.repeats}")
    summary = {}
    for alg_name in ("fedavg", "ffgg"):
        split = make_split(make_model("emnist_cnn", 62, seed=0),
                           "none" if alg_name == "fedavg" else "output", seed=0)
        seq_pb = ModelProblem(split, data, vectorize=False, chunk=CHUNK)
        vec_pb = ModelProblem(split, data, vectorize=True, chunk=CHUNK)
        alg = FedAvg(cfg) if alg_name == "fedavg" else model_ffgg(cfg)
        state = alg.init(seq_pb, seq_pb.init_theta())
        procs = ProcessBackend(workers=args.workers)
        pool = ThreadBackend(workers=args.workers)
        runs = _runs(alg_name, alg, state, seq_pb, None if args.no_vmap else vec_pb, procs,
                     pool, cohort, ctx)
        # correctness first: processes and threads = sequential bit for bit on one thread
        torch.set_num_threads(1)
        a = runs["sequential"]()
        for k in ("processes", "threads"):
            b = runs[k]()
            diff = max(float((a.updates.vectors[n] - b.updates.vectors[n]).abs().max())
                       for n in a.updates.vectors)
            print(f"\n{alg_name}: max |update_{k} - update_sequential| = {diff:.1e}")
        print(f"{'threads':>7s} {'backend':12s} {'s/round':>8s} {'updates/s':>10s}")
        for threads in args.threads:
            torch.set_num_threads(threads)
            for fn in runs.values():  # warm-up (kernel setup, first-call costs), not timed
                fn()
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.repeats):
                for k, fn in runs.items():  # interleaved, so load changes hit all
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
            best = {k: min(v) for k, v in times.items()}
            for k, t in best.items():
                print(f"{threads:7d} {k:12s} {t:8.3f} {args.clients / t:10.2f}")
            seq = best["sequential"]
            print(f"{threads:7d} processes/sequential {seq / best['processes']:.2f}x  "
                  f"threads/sequential {seq / best['threads']:.2f}x  "
                  f"sequential/plain-loop {seq / best['plain-loop']:.2f}x"
                  + (f"  vmap/sequential {seq / best['vmap']:.2f}x" if "vmap" in best else ""))
            summary.setdefault(alg_name, (seq / best["processes"], seq / best["plain-loop"],
                                          seq / best["threads"]))
        procs.close()
        pool.close()
    x, y, z = summary["fedavg"]
    print(f"\nFedAvg round, {args.threads[0]} thread(s):")
    print(f"threads/sequential: {z:.2f}×")
    print(f"processes/sequential: {x:.2f}×  sequential/plain-loop: {y:.2f}×")


if __name__ == "__main__":
    main()
