"""Round time and peak memory as the federation grows past RAM (client store on disk).

Synthetic FEMNIST-shaped clients: 28×28 uint8 images, 10 examples each (8 train, 2 test; so
M = 1e6 clients is 7.8 GB on disk), random labels in 0..61, written with
:meth:`partialfl.data.store.StoreWriter.add_many` in blocks of 10,000 clients (read back as
float32 / 255). For each M ∈ {1e2, 1e3, 1e4, 1e5, 1e6} up to ``--max-clients``: a fresh process
opens the store (timed: the first open computes the CRC-32s, later ones reuse the remembered
check) and runs rounds of 10 sampled clients with the EMNIST CNN (output layer personal) for

* FFGG (one fine-tuning epoch of w, then ∇θ on the client's data), and
* FedAlt, FedSim (personal layers w_m, 63,550 floats per client) and Scaffold (control
  variates c_m of the whole model, 115,646 floats per client) with their client state on disk
  (:class:`partialfl.algorithms.disk_state.OnDiskClientState`, sparse files);

and reports the median wall-clock and CPU seconds per round (after one warm-up round), the
process's peak RSS, and the client-state bytes moved per round. The store and the client state
are deleted afterwards. Then, per algorithm, the round time at the largest M ÷ at M = 1e2, and
the store write rate (clients/s in the writer, without generating the random data). The last
line reads ``M=<largest>: round time X.XX× of M=1e2 (worst: ALG), peak RSS N MiB, store write
N clients/s``.

    python benchmarks/scale.py [--max-clients 100000] [--rounds 20] [--dir /tmp] [--quick]
        [--algorithms ffgg,fedalt,fedsim,scaffold]
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
ALGORITHMS = ("ffgg", "fedalt", "fedsim", "scaffold")
TRAIN, TEST, BLOCK = 8, 2, 10_000


def _e(m: int) -> str:
    return f"1e{len(str(m)) - 1}" if str(m).strip("0") == "1" else str(m)


def write_clients(path: Path, m: int, seed: int = 0) -> tuple[float, float, float]:
    """Write m synthetic clients; returns (seconds in the writer, CPU seconds in the writer,
    seconds in all)."""
    from partialfl.data.store import StoreWriter

    try:
        from tqdm.auto import tqdm
    except ImportError:  # a bare machine: no progress bar
        def tqdm(it, **_):
            return it

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    inside = cpu = 0.0
    w = StoreWriter(path, num_classes=62, x_scale=1 / 255,
                    description=f"synthetic FEMNIST-shaped, {m} clients")
    with w:
        for start in tqdm(range(0, m, BLOCK), desc=f"writing M={_e(m)}", leave=False,
                          mininterval=1.0):
            b = min(BLOCK, m - start)
            xs = [rng.bit_generator.random_raw(b * k * 28 * 28 // 8).view(np.uint8)
                  .reshape(b * k, 1, 28, 28) for k in (TRAIN, TEST)]
            ys = [rng.integers(0, 62, b * k) for k in (TRAIN, TEST)]
            ids = [f"c{i}" for i in range(start, start + b)]
            t, c = time.perf_counter(), time.process_time()
            w.add_many(ids, xs[0], ys[0], xs[1], ys[1], np.full(b, TRAIN), np.full(b, TEST))
            inside += time.perf_counter() - t
            cpu += time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
    inside += time.perf_counter() - t  # close: offsets, ids, header, fsync, rename
    cpu += time.process_time() - c
    return inside, cpu, time.perf_counter() - t0


def child(store: str, algorithm: str, rounds: int, state_dir: str) -> None:
    """Runs in a fresh process: rounds of one algorithm, then prints JSON."""
    import torch

    from partialfl.algorithms import Scaffold
    from partialfl.algorithms.base import RoundContext
    from partialfl.algorithms.disk_state import OnDiskClientState
    from partialfl.algorithms.model import FedAlt, FedSim, model_ffgg
    from partialfl.build import make_model
    from partialfl.data.store import ClientStore, StoreDataset
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.runtime import SequentialBackend, sample_cohort
    from partialfl.split import make_split

    torch.set_num_threads(1)
    t = time.perf_counter()
    raw = ClientStore(store)
    open_s = time.perf_counter() - t
    data = StoreDataset(raw)
    pb = ModelProblem(make_split(make_model("emnist_cnn", 62, seed=0), "output"), data,
                      vectorize=False)
    cfg = SGDConfig(lr=0.05, epochs=1, batch_size=32)
    make = {"ffgg": lambda: model_ffgg(cfg), "fedalt": lambda: FedAlt(cfg),
            "fedsim": lambda: FedSim(cfg), "scaffold": lambda: Scaffold(local=cfg)}
    alg = make[algorithm]()
    if algorithm != "ffgg":
        alg = OnDiskClientState(alg, Path(state_dir) / f"{algorithm}-state")
    state = alg.init(pb, pb.init_theta())
    cs = alg.init_client_state(pb)
    backend = SequentialBackend()
    times, cpu = [], []
    for r in range(rounds + 1):
        if r == 1 and cs is not None:
            io0 = dict(cs.io)
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
    moved = 0.0 if cs is None else sum(cs.io[k] - io0[k] for k in ("bytes_read",
                                                                  "bytes_written")) / rounds
    print(json.dumps({"s_per_round": float(np.median(times)),
                      "cpu_s_per_round": float(np.median(cpu)), "peak_rss_mib": peak_rss_mib(),
                      "open_s": open_s, "crc_files": len(raw.crc_read),
                      "state_mib_per_round": moved / 2**20}))


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


def _run_child(store: Path, alg: str, rounds: int, state_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--rounds", str(rounds), "--child",
                          str(store), alg, str(state_dir)], capture_output=True, text=True,
                         check=False)
    shutil.rmtree(state_dir, ignore_errors=True)
    if out.returncode:
        raise SystemExit(f"child for {store.name} {alg} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-clients", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per (M, algorithm), "
                    "interleaved across M so that load drifts hit every M alike")
    ap.add_argument("--dir", default=None, help="where to write the stores (default: a temp "
                    "folder); deleted at the end")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS),
                    help=f"comma-separated, from {','.join(ALGORITHMS)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: M up to 1e3, 2 rounds, "
                    "1 repeat")
    ap.add_argument("--child", nargs=3, metavar=("STORE", "ALG", "STATE_DIR"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.rounds, args.child[2])
        return
    if args.quick:
        args.max_clients, args.rounds, args.repeats = min(args.max_clients, 1_000), 2, 1
    algs = [a for a in args.algorithms.split(",") if a]
    if not algs or set(algs) - set(ALGORITHMS):
        ap.error(f"--algorithms: choose from {','.join(ALGORITHMS)}, got {args.algorithms!r}")
    sizes = [m for m in SIZES if m <= args.max_clients]
    if not sizes or args.repeats < 1:
        ap.error(f"--max-clients must be at least {SIZES[0]} and --repeats at least 1")
    root = Path(tempfile.mkdtemp(prefix="partialfl-scale-", dir=args.dir))
    runs: dict[tuple[int, str], list[dict]] = {(m, a): [] for m in sizes for a in algs}
    wrote: dict[int, tuple[float, float, float]] = {}
    try:
        for m in sizes:
            wrote[m] = write_clients(root / f"store-{m}", m)
            print(f"M={_e(m)} store written: {wrote[m][0]:.1f} s in the writer "
                  f"({m / wrote[m][0]:,.0f} clients/s; {wrote[m][1]:.1f} CPU s), "
                  f"{wrote[m][2]:.1f} s with the data generation", flush=True)
        for rep in range(args.repeats):
            for m in (sizes if rep % 2 == 0 else sizes[::-1]):
                for alg in algs:
                    runs[(m, alg)].append(_run_child(root / f"store-{m}", alg, args.rounds,
                                                     root / f"state-{m}-{alg}"))
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(m, a, key):
        return float(np.median([r[key] for r in runs[(m, a)]]))

    print(f"{'M':>9s} {'algorithm':9s} {'s/round':>8s} {'CPU s/round':>12s} "
          f"{'peak RSS MiB':>13s} {'state MiB/round':>16s}")
    for m in sizes:
        for a in algs:
            print(f"{_e(m):>9s} {a:9s} {med(m, a, 's_per_round'):8.3f} "
                  f"{med(m, a, 'cpu_s_per_round'):12.3f} "
                  f"{max(r['peak_rss_mib'] for r in runs[(m, a)]):13.0f} "
                  f"{med(m, a, 'state_mib_per_round'):16.2f}")
    for m in sizes:  # the first open checks the CRCs, later ones reuse the remembered check
        opens = [r for rep in range(args.repeats) for a in algs for r in runs[(m, a)][rep:rep + 1]]
        later = [r["open_s"] for r in opens[1:]]
        print(f"M={_e(m)} store open: first {opens[0]['open_s']:.2f} s ({opens[0]['crc_files']} "
              f"files CRC-checked), later ones median {np.median(later or [np.nan]):.3f} s "
              f"(max {max(later or [np.nan]):.3f} s, {sum(r['crc_files'] for r in opens[1:])} "
              "files re-checked in all)")
    big, small = sizes[-1], sizes[0]

    def ratio(a, key):  # median over repeats of the paired ratio (same repeat: similar load)
        return float(np.median([b[key] / s[key] for b, s in zip(runs[(big, a)],
                                                                   runs[(small, a)])]))

    print(f"round time at M={_e(big)} ÷ at M={_e(small)}, median over {args.repeats} paired "
          "repeats (wall-clock; CPU time, which other load disturbs less):")
    for a in algs:
        print(f"  {a:9s} {ratio(a, 's_per_round'):.2f}×  (CPU {ratio(a, 'cpu_s_per_round'):.2f}×)")
    rate = big / wrote[big][0]
    print(f"store write at M={_e(big)}: {rate:,.0f} clients/s in the writer "
          f"({wrote[big][0]:.1f} s, of which {wrote[big][1]:.1f} s CPU — the rest waits for "
          f"the disk; {big / wrote[big][2]:,.0f} clients/s with the data generation)")
    worst = max(algs, key=lambda a: ratio(a, "s_per_round"))
    rss = max(r["peak_rss_mib"] for a in algs for r in runs[(big, a)])
    print(f"M={_e(big)}: round time {ratio(worst, 's_per_round'):.2f}× of M={_e(small)} "
          f"(worst: {worst}), peak RSS {rss:.0f} MiB, store write {rate:,.0f} clients/s")


if __name__ == "__main__":
    main()
