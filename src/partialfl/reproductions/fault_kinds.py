"""The fault kinds of issue 21 in ``partialfl reproduce faults``: each one injected, and the
outcome the runtime promises checked.

* **a closed worker pool** (synchronous rounds on worker processes): clients raise or their
  worker process dies at random (:class:`~partialfl.runtime.faults.FaultInjector`, kinds
  ``raise`` and ``die``) and the pool is closed before some rounds, as an error path closes
  it. A closed pool is never reused (:mod:`partialfl.runtime.pool`): the round starts a
  fresh one, the failed clients are *skipped and counted*, and θ equals the sequential run
  with exactly those updates dropped (:class:`~partialfl.runtime.faults.DropClients`). It
  used to hang: the rerun waited on a queue no worker read.
* **a hostile SuperNode** (Flower's simulation engine, in the same Ray session as the
  study's Flower runs; 6 rounds): from round 1 on, the node of partition 1 sends its vectors
  in another dtype (``dtype``) or a record the algorithm does not declare (``extra``). Each
  such reply is *refused* by the codec and counted as a failure of that node (``invalid``);
  θ stays float64, finite and bit-identical to the run in which that node crashed in the
  same rounds. The ServerApp used to take θ's dtype from the reply (every later round failed) or
  crash with a ``KeyError``.
* **a kill between checkpoint files**: a process running Scaffold (client-side control
  variates, so a generation has a client-side and a server file) checkpointing every round
  is killed with SIGKILL right after the client-side file of a generation, and in another
  run right after its server file, before the pointer moves. The run started again from its
  folder is *resumable* and ends bit-identical to the uninterrupted run (θ, client state,
  history), and the killed write's files are gone. A kill between the two files used to
  leave rounds 3 and 2 on disk and a refused resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.algorithms import FFGG, Scaffold
from partialfl.build import make_solver
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.runtime.faults import DropClients, FaultInjector
from partialfl.server import SGD


def _row(kind: str, where: str, injected: str, expected: str, observed: str, ok: bool,
         seconds: float, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "where": where, "injected": injected, "expected": expected,
            "observed": observed, "ok": bool(ok), "seconds": seconds, **extra}


# ----------------------------------------------------------------------------- closed pool
class ClosingPool(ProcessBackend):
    """The processes backend with its worker pool closed before the rounds ``close_at`` (as
    an error path closes it); counts the pools it starts."""

    def __init__(self, close_at, **kw) -> None:
        super().__init__(**kw)
        self.close_at, self.closed, self.pools = set(close_at), [], 0

    def _pool_for(self, problem, algorithm):
        old = self._pool
        pool = super()._pool_for(problem, algorithm)
        self.pools += pool is not old
        return pool

    def map_groups(self, fn, groups):
        r = fn.ctx.round
        if r in self.close_at and r not in self.closed and self._pool is not None:
            self._pool.close()  # the closed pool stays referenced: it must not be reused
            self.closed.append(r)
        return super().map_groups(fn, groups)


def closed_pool(problem: LeastSquaresProblem, rounds: int, seed: int,
                rate: float = 0.2) -> dict[str, Any]:
    """FFGG (CG, 10 steps) on ``problem`` for ``rounds`` synchronous rounds on 2 worker
    processes with ``rate`` of the client computations raising or dying and the pool closed
    before rounds ``rounds // 4`` and ``rounds // 2``."""

    def alg():
        return FFGG(make_solver("cg", 10), SGD(1.0 / problem.L))

    t0 = time.perf_counter()
    inj = FaultInjector(alg(), rate, ("raise", "die"), seed=seed)
    at = (rounds // 4, rounds // 2)
    with ClosingPool(at, workers=2, task_timeout=60.0) as be:
        res = run_rounds(problem, inj, rounds, seed=seed, backend=be, max_failure_fraction=0.6)
    pairs = [(r, m) for r in range(rounds) for m in range(problem.num_clients)]
    lost = [(r, m) for r, m in pairs if inj.faults_at(r, m) is not None]
    ref = run_rounds(problem, DropClients(alg(), lost), rounds, seed=seed)
    diff = float(np.abs(res.state.theta["theta"] - ref.state.theta["theta"]).max())
    kinds = [inj.faults_at(r, m) for r, m in lost]
    f = res.faults
    counted = f.failed + f.worker_deaths
    ok = (diff == 0.0 and counted == f.lost == len(lost) and be.pools == 1 + len(at)
          and be.closed == list(at) and f.failed == kinds.count("raise")
          and f.worker_deaths == kinds.count("die"))
    return _row("closed worker pool", "sync rounds, 2 worker processes",
                f"{kinds.count('raise')} raise, {kinds.count('die')} worker deaths in "
                f"{len(pairs)} client computations; pool closed before rounds {list(at)}",
                "skipped and counted; a fresh pool each time, never the closed one; θ = the "
                "same-survivors run",
                f"{f.failed} raised + {f.worker_deaths} deaths counted, {f.lost} lost; "
                f"{be.pools} pools started; max |Δθ| vs same-survivors run {diff:.1e}",
                ok, time.perf_counter() - t0, ref_diff=diff, seed=seed)


# ----------------------------------------------------------------------------- hostile node
#: Flower fault-injection kinds of a hostile SuperNode, and what the server must make of them
HOSTILE = {"dtype": "vectors in float32 for a float64 θ", "extra": "an undeclared record "
           "'extra.aux'"}


def hostile_runs(base: dict[str, Any], rounds: int = 6) -> list[dict[str, Any]]:
    """The run configs of ``base`` (a Flower run config of a ``spec`` table) shortened to
    ``rounds`` rounds with node 1 crashing, then misbehaving (each :data:`HOSTILE` kind),
    from round 1 on."""
    spec = {**base["spec"], "personalize": {**base["spec"]["personalize"], "rounds": rounds}}
    return [{**base, "spec": spec, "fault-injection": "; ".join(
        f"{k}:partition=1,round={r}" for r in range(1, rounds))}
        for k in ("crash", *HOSTILE)]


def hostile_rows(reports: dict[str, Any], seconds: float, seed: int) -> list[dict[str, Any]]:
    """A row per :data:`HOSTILE` kind in ``reports`` (kind → its run's report), against
    ``reports["crash"]``, the run in which node 1 crashed in the same rounds."""
    crashed = reports["crash"]
    rows = []
    for kind, rep in reports.items():
        if kind == "crash":
            continue
        theta = np.asarray(rep.theta["theta"])
        same = bool(np.array_equal(theta, np.asarray(crashed.theta["theta"])))
        kinds = sorted({f.kind for f in rep.failures})
        ok = (kinds == ["invalid"] and rep.failed_client_updates == crashed.failed_client_updates
              > 0 and not rep.aborted and theta.dtype == np.float64 and np.isfinite(theta).all()
              and same and all(f.partition == 1 for f in rep.failures))
        rows.append(_row(
            f"hostile SuperNode ({kind})", "Flower simulation, 2 SuperNodes",
            f"{HOSTILE[kind]}, {len(rep.failures)} replies", "refused and counted; θ "
            "float64, finite, = the run where that node crashed",
            f"{len(rep.failures)} replies refused ({', '.join(kinds)}), "
            f"{rep.failed_client_updates} updates lost; θ {theta.dtype}, "
            f"{'identical to' if same else 'DIFFERENT from'} the crashed-node run", ok,
            seconds, seed=seed))
    return rows


# ----------------------------------------------------------------------------- checkpoint kill
_KILLED = """
import os, signal, sys, json
from partialfl import io as pio
from partialfl.reproductions.fault_kinds import scaffold_run
path, side, gen, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
save = pio.save_state
def save_then_die(f, obj, **meta):
    out = save(f, obj, **meta)
    if meta.get("generation") == gen and meta.get("side") == side:
        os.kill(os.getpid(), signal.SIGKILL)  # a kill -9 right after this file
    return out
pio.save_state = save_then_die
scaffold_run(size, path)
"""


def scaffold_run(size: dict[str, int], checkpoint=None, resume: bool = False):
    """Scaffold (τ = 3) on a least-squares problem of ``size`` (clients, n, d_theta, d_w,
    rounds, seed), 3 clients per round, checkpointing every round into ``checkpoint``."""
    p = LeastSquaresProblem(LeastSquaresSpec(size["clients"], size["n"], size["d_theta"],
                                             size["d_w"], seed=size["seed"]),
                            basis="standard")
    kw = {} if checkpoint is None else {"checkpoint": checkpoint, "checkpoint_every": 1,
                                        "resume": resume}
    return run_rounds(p, Scaffold(3), size["rounds"], clients_per_round=3, seed=size["seed"],
                      eval_every=1, **kw)


def _same_run(a, b) -> bool:
    def hist(r):
        return [{k: v for k, v in h.items() if k != "time"} for h in r.history]

    return (all(np.array_equal(a.state.theta[n], b.state.theta[n]) for n in a.state.theta)
            and set(a.client_state or {}) == set(b.client_state or {})
            and all(np.array_equal(a.client_state[n], b.client_state[n])
                    for n in a.client_state or {}) and hist(a) == hist(b))


def checkpoint_kill(size: dict[str, int], folder: Path) -> list[dict[str, Any]]:
    """A row per kill point (after the client-side file, after the server file) of
    generation ``rounds // 2 + 1`` (see the module docstring)."""
    from partialfl.runtime.checkpoint import Checkpoint

    full = scaffold_run(size)
    gen = size["rounds"] // 2 + 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    rows = []
    for side in ("client", "server"):
        t0 = time.perf_counter()
        d = Path(folder) / f"kill-after-{side}"
        path = d / "run.ckpt"
        proc = subprocess.run([sys.executable, "-c", _KILLED, str(path), side, str(gen),
                               json.dumps(size)], env=env, capture_output=True, text=True,
                              timeout=600)
        killed = proc.returncode == -signal.SIGKILL
        before = sorted(f.name for f in d.iterdir()) if d.is_dir() else []
        res = scaffold_run(size, path, resume=True)
        files = Checkpoint(path).files()
        after = sorted(f.name for f in d.iterdir())
        clean = after == sorted(["run.ckpt", *(f.name for f in files.values())])
        same = _same_run(res, full)
        role = "client-side" if side == "client" else "server"
        rows.append(_row(
            f"kill between checkpoint files (after the {role} file)",
            "sync rounds, Scaffold, a checkpoint every round",
            f"SIGKILL after the {role} file of generation {gen} (exit "
            f"{proc.returncode}); left: {', '.join(before)}",
            "resumable; the resumed run = the uninterrupted one; the killed write removed",
            f"resumed from round {gen - 1}: θ, client state and history "
            f"{'identical' if same else 'DIFFERENT'}; folder afterwards "
            f"{'clean' if clean else 'NOT clean: ' + ', '.join(after)}",
            killed and same and clean, time.perf_counter() - t0, seed=size["seed"]))
    return rows


# ----------------------------------------------------------------------------- the study
def pool_part(size, seed: int) -> list[dict[str, Any]]:
    """:func:`closed_pool` on the least-squares problem of the faults study's ``size``."""
    p = LeastSquaresProblem(LeastSquaresSpec(size.clients, size.n, size.d_theta, size.d_w,
                                             seed=seed))
    return [closed_pool(p, size.pool_rounds, seed)]


def kill_part(size, seed: int) -> list[dict[str, Any]]:
    """:func:`checkpoint_kill` at the faults study's ``size`` (8 clients), in a temporary
    folder."""
    import tempfile

    run = {"clients": 8, "n": size.n, "d_theta": size.d_theta, "d_w": size.d_w,
           "rounds": size.checkpoint_rounds, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="partialfl-faults-") as d:
        return checkpoint_kill(run, Path(d))


# ----------------------------------------------------------------------------- report
def section(rows: list[dict[str, Any]]) -> list[str]:
    """The summary's section on the fault kinds (empty without rows)."""
    if not rows:
        return []
    lines = ["## Fault kinds: each checked for its outcome", "",
             "| fault | where | injected | expected | observed | as expected |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['where']} | {r['injected']} | {r['expected']} | "
              f"{r['observed']} | {'yes' if r['ok'] else 'NO'} |" for r in rows]
    return [*lines, "", f"* Every fault kind had the expected outcome: "
            f"{'yes' if all(r['ok'] for r in rows) else 'NO'}.", ""]
