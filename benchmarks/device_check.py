"""One-call check of the accelerator path: CPU-vs-GPU agreement of θ and backend timings.

1. **Agreement.** The same FFGG run (output-layer split, 10 clients per round, one epoch of
   SGD fine-tuning, then ∇_θ on each client's data) on the CPU (sequential backend, the
   reference path) and on the GPU (sequential and vmap backends, fp32 with TF32 off; bf16
   autocast is reported, not checked). Every random draw comes from CPU generators derived
   from (seed, round, client), so the runs take the same steps. Checked: after ONE round θ
   agrees to ``--tol1`` (relative L2: the arithmetic is the same up to summation order);
   after ``--rounds`` rounds (default 20) θ is no farther from the CPU's than
   ``--tol-factor`` × the distance between the CPU's own sequential and vmap paths (the
   noise floor: a ReLU/max-pool network amplifies rounding differences from round to round,
   measured 1e-8 → 1e-6 over 10 rounds on the CPU alone) or 1e-3, whichever is larger, and
   the test accuracy after it agrees to 1 point.
2. **Timing.** Seconds per FFGG round of the sequential and the vmap backend for 10 and 100
   clients per round (on the GPU with default TF32 settings; and on the CPU for 10 clients),
   one warm-up round then ``--repeats`` timed rounds, in this one process, and the
   vmap/sequential ratio.

On a machine without a GPU the CPU half runs and the GPU half is reported as skipped.

Data: synthetic FEMNIST-shaped clients (28×28 images in [0, 1], 62 classes, 100–180 training
examples per client, class prototypes plus noise, a per-client label shift) so that 100
clients per round exist; or the shared FEMNIST writers with ``--data-dir`` (84 clients).

    python benchmarks/device_check.py [--quick] [--json out.json] [--model leaf_cnn]
        [--table quick full --data-dir DIR]

3. **The FEMNIST table** (``--table quick full``): the wall-clock time of ``partialfl
   reproduce femnist-table`` on the device with the vmap backend, and each row's accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from partialfl.algorithms.model import model_ffgg
from partialfl.build import make_model
from partialfl.data.federated import FederatedDataset
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.server import SGD
from partialfl.split import make_split


def synthetic_femnist(num_clients: int, seed: int = 0, classes: int = 62) -> FederatedDataset:
    """FEMNIST-shaped clients: x = prototype[y] + noise, labels shifted per client."""
    rng = np.random.default_rng(seed)
    protos = rng.random((classes, 1, 28, 28)).astype(np.float32)
    tx, ty, vx, vy = [], [], [], []
    for _ in range(num_clients):
        shift = int(rng.integers(classes))
        for xs, ys, n in ((tx, ty, int(rng.integers(100, 181))), (vx, vy, 20)):
            y = rng.integers(0, classes, n)
            x = protos[(y + shift) % classes] + 0.5 * rng.standard_normal((n, 1, 28, 28))
            xs.append(torch.from_numpy(np.clip(x, 0, 1).astype(np.float32)))
            ys.append(torch.from_numpy(y.astype(np.int64)))
    return FederatedDataset(tx, ty, vx, vy, [f"s{i}" for i in range(num_clients)], classes,
                            "synthetic FEMNIST-shaped clients")


def load_data(args) -> FederatedDataset:
    if args.data_dir:
        from partialfl.data.femnist import load_femnist_npz

        return load_femnist_npz(data_dir=args.data_dir)
    return synthetic_femnist(args.clients)


def _backend(device: str, backend: str):
    """The run's one batching mode: vmap groups of up to 2^15 examples on an accelerator."""
    if backend != "vmap":
        return SequentialBackend()
    return BatchedBackend((1 << 15) if device != "cpu" else 2048)


def _problem(data, args, device: str, backend: str, precision: str = "fp32") -> ModelProblem:
    model = make_model(args.model, data.num_classes, seed=0)
    split = make_split(model, "output")
    return ModelProblem(split, data, mode=_backend(device, backend), device=device,
                        precision=precision, chunk=args.chunk)


def _algorithm():
    return model_ffgg(SGDConfig(lr=0.05, epochs=1, batch_size=32), server_opt=SGD(lr=0.1))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ffgg_run(data, args, device: str, backend: str, rounds: int, k: int,
             precision: str = "fp32") -> tuple[dict[str, torch.Tensor], float]:
    """θ after ``rounds`` FFGG rounds (k clients per round), on the host, and the pooled
    test accuracy of the personalized models then (every client fine-tunes its w)."""
    p = _problem(data, args, device, backend, precision)
    be = _backend(device, backend)
    res = run_rounds(p, _algorithm(), rounds, clients_per_round=k, seed=args.seed, backend=be,
                     evaluate=round_evaluator(("test",)), eval_every=max(1, rounds))
    theta = {n: v.detach().cpu().double() for n, v in res.state.theta.items()}
    return theta, float(res.history[-1]["test_acc"])


def rel_dist(a: dict, b: dict) -> float:
    num = sum(float(((a[n] - b[n]) ** 2).sum()) for n in a)
    den = sum(float((a[n] ** 2).sum()) for n in a)
    return math.sqrt(num / max(den, 1e-300))


def round_seconds(data, args, device: str, backend: str, k: int) -> float:
    """Mean seconds of one FFGG round with k clients (after one warm-up round)."""
    p = _problem(data, args, device, backend)
    be = _backend(device, backend)
    alg = _algorithm()
    run_rounds(p, alg, 1, clients_per_round=k, seed=args.seed, backend=be)  # warm-up
    _sync(device)
    t = time.perf_counter()
    run_rounds(p, alg, args.repeats, clients_per_round=k, seed=args.seed + 1, backend=be)
    _sync(device)
    return (time.perf_counter() - t) / args.repeats


def time_tables(args) -> dict:
    """3. Wall-clock seconds of ``partialfl reproduce femnist-table`` at each size of
    ``args.table`` on the accelerator (the CPU without one), vmap backend, each into a fresh
    folder; the pooled test accuracy of every row (mean over seeds) with it."""
    import shutil

    from partialfl.reproductions.femnist import reproduce_table

    if args.data_dir is None:
        raise SystemExit("--table needs --data-dir (the folder with femnist_leaf_subset.npz)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for name in args.table:
        folder = Path(args.table_out) / name
        shutil.rmtree(folder, ignore_errors=True)
        t = time.perf_counter()
        reproduce_table(folder, quick=name != "full", seeds=[0] if name == "tiny" else None,
                        data_dir=Path(args.data_dir), progress=False, backend="vmap",
                        device=device, workers=args.table_workers)
        seconds = time.perf_counter() - t
        results = json.loads((folder / "results.json").read_text())
        rows = results["results"]
        acc = {label: float(np.mean([m["test_acc"] for m in per_seed]))
               for label, per_seed in rows.items()
               if isinstance(per_seed, list) and per_seed and isinstance(per_seed[0], dict)
               and "test_acc" in per_seed[0]}
        out[name] = {"device": device, "seconds": seconds, "test_acc": acc,
                     "workers": args.table_workers}
        print(f"  femnist-table {name} on {device} (vmap): {seconds:.1f} s; "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in acc.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="leaf_cnn")
    ap.add_argument("--clients", type=int, default=120, help="synthetic clients (>= 100)")
    ap.add_argument("--data-dir", default=None, help="use the shared FEMNIST writers instead")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the agreement check")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement")
    ap.add_argument("--cohorts", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--tol1", type=float, default=1e-5, help="after one round")
    ap.add_argument("--tol-factor", type=float, default=10.0,
                    help="after --rounds: × the CPU's own sequential-vs-vmap distance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke size: 6 clients, 2 rounds, 3 per round, emnist_cnn")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--table", nargs="+", choices=["tiny", "quick", "full"], default=[],
                    help="3. also time `partialfl reproduce femnist-table` at these sizes on "
                         "the device (vmap backend; tiny: 1 seed of the quick size, for a "
                         "smoke run on a CPU); needs --data-dir")
    ap.add_argument("--table-out", default="device-check-tables",
                    help="folder for the tables' runs (each size in a subfolder)")
    ap.add_argument("--table-workers", type=int, default=None,
                    help="parallel runs of the tables (processes sharing the device)")
    ap.add_argument("--skip-agreement", action="store_true",
                    help="only the table timings (3.)")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.repeats, args.cohorts = 6, 2, 1, [3]
        args.model = "emnist_cnn"
    if args.skip_agreement:
        out = {"torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
        out["tables"] = time_tables(args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        out["agreement_ok"] = True
        return out
    data = load_data(args)
    M = data.num_clients
    cohorts = [k for k in args.cohorts if k <= M]
    k_agree = min(10, M)
    gpu = torch.cuda.is_available()
    out: dict = {"model": args.model, "clients": M, "rounds": args.rounds,
                 "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
                 "gpu": torch.cuda.get_device_name(0) if gpu else None}
    print(f"device check: {args.model}, {M} clients, torch {torch.__version__}, "
          f"{'GPU ' + out['gpu'] if gpu else 'no GPU'}", flush=True)

    # 1. agreement ----------------------------------------------------------------------
    t = time.perf_counter()
    ref1, _ = ffgg_run(data, args, "cpu", "sequential", 1, k_agree)
    ref, acc_ref = ffgg_run(data, args, "cpu", "sequential", args.rounds, k_agree)
    print(f"  CPU sequential reference: {args.rounds} rounds in "
          f"{time.perf_counter() - t:.1f} s, test accuracy {100 * acc_ref:.2f}%", flush=True)
    runs = [("cpu", "vmap", "fp32")]
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        runs += [("cuda", "sequential", "fp32"), ("cuda", "vmap", "fp32"),
                 ("cuda", "vmap", "bf16")]
    agree: dict = {}
    for dev, be, prec in runs:
        try:
            th1, _ = ffgg_run(data, args, dev, be, 1, k_agree, prec)
            th, acc = ffgg_run(data, args, dev, be, args.rounds, k_agree, prec)
        except Exception as e:  # report and go on: one failing path must not hide the others
            print(f"  {dev}_{be}_{prec}: FAILED with {type(e).__name__}: {e}", flush=True)
            th1 = th = {n: torch.full_like(v, float("nan")) for n, v in ref.items()}
            acc = float("nan")
        agree[f"{dev}_{be}_{prec}"] = {"round1": rel_dist(ref1, th1),
                                       f"round{args.rounds}": rel_dist(ref, th),
                                       "test_acc_diff": acc - acc_ref}
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    floor = agree["cpu_vmap_fp32"][f"round{args.rounds}"]
    tol_r = max(1e-3, args.tol_factor * floor)
    ok = True
    for name, a in agree.items():
        checked = not name.endswith("bf16") and name != "cpu_vmap_fp32"
        good = bool(a["round1"] <= args.tol1 and a[f"round{args.rounds}"] <= tol_r
                    and abs(a["test_acc_diff"]) <= 0.01)
        if name == "cpu_vmap_fp32":
            good = a["round1"] <= args.tol1
        a["checked"] = checked or name == "cpu_vmap_fp32"
        a["ok"] = good if a["checked"] else None
        if a["checked"]:
            ok &= good
        print(f"  {name:22s} vs CPU sequential: ‖Δθ‖/‖θ‖ after 1 round {a['round1']:.1e}, "
              f"after {args.rounds} {a[f'round{args.rounds}']:.1e}; test accuracy "
              f"{100 * a['test_acc_diff']:+.2f} points"
              f"{'' if a['checked'] else ' (not checked)'}", flush=True)
    out["agreement"] = agree
    out["agreement_ok"] = ok
    print(f"  agreement {'OK' if ok else 'FAILED'} (1 round ≤ {args.tol1:g}; {args.rounds} "
          f"rounds ≤ {tol_r:.1e} = max(1e-3, {args.tol_factor:g} × CPU floor {floor:.1e}); "
          f"accuracy within 1 point)")

    # 2. timing -------------------------------------------------------------------------
    timing: dict = {}
    for dev in (["cuda"] if gpu else []) + ["cpu"]:
        for k in cohorts if dev != "cpu" else cohorts[:1]:
            row = {be: round_seconds(data, args, dev, be, k) for be in ("sequential", "vmap")}
            row["vmap_speedup"] = row["sequential"] / row["vmap"]
            timing[f"{dev} k={k}"] = row
            print(f"  {dev:4s} {k:3d} clients/round: sequential {row['sequential']:.3f} s, "
                  f"vmap {row['vmap']:.3f} s per round → vmap/sequential speed "
                  f"{row['vmap_speedup']:.2f}×", flush=True)
    out["seconds_per_round"] = timing
    if not gpu:
        out["gpu_half"] = "skipped: no CUDA GPU on this machine"
        print("  GPU half skipped: no CUDA GPU on this machine")
    if args.table:
        out["tables"] = time_tables(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    res = main()
    raise SystemExit(0 if res["agreement_ok"] else 1)
