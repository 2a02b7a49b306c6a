"""Fault-injection study: FFGG keeps converging while clients fail (``partialfl reproduce
faults``).

Clients fail at random (:class:`~partialfl.runtime.faults.FaultInjector`: each client
computation fails with probability ``rate``, derived from ``(seed, "fault", round,
client)``) with three kinds of faults: the client raises, sends a NaN update, or — on worker
processes — its worker process dies. Every runtime skips and counts the lost updates
(:mod:`partialfl.runtime.faults`). Measured for each fault rate in {0, 10, 20, 30} %:

* **least squares, synchronous FFGG** (full participation): the faulty run is compared with
  the fault-free run *with the same surviving updates*
  (:class:`~partialfl.runtime.faults.DropClients` removes exactly the lost (round, client)
  updates): θ must agree to rounding (max |Δθ|), and every run must reach the tolerance
  ‖θ − θ*‖² / ‖θ⁰ − θ*‖² ≤ :data:`TOLS` like the fault-free run;
* **least squares, asynchronous FFGG** on the simulated clock and on worker processes
  (where workers also die): the final distance to θ* against the fault-free run's;
* **FEMNIST** (a few writers, output-layer split, synchronous FFGG): faulty vs the run with
  the same surviving updates (max |Δθ|, test accuracy).

The server step uses an exponentially decaying stepsize (halved every ``halve_every``
rounds): with a constant step, averaging a random subset of the clients' gradients leaves a
noise floor around θ* (about 1e-4 at 30 % faults, measured); the decay lowers it for the
faulty and the fault-free runs alike.
* **least squares in Flower's simulation engine**: a SuperNode lost for the last two thirds
  of the rounds (its clients' updates lost, the run goes on below ``max-failure-fraction``)
  against the in-process run with exactly those updates dropped.
* **issue 21's fault kinds** — closed pool, hostile SuperNode, kill between checkpoint files:
  :mod:`partialfl.reproductions.fault_kinds`, each checked for its outcome.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.algorithms import FFGG
from partialfl.build import make_solver
from partialfl.pipeline.report import error_ratio_section
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.registry import register
from partialfl.reproductions import fault_kinds
from partialfl.runtime import run_rounds
from partialfl.runtime.asynchronous import run_async
from partialfl.runtime.faults import DropClients, FaultInjector
from partialfl.server import SGD, Exponential

#: the distance to θ* (‖θ − θ*‖² / ‖θ⁰ − θ*‖²) every run must reach, per runtime (the worker
#: processes run far fewer steps: each step is a real round trip between processes)
TOLS = {"sync": 1e-3, "async": 1e-3, "processes": 3e-2, "flower-sim": 1e-3}
RATES = (0.0, 0.1, 0.2, 0.3)


@dataclass(frozen=True)
class Size:
    clients: int
    n: int
    d_theta: int
    d_w: int
    rounds: int
    async_steps: int
    process_steps: int
    femnist_writers: int
    femnist_rounds: int
    seeds: tuple[int, ...]
    halve_every: int
    flower_rounds: int = 60
    pool_rounds: int = 8
    checkpoint_rounds: int = 4


QUICK = Size(clients=12, n=200, d_theta=8, d_w=4, rounds=240, async_steps=1600,
             process_steps=120, femnist_writers=4, femnist_rounds=2, seeds=(0,),
             halve_every=60)
FULL = Size(clients=32, n=400, d_theta=40, d_w=20, rounds=600, async_steps=9600,
            process_steps=600, femnist_writers=16, femnist_rounds=10, seeds=(0, 1, 2),
            halve_every=150, pool_rounds=24, checkpoint_rounds=8)


def _ls_metrics(star: np.ndarray) -> Callable:
    def evaluate(algorithm, state, problem, client_state, ctx) -> dict:
        d = algorithm.global_theta(state, problem)["theta"] - star
        return {"rel_dist2": float(d @ d) / float(star @ star)}

    return evaluate


def _ffgg(problem, halve_every: int, scale: int = 1) -> FFGG:
    """FFGG with CG; server step 1/(L·scale) halved every ``halve_every·scale`` steps
    (asynchronous steps apply one client's gradient: ``scale`` = number of clients)."""
    return FFGG(make_solver("cg", 10), SGD(1.0 / problem.L / scale, schedule=Exponential(
        halve_every * scale)))


def _injected(inj: FaultInjector, pairs) -> dict[str, int]:
    out = {"raise": 0, "nan": 0, "die": 0}
    for r, m in pairs:
        k = inj.faults_at(r, m)
        if k is not None:
            out[k] += 1
    return out


def _first_below(history, key, tol, step_key="round"):
    return next((h[step_key] for h in history if h[key] <= tol), None)


def _row(part, runtime, rate, injected, faults, attempted, history, step_key, **extra):
    ls = "rel_dist2" in history[-1]
    return {"part": part, "runtime": runtime, "rate": rate, "injected": injected,
            "attempted": attempted, "lost": faults.lost, "failed": faults.failed,
            "nonfinite": faults.nonfinite, "worker_deaths": faults.worker_deaths,
            "final": history[-1]["rel_dist2"] if ls else None,
            "tol": TOLS[runtime] if ls else None,
            "reached": _first_below(history, "rel_dist2", TOLS[runtime], step_key)
            if ls else None,
            "curve": [(h[step_key], h.get("rel_dist2")) for h in history] if ls else [],
            **extra}


def least_squares_sync(size: Size, seed: int) -> list[dict]:
    """Synchronous FFGG on least squares at every rate, with the same-survivors reference."""
    p = LeastSquaresProblem(LeastSquaresSpec(size.clients, size.n, size.d_theta, size.d_w,
                                             seed=seed))
    ev = _ls_metrics(p.theta_star()["theta"])
    rows = []
    for rate in RATES:
        inj = FaultInjector(_ffgg(p, size.halve_every), rate, ("raise", "nan"), seed=seed)
        res = run_rounds(p, inj, size.rounds, seed=seed, evaluate=ev, eval_every=4,
                         max_failure_fraction=0.5)
        pairs = [(r, m) for r in range(size.rounds) for m in range(p.num_clients)]
        lost = [(r, m) for r, m in pairs if inj.faults_at(r, m) is not None]
        ref = run_rounds(p, DropClients(_ffgg(p, size.halve_every), lost), size.rounds,
                         seed=seed,
                         evaluate=ev, eval_every=4)
        diff = float(np.abs(res.state.theta["theta"] - ref.state.theta["theta"]).max())
        rows.append(_row("least squares", "sync", rate, _injected(inj, pairs), res.faults,
                         len(pairs), res.history, "round", ref_diff=diff,
                         ref_final=ref.history[-1]["rel_dist2"], seed=seed))
    return rows


def least_squares_async(size: Size, seed: int, processes: bool) -> list[dict]:
    """Asynchronous FFGG (simulated clock, or worker processes with dying workers)."""
    from partialfl.runtime.processes import run_processes

    p = LeastSquaresProblem(LeastSquaresSpec(size.clients, size.n, size.d_theta, size.d_w,
                                             seed=seed))
    ev = _ls_metrics(p.theta_star()["theta"])
    rows = []
    rates = RATES if not processes else (0.0, 0.2)
    kinds = ("raise", "nan", "die") if processes else ("raise", "nan")
    steps = size.process_steps if processes else size.async_steps
    for rate in rates:
        inj = FaultInjector(_ffgg(p, size.halve_every, p.num_clients), rate, kinds, seed=seed)
        if processes:
            res = run_processes(p, inj, steps=steps, concurrency=2, time_unit=0.0, seed=seed,
                                evaluate=ev, eval_every=max(1, steps // 20),
                                max_failure_fraction=0.6, poll_seconds=0.2,
                                max_respawns=steps)
        else:
            res = run_async(p, inj, steps=steps, concurrency=4, seed=seed, evaluate=ev,
                            eval_every=max(1, steps // 40), max_failure_fraction=0.6)
        done = {(e[2], e[3]) for e in res.events if e[0] in ("arrive", "lost")}
        rows.append(_row("least squares", "processes" if processes else "async", rate,
                         _injected(inj, done), res.faults, len(done), res.history, "step",
                         seed=seed))
    return rows


def least_squares_flower(size: Size, seed: int) -> list[dict] | str:
    """FFGG on least squares in Flower's simulation engine (2 SuperNodes, one Ray start for
    both runs): fault-free, and with the SuperNode of partition 1 lost from a third of the
    rounds on (every update of its clients in those rounds is lost). The faulty run must end
    at the θ of the in-process run with exactly those updates dropped (:class:`DropClients`:
    Flower ≡ the simulator, to float rounding)."""
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        return ("Flower node loss: not run (needs the `flower` extra with Flower's simulation "
                "engine, `pip install 'partialfl[flower]'`).")
    from partialfl.build import build
    from partialfl.flower.config import parse_run_config, partition_clients
    from partialfl.flower.simulation import run_simulations

    rounds = size.flower_rounds
    lost_from = rounds // 3
    spec = {"seed": seed, "max_failure_fraction": 0.6,
            "problem": {"name": "least-squares", "num_clients": 8, "n": size.n,
                        "d_theta": size.d_theta, "d_w": size.d_w, "seed": seed},
            "method": {"algorithm": "ffgg", "w_init": "zero"},
            "personalize": {"rounds": rounds, "eval_every": 1,
                            "client": {"name": "gd", "tau": 20}}}
    base = {"spec": spec}
    faulty = {**base, "fault-injection": "; ".join(
        f"crash:partition=1,round={r}" for r in range(lost_from, rounds))}
    t0 = time.perf_counter()
    clean_rep, lost_rep, *hostile = run_simulations(
        [base, faulty, *fault_kinds.hostile_runs(base)], num_supernodes=2, num_cpus=2)
    b = build(parse_run_config(faulty).run)
    problem = b.problem
    gone = partition_clients(problem.num_clients, 2, 1)
    drop = [(r, int(m)) for r in range(lost_from, rounds) for m in gone]
    ev = _ls_metrics(problem.theta_star()["theta"])
    ref = run_rounds(problem, DropClients(b.algorithm, drop), rounds, seed=seed, evaluate=ev,
                     eval_every=1)
    diff = float(np.abs(np.asarray(lost_rep.theta["theta"])
                        - np.asarray(ref.state.theta["theta"])).max())
    attempted = rounds * problem.num_clients
    rows = []
    for rate, rep, extra in ((0.0, clean_rep, {}),
                             (len(drop) / attempted, lost_rep,
                              {"ref_diff": diff, "ref_final": ref.history[-1]["rel_dist2"]})):
        faults = SimpleNamespace(lost=rep.failed_client_updates,
                                 failed=rep.failed_client_updates, nonfinite=0, worker_deaths=0)
        history = [h for h in rep.history if "rel_dist2" in h]
        rows.append(_row("least squares", "flower-sim", rate,
                         {"node loss": rep.failed_client_updates}, faults, attempted, history,
                         "round", seed=seed, lost_partitions=list(rep.lost_partitions),
                         **extra))
    return rows + fault_kinds.hostile_rows(dict(zip(("crash", *fault_kinds.HOSTILE), hostile)),
                                           time.perf_counter() - t0, seed)


def femnist_sync(size: Size, data_dir, seed: int) -> list[dict] | str:
    """Tiny FEMNIST FFGG (output split): faulty vs the same-survivors run (max |Δθ|, and how
    far θ moved). Returns the skip reason instead when the data file is absent."""
    import torch

    from partialfl.algorithms.model import model_ffgg
    from partialfl.build import make_model
    from partialfl.data import DataNotFoundError, load_femnist_npz
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    try:
        data = load_femnist_npz(data_dir, normalize="leaf")
    except DataNotFoundError as e:
        return f"FEMNIST skipped: {e}"
    data = data.subset(np.arange(min(size.femnist_writers, data.num_clients)))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        split = make_split(make_model("emnist_cnn", 62, seed=seed), "output")
        theta0, w_pre = split.params()
        p = ModelProblem(split, data, w_pretrained=w_pre, vectorize=False)

        def alg():
            return model_ffgg(SGDConfig(lr=0.01, epochs=1, batch_size=32), server_opt=SGD(0.05))

        def dist(a, b):
            return max(float((a[n] - b[n]).abs().max()) for n in a)

        rows = []
        R, M = size.femnist_rounds, p.num_clients
        pairs = [(r, m) for r in range(R) for m in range(M)]
        for rate in (0.0, 0.3):
            inj = FaultInjector(alg(), rate, ("raise", "nan"), seed=seed)
            res = run_rounds(p, inj, R, seed=seed, theta0=theta0, max_failure_fraction=0.6)
            lost = [(r, m) for r, m in pairs if inj.faults_at(r, m) is not None]
            diff = 0.0
            if lost:
                ref = run_rounds(p, DropClients(alg(), lost), R, seed=seed, theta0=theta0)
                diff = dist(res.state.theta, ref.state.theta)
            rows.append({**_row("FEMNIST", "sync", rate, _injected(inj, pairs), res.faults,
                                len(pairs), [{"round": R}], "round"),
                         "ref_diff": diff, "moved": dist(res.state.theta, theta0),
                         "seed": seed})
        return rows
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------- report
def _fmt(v, spec=".2e"):
    return "–" if v is None else format(v, spec)


def _reached(r: dict) -> str:
    if r["part"] == "FEMNIST":
        return "–"
    return "not reached" if r["reached"] is None else str(r["reached"])


def _table(rows: list[dict]) -> str:
    head = ("| part | runtime | fault rate | seed | injected (raise / NaN / die / node loss) | "
            "client computations | survived | lost updates | final ‖θ−θ*‖²/‖θ⁰−θ*‖² | tolerance | "
            "step reaching it | same-survivors run: max abs Δθ |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        inj = r["injected"]
        final = _fmt(r["final"]) if r["part"] != "FEMNIST" else \
            f"(θ moved {r['moved']:.2e} from θ⁰)"
        lines.append(
            f"| {r['part']} | {r['runtime']} | {r['rate']:.0%} | {r['seed']} | "
            f"{inj.get('raise', 0)} / {inj.get('nan', 0)} / {inj.get('die', 0)} / "
            f"{inj.get('node loss', 0)} | {r['attempted']} | "
            f"{r['attempted'] - r['lost']} | {r['lost']} | {final} | "
            f"{_fmt(r['tol'], 'g')} | {_reached(r)} | {_fmt(r.get('ref_diff'))} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("sync", "round", "synchronous FFGG"), ("async", "step", "asynchronous (simulated)"),
             ("processes", "step", "asynchronous (worker processes)"),
             ("flower-sim", "round", "Flower simulation (a SuperNode lost)")]
    parts = [p for p in parts if any(r["runtime"] == p[0] for r in rows)]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4.2), squeeze=False)
    axes = axes[0]
    for ax, (rt, xlab, title) in zip(axes, parts):
        for r in rows:
            if r["part"] != "least squares" or r["runtime"] != rt or r["seed"] != rows[0]["seed"]:
                continue
            x, y = zip(*r["curve"])
            ax.semilogy(x, y, label=f"{r['rate']:.0%} faults ({r['lost']} lost)")
        ax.axhline(TOLS[rt], color="grey", ls=":", lw=1)
        ax.set(title=title, xlabel=xlab, ylabel="‖θ − θ*‖² / ‖θ⁰ − θ*‖²")
        ax.legend(fontsize=8)
    fig.suptitle("FFGG on least squares with clients failing at random (raise / NaN / "
                 "worker death) and a lost Flower SuperNode", fontsize=11)
    fig.tight_layout()
    pio.savefig(fig, path, dpi=110)
    plt.close(fig)


@register("reproduction", "faults",
          doc="Fault injection: FFGG with 0-30% of clients raising / NaN / dying workers")
def reproduce_faults(out_dir: Path, *, quick: bool = False, seeds: list[int] | None = None,
                     data_dir: Path | None = None, progress: bool = True) -> Path:
    """Run the study; writes ``summary.md`` (returned), ``results.json`` and ``faults.png``."""
    size = QUICK if quick else FULL
    seeds = tuple(int(s) for s in seeds) if seeds else size.seeds
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    parts = [("least-squares sync", lambda s: least_squares_sync(size, s)),
             ("least-squares async", lambda s: least_squares_async(size, s, False)),
             ("least-squares processes", lambda s: least_squares_async(size, s, True)),
             ("least-squares Flower", lambda s: least_squares_flower(size, s)),
             ("FEMNIST", lambda s: femnist_sync(size, data_dir, s)),
             ("closed worker pool", lambda s: fault_kinds.pool_part(size, s)),
             ("kill between checkpoint files", lambda s: fault_kinds.kill_part(size, s))]
    jobs = [(name, fn, s) for s in seeds for name, fn in parts]
    it = jobs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(jobs, desc="faults")
    timings, kinds = {}, []
    logger = logging.getLogger("partialfl")
    level = logger.level
    logger.setLevel(logging.ERROR)  # thousands of injected faults: counted, not printed
    try:
        for name, fn, s in it:
            t = time.perf_counter()
            out = fn(s)
            timings[f"{name} seed {s}"] = time.perf_counter() - t
            if isinstance(out, str):
                if out not in notes:
                    notes.append(out)
            else:  # the study's rows, and the fault kinds' (a "kind" each)
                rows.extend(r for r in out if "kind" not in r)
                kinds.extend(r for r in out if "kind" in r)
    finally:
        logger.setLevel(level)
    seconds = time.perf_counter() - t0
    pio.write_json(out_dir / "results.json", {"rows": rows, "kinds": kinds, "timings": timings,
                                              "seconds": seconds, "tols": TOLS},
                   indent=1, default=float)
    _plot(rows, out_dir / "faults.png")
    path = out_dir / "summary.md"
    pio.write_text(path, _summary(rows, notes, size, seeds, seconds, quick, kinds))
    return path



def verdict(rows: list[dict]) -> list[str]:
    """The checks the study makes, as sentences (also asserted by the tests)."""
    out = []
    fl = [r for r in rows if r["runtime"] == "flower-sim"]
    if fl:
        clean = [r for r in fl if r["rate"] == 0]
        lost = [r for r in fl if r["rate"] > 0]
        out.append(
            f"Flower simulation: the fault-free run reaches {TOLS['flower-sim']:g}: "
            f"{'yes' if all(r['reached'] is not None for r in clean) else 'NO'}; with a "
            f"SuperNode lost for the last two thirds of the rounds the run goes on and ends "
            f"exactly where the in-process run with the same surviving updates ends (max "
            f"|Δθ| = {max(r['ref_diff'] for r in lost):.1e}; final distance "
            f"{_fmt(lost[0]['final'])} vs {_fmt(lost[0]['ref_final'])}). A node lost for "
            "good takes its clients out of the objective: θ then heads for the survivors' "
            "optimum, not θ* (nothing can recover updates that are never sent).")
    for rt, name in (("sync", "Synchronous FFGG"), ("async", "Asynchronous FFGG (simulated)"),
                     ("processes", "Asynchronous FFGG on worker processes")):
        rs = [r for r in rows if r["part"] == "least squares" and r["runtime"] == rt]
        if not rs:
            continue
        ok = all(r["reached"] is not None for r in rs)
        text = (f"{name} reaches {TOLS[rt]:g} at every fault rate, like the fault-free run: "
                f"{'yes' if ok else 'NO'}")
        if rt == "sync":
            worst = max(r["ref_diff"] for r in rs)
            text += (f"; it ends exactly where the fault-free run with the same surviving "
                     f"updates ends (max |Δθ| = {worst:.1e})")
        out.append(text + ".")
    lost_ok = all(r["lost"] == sum(r["injected"].values()) for r in rows) and all(
        np.isfinite(r["final"] if r["final"] is not None else r["moved"]) for r in rows)
    out.append(f"Every injected fault cost exactly its own update (lost = injected, nothing "
               f"else lost, no NaN in θ): {'yes' if lost_ok else 'NO'}.")
    fem = [r for r in rows if r["part"] == "FEMNIST"]
    if fem:
        out.append(f"FEMNIST: faulty vs same-survivors run: max |Δθ| = "
                   f"{max(r['ref_diff'] for r in fem):.1e} (θ moved "
                   f"{min(r['moved'] for r in fem):.1e} or more from θ⁰).")
    return out


def comparison(rows: list[dict], quick: bool) -> list[str]:
    """Each fault rate against the fault-free run of the same runtime, paired by seed (the
    problem, the faults and the schedule come from the seed): the final distance to θ* with
    the t interval over seeds and its verdict
    (:func:`~partialfl.pipeline.report.error_ratio_section`)."""
    names = {"sync": "synchronous", "async": "asynchronous (simulated)",
             "processes": "asynchronous (worker processes)"}
    pairs = {}
    for rt, name in names.items():
        rs = [r for r in rows if r["part"] == "least squares" and r["runtime"] == rt]
        seeds = sorted({r["seed"] for r in rs})

        def finals(rate: float, rs=rs, seeds=seeds) -> np.ndarray:
            by_seed = {r["seed"]: r["final"] for r in rs if r["rate"] == rate}
            return np.array([by_seed.get(s, np.nan) for s in seeds])

        for rate in sorted({r["rate"] for r in rs} - {0.0}):
            e, b = finals(rate), finals(0.0)
            if not (np.isnan(e).any() or np.isnan(b).any()):
                pairs[f"{name}, {rate:.0%} faults"] = (e, b)
    if not pairs:
        return []
    return ["## Paired comparison with the fault-free run (over seeds)", "",
            *error_ratio_section(pairs, reference="the fault-free run",
                                 error="final ‖θ−θ*‖²/‖θ⁰−θ*‖²", verdict=not quick),
            "", "Negative: the faulty run ends farther from θ* than the fault-free run "
            "with the same seed (fewer updates were averaged); 'no detectable difference': "
            "within the seed-to-seed spread. The Flower and FEMNIST rows are exactness checks "
            "(the faulty run against the run with the same surviving updates, max |Δθ|), not "
            "comparisons of final errors, so they have no interval.", ""]


def _summary(rows, notes, size: Size, seeds, seconds: float, quick: bool, kinds=()) -> str:
    return "\n".join([
        f"# faults: FFGG with clients failing at random{' (quick)' if quick else ''}",
        "",
        f"Least squares: {size.clients} clients, n = {size.n}, d_θ = {size.d_theta}, "
        f"d_w = {size.d_w}; FFGG with CG (10 steps), server SGD lr 1/L halved every "
        f"{size.halve_every} rounds (asynchronous: 1/(LM), every {size.halve_every}·M "
        f"steps); {size.rounds} synchronous rounds (full participation), "
        f"{size.async_steps} simulated asynchronous steps (4 active clients), "
        f"{size.process_steps} steps on 2 worker processes. FEMNIST: {size.femnist_writers} "
        f"writers, {size.femnist_rounds} rounds, output-layer split. Seeds {list(seeds)}.",
        "",
        _table(rows),
        "",
        *[f"* {v}" for v in verdict(rows)],
        *[f"* {n}" for n in notes],
        "",
        *comparison(rows, quick),
        "'client computations': client updates the runtime asked for (asynchronous: jobs "
        "that finished); 'lost updates': skipped by the runtime (raised, non-finite or worker "
        "died) — never averaged. 'same-survivors run': the fault-free run in which exactly the "
        "lost (round, client) updates are removed before they are sent.",
        "",
        "Plot: `faults.png` (distance to θ* per round / step for each fault rate).",
        "",
        *fault_kinds.section(list(kinds)),
        f"Wall-clock: {seconds:.1f} s.",
        "",
    ])


def load_results(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "results.json").read_text())
