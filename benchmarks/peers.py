"""One FedAvg round on FEMNIST in partialfl and in its peers' single-node modes, interleaved.

The round of ``benchmarks/nn_speed.py``: the 10 writers it samples (1,505 examples), the EMNIST
CNN of ``partialfl.models`` from the same θ⁰, one local epoch of SGD with batch 32 and lr 0.5
in the same batch order (partialfl's batch plan, exported in a *cohort file*), the
example-weighted average of the clients' models, one torch thread per process or thread.
Every round starts from θ⁰, so every round is the same work. Modes:

* partialfl: ``sequential``, ``processes`` and ``threads`` (``--workers`` each), ``vmap``;
  and ``MODE+cl``, the same with ``memory_format = "channels_last"`` (the run spec's option:
  one client's passes run the CNN's inputs and weights channels-last, where CPU convolutions
  and pooling are faster; not bit for bit the contiguous steps, so checked within float
  tolerance like ``vmap``). The peers run the same ``nn.Module`` in PyTorch's default layout,
  as their examples do (the pfl/*+cl modes convert it by hand);
* pfl-research 0.6.0: ``simulated`` (``SimulatedBackend``, one process) and ``torchrun``
  (``--workers`` ranks, gloo), in its own virtual environment; and ``MODE+cl``, the same with
  the module converted to channels-last by hand (``net.to(memory_format=torch.channels_last)``,
  what a pfl user would add to match partialfl's ``+cl`` modes);
* Flower: ``simulation`` (the simulation engine: Ray actors, ``--workers`` at once), from this
  environment (``pip install flwr[simulation]``);
* BlazeFL 3.0.0 needs Python >= 3.14: skipped, with the reason, where none is found (its
  thread-pool idea is partialfl's ``threads`` mode).

Each mode runs in its own long-lived process (``benchmarks/peers/*_runner.py``) that sets up
once and then runs one round per command; one warm-up round each, then ``--repeats`` rounds
interleaved across the modes (a load change hits them all; the order rotates every repeat).
Besides wall-clock seconds it reports the CPU seconds each round used in the mode's process
tree, which a loaded machine distorts less: under load, wall time also depends on how many
scheduler shares a mode holds (Linux autogroups: torchrun starts each rank in a session of its
own, partialfl's modes run in one), so compare wall times on a quiet machine. Checks: every
mode trains on the same number of examples, lowers the cohort's mean training loss, and ends
the round at partialfl-sequential's weights within float tolerance (partialfl's contiguous
modes bit for bit).

Peers are installed by this script from the package registry into their own virtual
environments under ``benchmarks/.peers/`` (git-ignored; pfl needs a Python < 3.13 and gets the
torch version of this environment); they never become dependencies of partialfl.

    python benchmarks/peers.py [--repeats 5] [--modes partialfl pfl/torchrun ...]
        [--workers 2] [--skip-setup] [--data-dir DIR]

The last line reads ``partialfl best mode vs best peer mode: X.XX× (speed-up vs best peer)``
(best seconds of the best peer mode / best seconds of partialfl's best mode; > 1: partialfl is
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RUNNERS = HERE / "peers"
sys.path[:0] = [str(RUNNERS), str(REPO / "src")]  # this checkout's partialfl

import common  # noqa: E402

LR, BATCH, CLIENTS, SEED = 0.5, 32, 10, 0
PFL_REQ = "pfl[pytorch]==0.6.0"
MODES = ("partialfl/sequential", "partialfl/processes", "partialfl/threads", "partialfl/vmap",
         "partialfl/sequential+cl", "partialfl/processes+cl", "partialfl/threads+cl",
         "pfl/simulated", "pfl/torchrun", "pfl/simulated+cl", "pfl/torchrun+cl",
         "flower/simulation",
         "blazefl/single", "blazefl/processes", "blazefl/threads")
REFERENCE = "partialfl/sequential"
ALGORITHMS = ("fedavg", "ffgg")
HAVE_PROC = os.path.exists("/proc/self/stat")


# ------------------------------------------------------------------------ the cohort file
def export_cohort(path: Path, algorithm: str) -> dict:
    """Write the cohort file of ``algorithm`` (see ``peers/common.py``) from partialfl's
    FEMNIST problem."""
    import torch
    from partialfl_runner import CHUNK, build

    from partialfl.data.femnist import load_femnist_npz
    from partialfl.local.sgd import SGDConfig, client_plans
    from partialfl.runtime import sample_cohort

    data = load_femnist_npz(None)
    writers = sample_cohort(SEED, 0, data.num_clients, CLIENTS)  # nn_speed.py's cohort
    problem, _, theta0 = build([int(w) for w in writers], LR, BATCH, algorithm, False)
    pos = np.arange(CLIENTS)
    # the plans of run_rounds' round 0 (seed 0): FedAvg's stream "local", FFGG's "finetune"
    plans = client_plans(problem, pos, SGDConfig(lr=LR, epochs=1, batch_size=BATCH), SEED, 0,
                         "local" if algorithm == "fedavg" else "finetune")
    arrays = {}
    for m, plan in enumerate(plans):
        order = np.concatenate(plan)
        n = int(problem.num_examples(pos[m:m + 1])[0])
        if sorted(order.tolist()) != list(range(n)) or any(len(b) != BATCH
                                                           for b in plan[:-1]):
            raise RuntimeError(f"writer {m}: the batch plan is not one epoch in batches of "
                               f"{BATCH}; peers could not slice it")
        x, y = problem.data.client(m, "train")
        arrays[f"x{m}"] = x[torch.from_numpy(order)].numpy()
        arrays[f"y{m}"] = y[torch.from_numpy(order)].numpy()
    full = {**theta0, **problem.w_pretrained}  # FFGG: θ and the initial output layer
    names = [n for n, _ in problem.module.named_parameters()]
    arrays.update({f"theta/{n}": full[n].numpy() for n in names})
    meta = {"clients": CLIENTS, "lr": LR, "batch": BATCH, "names": names, "chunk": CHUNK,
            "algorithm": algorithm, "writers": [int(w) for w in writers]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)
    sizes = [len(arrays[f"y{m}"]) for m in range(CLIENTS)]
    return {"examples": sum(sizes), "steps": sum(-(-s // BATCH) for s in sizes), **meta}


# ------------------------------------------------------------------------------- set-up
def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def find_python(lo: tuple[int, int], hi: tuple[int, int] | None = None) -> str | None:
    """An interpreter with lo <= version < hi: this one's base, then python3.X on PATH."""
    cands = [getattr(sys, "_base_executable", sys.executable), sys.executable]
    for minor in range(20, 8, -1):
        for suffix in ("", "t"):
            p = shutil.which(f"python3.{minor}{suffix}")
            if p:
                cands.append(p)
    uv = shutil.which("uv")
    if uv:
        try:
            p = subprocess.run([uv, "python", "find", f">={lo[0]}.{lo[1]}"], capture_output=True,
                               text=True, timeout=60).stdout.strip()
            if p:
                cands.append(p)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for p in cands:
        v = _version(p)
        if v is not None and v >= lo and (hi is None or v < hi):
            return p
    return None


def setup_pfl(peers: Path, skip: bool) -> tuple[Path | None, str]:
    """The pfl venv's interpreter (installed if needed), or None and why not."""
    import torch

    venv = peers / "pfl"
    py = venv / "bin" / "python"
    reqs = [f"torch=={torch.__version__.split('+')[0]}", PFL_REQ]
    marker = venv / "peers-installed.json"
    if marker.exists() and json.loads(marker.read_text()) == reqs:
        return py, "ready"
    if skip:
        return None, f"not set up in {venv} (run once without --skip-setup)"
    base = find_python((3, 10), (3, 13))
    if base is None:
        return None, "pfl 0.6.0 needs Python 3.10-3.12; none found"
    print(f"setting up pfl in {venv} with {base} ({' '.join(reqs)}) ...", flush=True)
    if venv.exists():
        shutil.rmtree(venv)
    try:
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *reqs], check=True)
    except subprocess.CalledProcessError as e:
        return None, f"installing {' '.join(reqs)} failed ({e})"
    marker.write_text(json.dumps(reqs))
    return py, "installed"


def blazefl_reason() -> str:
    """Why BlazeFL is skipped."""
    py = find_python((3, 14))
    if py is None:
        return ("BlazeFL 3.0.0 needs Python >= 3.14 and none was found (PATH, uv); its "
                "thread-pool idea is measured as partialfl/threads")
    return (f"{py} is a Python >= 3.14, but no BlazeFL runner is written yet (it was "
            "developed where no such Python was available)")


# ------------------------------------------------------------------------------ runners
class Runner:
    """One mode's long-lived process, spoken to over its stdin/stdout (``common.PREFIX``)."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path) -> None:
        self.name, self.log_path = name, log
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=env, cwd=REPO,
                                     start_new_session=True)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(common.PREFIX):
                self.q.put(json.loads(line[len(common.PREFIX):]))
            else:
                self.log.write(line)
        self.q.put(None)

    def message(self, timeout: float) -> dict:
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no answer within {timeout:.0f} s") from None
        if msg is None:
            raise RuntimeError(f"the process ended (exit code {self.proc.wait()})")
        return msg

    def tree(self) -> dict[int, list[str]]:
        """pid -> /proc/pid/stat fields (after the name) of the runner and its descendants
        (its workers, torchrun's ranks, Ray's processes)."""
        procs = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        procs[int(d)] = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
        children: dict[int, list[int]] = {}
        for pid, fields in procs.items():
            children.setdefault(int(fields[1]), []).append(pid)  # field 4: the parent
        out, todo = {}, [self.proc.pid]
        while todo:
            pid = todo.pop()
            if pid in procs and pid not in out:
                out[pid] = procs[pid]
                todo += children.get(pid, [])
        return out

    def cpu(self) -> float:
        """CPU seconds (user + system) used so far by the live processes of :meth:`tree`."""
        ticks = sum(int(f[11]) + int(f[12]) for f in self.tree().values())  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def round(self, timeout: float) -> dict:
        """One round; its answer with ``cpu_s``, the CPU seconds the mode used meanwhile."""
        c0 = self.cpu() if HAVE_PROC else 0.0
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        msg = self.message(timeout)
        msg["cpu_s"] = self.cpu() - c0 if HAVE_PROC else float("nan")
        return msg

    def tail(self, n: int = 6) -> str:
        self.log.flush()
        lines = [ln for ln in self.log_path.read_text().splitlines() if ln.strip()]
        return " | ".join(lines[-n:])

    def close(self) -> None:
        """Ask the runner to quit; after 30 s kill what is left of its process tree."""
        started = set(self.tree()) if HAVE_PROC else set()
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:  # the runner's session, then any descendant that left it (torchrun's ranks)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in started - {self.proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self.log.close()


def runner_argv(mode: str, args, cohort: Path, weights: Path, pfl_py: Path | None
                ) -> list[str]:
    lib, how = mode.split("/")
    common_args = ["--cohort", str(cohort), "--weights-out", str(weights)]
    if lib == "pfl" and how.endswith("+cl"):
        how, common_args = how[:-3], [*common_args, "--channels-last"]
    if lib == "partialfl":
        return [sys.executable, str(RUNNERS / "partialfl_runner.py"), "--mode", how,
                "--workers", str(args.workers), *common_args]
    if lib == "pfl" and how == "simulated":
        return [str(pfl_py), str(RUNNERS / "pfl_runner.py"), *common_args]
    if lib == "pfl":
        return [str(pfl_py), "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.workers}", str(RUNNERS / "pfl_runner.py"),
                *common_args]
    if lib == "flower":
        return [sys.executable, str(RUNNERS / "flower_runner.py"), "--rounds",
                str(args.repeats + 1), "--workers", str(args.workers), *common_args]
    raise ValueError(mode)


def choose_modes(wanted: list[str] | None) -> list[str]:
    if not wanted:
        return list(MODES)
    out = []
    for w in wanted:
        hit = [m for m in MODES if m == w or m.split("/")[0] == w]
        if not hit:
            raise SystemExit(f"unknown mode {w!r}; allowed: {', '.join(MODES)} "
                             "(or a library name: partialfl, pfl, flower, blazefl)")
        out += [m for m in hit if m not in out]
    return out


# --------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per mode")
    ap.add_argument("--modes", nargs="+", default=None,
                    help=f"modes or libraries (default: all of {', '.join(MODES)})")
    ap.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS),
                    help="the rounds to time (the last line is about the first)")
    ap.add_argument("--workers", type=int, default=2,
                    help="processes / threads / ranks / Ray CPUs of the parallel modes")
    ap.add_argument("--skip-setup", action="store_true",
                    help="never install: use the peers' virtual environments as they are")
    ap.add_argument("--peers-dir", default=str(HERE / ".peers"))
    ap.add_argument("--data-dir", default=None, help="FEMNIST (default: PARTIALFL_DATA_DIR)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for a mode")
    args = ap.parse_args()
    if args.repeats < 1 or args.workers < 1:
        raise SystemExit("--repeats and --workers must be >= 1")
    if args.data_dir:
        os.environ["PARTIALFL_DATA_DIR"] = args.data_dir
    modes = choose_modes(args.modes)
    peers = Path(args.peers_dir)

    skipped: dict[str, str] = {}
    pfl_py = None
    if any(m.startswith("pfl/") for m in modes):
        pfl_py, how = setup_pfl(peers, args.skip_setup)
        if pfl_py is None:
            skipped.update({m: how for m in modes if m.startswith("pfl/")})
    if any(m.startswith("flower/") for m in modes):
        try:
            import flwr  # noqa: F401
            import ray  # noqa: F401
        except ImportError as e:
            skipped["flower/simulation"] = f"flwr[simulation] is not installed here ({e})"
    for m in modes:
        if m.startswith("blazefl/"):
            skipped[m] = blazefl_reason()
    print(f"machine: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (before)", flush=True)
    lines = []
    for alg in dict.fromkeys(args.algorithms):
        out = peers / "run" / alg
        out.mkdir(parents=True, exist_ok=True)
        cohort = peers / "cache" / f"femnist-cohort-{alg}.npz"
        info = export_cohort(cohort, alg)
        print(f"\n{alg}: FEMNIST cohort of nn_speed.py: writers {info['writers']}, "
              f"{info['examples']} examples, {info['steps']} steps of batch {BATCH}, lr {LR}, "
              f"example-weighted; {args.workers} workers in the parallel modes; 1 torch thread "
              f"per process/thread; warm-up + {args.repeats} interleaved rounds", flush=True)
        results, failed = measure(modes, skipped, args, cohort, out, pfl_py)
        lines.append(report(alg, modes, results, skipped, failed, info, out, cohort))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (after)")
    for line in lines[1:] + lines[:1]:
        print(line)


def measure(modes, skipped, args, cohort: Path, out: Path, pfl_py
            ) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Start every mode's runner, warm each up, then ``args.repeats`` interleaved rounds."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(RUNNERS), str(REPO / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    runners: dict[str, Runner] = {}
    results: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}

    def fail(m: str, e: Exception) -> None:
        r = runners.pop(m)
        failed[m] = f"{e}; log {r.log_path}: {r.tail()}"
        r.close()

    try:
        for m in modes:
            if m in skipped:
                continue
            t = time.perf_counter()
            tag = m.replace("/", "-")
            runners[m] = Runner(m, runner_argv(m, args, cohort, out / f"weights-{tag}.npz",
                                               pfl_py), env, out / f"{tag}.log")
            try:
                runners[m].message(args.timeout)
                runners[m].round(args.timeout)  # warm-up
                print(f"  {m}: ready and warmed up in {time.perf_counter() - t:.1f} s",
                      flush=True)
            except RuntimeError as e:
                fail(m, e)
        cpu0 = {m: r.cpu() for m, r in runners.items()} if HAVE_PROC else {}
        t0 = time.perf_counter()
        for r in range(args.repeats):
            live = list(runners)
            for m in live[r % len(live):] + live[:r % len(live)]:  # rotated: no fixed neighbour
                try:
                    results.setdefault(m, []).append(runners[m].round(args.timeout))
                except RuntimeError as e:
                    fail(m, e)
            print(f"  repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{m} {results[m][-1]['round_s']:.3f}" for m in runners if m in results),
                flush=True)
        # what each mode's processes burn while the others run (e.g. Ray's daemons)
        wall = time.perf_counter() - t0
        for m in list(runners) if HAVE_PROC else []:
            own = sum(x["round_s"] for x in results[m])
            busy = runners[m].cpu() - cpu0[m] - sum(x["cpu_s"] for x in results[m])
            results[m][0]["idle_cores"] = max(busy, 0.0) / max(wall - own, 1e-9)
    finally:
        for m in list(runners):
            runners.pop(m).close()
    return results, failed


def report(alg, modes, results, skipped, failed, info, out: Path, cohort: Path) -> str:
    """Print the table of ``alg``'s round; returns its summary line."""
    ref_path = out / "weights-partialfl-sequential.npz"
    ref = dict(np.load(ref_path)) if REFERENCE in results and ref_path.exists() else None
    ref_step = None
    if ref is not None:
        with np.load(cohort) as z:
            theta0 = {n: z[f"theta/{n}"] for n in ref}
        ref_step = np.sqrt(sum(float(((ref[n] - theta0[n]) ** 2).sum()) for n in ref))
    best = {m: min(r["round_s"] for r in v) for m, v in results.items() if v}
    idle = {m: v[0]["idle_cores"] for m, v in results.items() if v and "idle_cores" in v[0]}
    seq = best.get(REFERENCE)
    print(f"\n{alg} round:\n{'mode':22s} {'best s':>7s} {'median s':>8s} {'seq/x':>6s} "
          f"{'cpu s':>6s} {'examples':>8s} {'loss θ0→θ1':>13s} {'max|Δθ| vs seq':>14s}  check")
    for m in modes:
        if m in skipped or m in failed:
            print(f"{m:22s} {'skipped' if m in skipped else 'FAILED'}: "
                  f"{skipped.get(m) or failed.get(m)}")
            continue
        rs = results.get(m, [])
        if not rs:
            continue
        med = float(np.median([r["round_s"] for r in rs]))
        cpu = float(np.median([r["cpu_s"] for r in rs]))
        ex = {r["examples"] for r in rs}
        l0, l1 = rs[-1]["loss_before"], rs[-1]["loss_after"]
        diff, rel = "n/a", None
        wpath = out / f"weights-{m.replace('/', '-')}.npz"
        if ref is not None and wpath.exists():
            w = dict(np.load(wpath))
            d = max(float(np.abs(w[n] - ref[n]).max()) for n in ref)
            rel = np.sqrt(sum(float(((w[n] - ref[n]) ** 2).sum()) for n in ref)) / ref_step
            diff = f"{d:.1e}"
        exact = m.startswith("partialfl/") and m != "partialfl/vmap" and "+cl" not in m
        ok = (ex == {info["examples"]} and l1 < l0 and rel is not None
              and (rel == 0 if exact else rel < 1e-3))
        print(f"{m:22s} {best[m]:7.3f} {med:8.3f} "
              f"{(seq / best[m]) if seq else float('nan'):5.2f}x {cpu:6.2f} "
              f"{'/'.join(map(str, ex)):>8s} "
              f"{l0:6.3f}→{l1:6.3f} {diff:>14s}  "
              f"{'ok' if ok else 'CHECK'}{'' if rel is None else f' (rel {rel:.0e})'}")
    busy = [f"{m} {c * 100:.0f}%" for m, c in idle.items() if c >= 0.005]
    print("CPU used by idle modes while the others ran (% of a core): "
          + (", ".join(busy) if busy else "none above 0.5%"))
    ours = {m: t for m, t in best.items() if m.startswith("partialfl/")}
    theirs = {m: t for m, t in best.items() if not m.startswith("partialfl/")}
    if not (ours and theirs):
        line = ("partialfl best mode vs best peer mode: n/a (no "
                f"{'partialfl' if not ours else 'peer'} mode ran)")
    else:
        a, b = min(ours, key=ours.get), min(theirs, key=theirs.get)
        line = (f"partialfl best mode vs best peer mode: {theirs[b] / ours[a]:.2f}× "
                "(speed-up vs best peer)")
        print(f"{alg}: best partialfl mode {a} {ours[a]:.3f} s; best peer mode {b} "
              f"{theirs[b]:.3f} s")
    return line if alg == "fedavg" else f"{alg}: {line}"


if __name__ == "__main__":
    main()
