"""Round time and peak memory as the federation grows past RAM (client store on disk).

Synthetic FEMNIST-shaped clients: 28×28 uint8 images, 10 examples each (8 train, 2 test; so
M = 1e6 clients is 7.8 GB on disk), random labels in 0..61, written with
:class:`partialfl.data.store.StoreWriter` (read back as float32 / 255). For each
M ∈ {1e2, 1e3, 1e4, 1e5, 1e6} up to ``--max-clients``: a fresh process opens the store and
runs rounds of 10 sampled clients with the EMNIST CNN (output layer personal) for

* FFGG (one fine-tuning epoch of w, then ∇θ on the client's data), and
* FedAlt with its personal layers (w_m, 63,550 floats per client) kept on disk
  (:class:`partialfl.algorithms.disk_state.OnDiskClientState`, a sparse file);

and reports the median wall-clock and CPU seconds per round (after one warm-up round) and
the process's peak RSS. The store and the client state are deleted afterwards. The last line reads
``M=<largest>: round time X.XX× of M=1e2, peak RSS N MiB`` (the worse of the two algorithms).

    python benchmarks/scale.py [--max-clients 100000] [--rounds 5] [--dir /tmp] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = (100, 1_000, 10_000, 100_000, 1_000_000)
TRAIN, TEST, BLOCK = 8, 2, 1000


def _e(m: int) -> str:
    return f"1e{len(str(m)) - 1}" if str(m).strip("0") == "1" else str(m)


def write_clients(path: Path, m: int, seed: int = 0) -> float:
    """Write m synthetic clients; returns seconds."""
    from partialfl.data.store import StoreWriter

    try:
        from tqdm.auto import tqdm
    except ImportError:  # a bare machine: no progress bar
        def tqdm(it, **_):
            return it

    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    with StoreWriter(path, num_classes=62, x_scale=1 / 255,
                     description=f"synthetic FEMNIST-shaped, {m} clients") as w:
        for start in tqdm(range(0, m, BLOCK), desc=f"writing M={_e(m)}", leave=False,
                          mininterval=1.0):
            b = min(BLOCK, m - start)
            x = rng.integers(0, 256, (b, TRAIN + TEST, 1, 28, 28), dtype=np.uint8)
            y = rng.integers(0, 62, (b, TRAIN + TEST))
            for i in range(b):
                w.add(f"c{start + i}", x[i, :TRAIN], y[i, :TRAIN], x[i, TRAIN:], y[i, TRAIN:])
    return time.perf_counter() - t


def child(store: str, algorithm: str, rounds: int, state_dir: str) -> None:
    """Runs in a fresh process: rounds of one algorithm, then prints JSON."""
    import torch

    from partialfl.algorithms.base import RoundContext
    from partialfl.algorithms.disk_state import OnDiskClientState
    from partialfl.algorithms.model import FedAlt, model_ffgg
    from partialfl.build import make_model
    from partialfl.data.store import open_store
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.runtime import SequentialBackend, sample_cohort
    from partialfl.split import make_split

    torch.set_num_threads(1)
    data = open_store(store)
    pb = ModelProblem(make_split(make_model("emnist_cnn", 62, seed=0), "output"), data,
                      vectorize=False)
    cfg = SGDConfig(lr=0.05, epochs=1, batch_size=32)
    alg = (model_ffgg(cfg) if algorithm == "ffgg"
           else OnDiskClientState(FedAlt(cfg), Path(state_dir) / "fedalt-state"))
    state = alg.init(pb, pb.init_theta())
    cs = alg.init_client_state(pb)
    backend = SequentialBackend()
    times, cpu = [], []
    for r in range(rounds + 1):
        t, c = time.perf_counter(), time.process_time()
        cohort = sample_cohort(0, r, pb.num_clients, 10)
        rows = None if cs is None else {n: v[cohort] for n, v in cs.items()}
        res = backend.run(alg, state, pb, cohort, RoundContext(0, r), rows)
        if cs is not None:
            for n, v in res.client_state.items():
                cs[n][cohort] = v
        state = alg.server_update(state, res.updates, RoundContext(0, r))
        if r:  # round 0 warms up
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    print(json.dumps({"s_per_round": float(np.median(times)),
                      "cpu_s_per_round": float(np.median(cpu)), "peak_rss_mib": peak_rss_mib()}))


def peak_rss_mib() -> float:
    """This process's peak resident memory: VmHWM (Linux; ru_maxrss would also count the
    parent's memory at fork, inherited across exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    scale = 1024 if sys.platform.startswith("linux") else 1024 * 1024  # KiB or bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-clients", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the stores (default: a temp "
                    "folder); each is deleted after use")
    ap.add_argument("--quick", action="store_true", help="smoke run: M up to 1e3, 2 rounds")
    ap.add_argument("--child", nargs=3, metavar=("STORE", "ALG", "STATE_DIR"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.rounds, args.child[2])
        return
    if args.quick:
        args.max_clients, args.rounds = min(args.max_clients, 1_000), 2
    sizes = [m for m in SIZES if m <= args.max_clients]
    if not sizes:
        ap.error(f"--max-clients must be at least {SIZES[0]}")
    root = Path(tempfile.mkdtemp(prefix="partialfl-scale-", dir=args.dir))
    results: dict[tuple[int, str], dict] = {}
    print(f"{'M':>9s} {'algorithm':9s} {'s/round':>8s} {'CPU s/round':>12s} "
          f"{'peak RSS MiB':>13s}  (store write s)")
    try:
        for m in sizes:
            store = root / f"store-{m}"
            wrote = write_clients(store, m)
            for alg in ("ffgg", "fedalt"):
                state_dir = root / f"state-{m}-{alg}"
                out = subprocess.run(
                    [sys.executable, __file__, "--rounds", str(args.rounds), "--child",
                     str(store), alg, str(state_dir)], capture_output=True, text=True,
                    check=False)
                if out.returncode:
                    raise SystemExit(f"child for M={m} {alg} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results[(m, alg)] = res
                shutil.rmtree(state_dir, ignore_errors=True)
                print(f"{_e(m):>9s} {alg:9s} {res['s_per_round']:8.3f} "
                      f"{res['cpu_s_per_round']:12.3f} {res['peak_rss_mib']:13.0f}  "
                      f"({wrote:.1f})", flush=True)
            shutil.rmtree(store)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    big = sizes[-1]
    ratio = max(results[(big, a)]["s_per_round"] / results[(sizes[0], a)]["s_per_round"]
                for a in ("ffgg", "fedalt"))
    rss = max(results[(big, a)]["peak_rss_mib"] for a in ("ffgg", "fedalt"))
    cpu = max(results[(big, a)]["cpu_s_per_round"] / results[(sizes[0], a)]["cpu_s_per_round"]
              for a in ("ffgg", "fedalt"))
    print(f"(CPU time per round: {cpu:.2f}× of M=1e2 — less sensitive to other load than the "
          "wall-clock ratio)")
    print(f"M={_e(big)}: round time {ratio:.2f}× of M=1e2, peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
