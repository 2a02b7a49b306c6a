"""``partialfl reproduce async``: asynchronous FFGG (the paper's Algorithm 3) vs baselines.

Problem: the overpersonalized, heterogeneous least-squares instance
(:class:`~partialfl.problems.overpersonalized.OverpersonalizedLeastSquares`, 30 clients,
n = 6, d_θ = 10, d_w = 4): every client fits its data at θ* with its own w♮_m, no shared
(θ, w) fits them all. Devices: per-client speeds from a log-normal distribution (σ = 1;
max/min speed reported, > 10×), per-job work ~ Exp(1), so a job of client m lasts
Exp(1)/speed_m; 8 clients are active at a time (simulated clock,
:func:`~partialfl.runtime.asynchronous.run_async`).

Methods, all within the same simulated wall-clock budget T:

* async FFGG — exact fine-tuning, θ ← θ − γ∇₁f_m(θ_stale, w*_m(θ_stale)) on each arrival;
  also with Theorem 3's γ = 1/(2L√(2Mτ_max)), τ_max the largest delay of the schedule;
* sync FFGG — 8 sampled clients per round, the round lasts as long as its slowest client;
* buffered FFGG — FedBuff's server rule (K = 4) on FFGG's gradients;
* FedBuff — the non-personalized baseline (Nguyen et al., 2022): Local GD (5 steps, 1/L_m) on
  the shared (θ, w), buffer K = 4, staleness weight (1 + τ)^−½, server lr η;
* async SGD — FedAsync-style SGD on the shared (θ, w): x ← x − γ·(1 + τ)^−½·∇f_m(x_stale).

Each method's stepsize is the best (lowest final ‖θ − θ*‖²) of the same grid, per seed.
Plus a short run of async FFGG on real worker processes (2 workers, really sleeping for their
clients' compute times) beside the simulated run with the same settings.

Outputs: ``async_seed{s}.jsonl`` (every evaluation of every run), ``async_error_steps.png``,
``async_error_time.png``, ``async_delays.png``, ``summary.md``.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partialfl import io as pio
from partialfl.algorithms.asynchronous import FedAsync, FedBuff, joint_sgd
from partialfl.algorithms.fedavg import LocalGD
from partialfl.algorithms.ffgg import FFGG
from partialfl.build import make_solver
from partialfl.pipeline.report import (
    REL_DIST2,
    STYLES,
    error_ratio_section,
    markdown_table,
    quick_note,
)
from partialfl.problems.overpersonalized import OverpersonalizedLeastSquares
from partialfl.registry import register
from partialfl.runtime import JsonlLogger, run_rounds
from partialfl.runtime.asynchronous import (
    ComputeTimeModel,
    Distribution,
    device_speeds,
    run_async,
    synchronous_round_times,
)
from partialfl.runtime.processes import run_processes
from partialfl.server import SGD


@dataclass(frozen=True)
class AsyncStudy:
    """Sizes, device model and stepsize grid of the ``async`` reproduction (see the module
    docstring)."""

    num_clients: int = 30
    n: int = 6
    d_theta: int = 10
    d_w: int = 4
    heterogeneity: float = 1.0
    concurrency: int = 8
    speed_sigma: float = 1.0          # log-normal device speeds exp(σ·N(0, 1))
    time_budget: float = 1500.0       # simulated wall-clock T
    lr_grid: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)
    buffer_size: int = 4
    local_steps: int = 5
    eval_every: int = 40              # arrivals between evaluations (async runs)
    process_steps: int = 1500         # real-concurrency demo (0: skip)
    process_workers: int = 2
    process_time_unit: float = 0.002  # seconds per unit of simulated time


FULL = AsyncStudy()
QUICK = AsyncStudy(num_clients=20, time_budget=300.0, lr_grid=(1.0, 0.25), eval_every=20,
                   process_steps=60)

METHODS = ("async FFGG", "async FFGG (Theorem 3 γ)", "sync FFGG", "buffered FFGG",
           "FedBuff (shared model)", "async SGD (shared model)")


def _metrics(star: np.ndarray):
    s2 = float(star @ star)

    def evaluate(algorithm, state, problem, client_state, ctx) -> dict:
        d = algorithm.global_theta(state, problem)["theta"] - star
        return {"dist2": float(d @ d), "rel_dist2": float(d @ d) / s2}

    return evaluate


def _factories(problem, study: AsyncStudy) -> dict:
    """method -> (stepsize scale c -> algorithm) for the asynchronous methods."""
    L = problem.L
    Lj = float(problem.L_joint_clients.max())
    exact = make_solver("exact")
    return {
        "async FFGG": lambda c: FFGG(exact, SGD(lr=c / L)),
        "buffered FFGG": lambda c: FedBuff(FFGG(exact, SGD(lr=c / L)), study.buffer_size),
        "FedBuff (shared model)": lambda c: FedBuff(
            LocalGD(study.local_steps, server_opt=SGD(lr=c)), study.buffer_size,
            staleness="polynomial", a=0.5),
        "async SGD (shared model)": lambda c: FedAsync(joint_sgd(c / Lj), "polynomial", a=0.5),
    }


def _stepsize_label(method: str, c: float) -> str:
    if method == "FedBuff (shared model)":
        return f"η = {c:g}"
    if method == "async SGD (shared model)":
        return f"γ = {c:g}/L_joint"
    return f"γ = {c:g}/L"


def run_seed(study: AsyncStudy, out_dir: Path, seed: int, progress: bool) -> dict:
    """Every method of the study for one seed, plus the worker-process run; writes
    ``async_seed{seed}.jsonl`` and returns the seed's results."""
    problem = OverpersonalizedLeastSquares(
        num_clients=study.num_clients, n=study.n, d_theta=study.d_theta, d_w=study.d_w,
        heterogeneity=study.heterogeneity, seed=seed)
    star = problem.theta_star()["theta"]
    evaluate = _metrics(star)
    speeds = device_speeds(study.num_clients, Distribution("log-normal", 1.0, study.speed_sigma),
                           seed)
    model = ComputeTimeModel(Distribution("exponential", 1.0), speed=speeds)
    T, C = study.time_budget, study.concurrency
    log_path = out_dir / f"async_seed{seed}.jsonl"
    log_path.unlink(missing_ok=True)
    runs: dict[str, dict] = {}

    def log(method, label):
        return JsonlLogger(log_path, append=True, method=method, stepsize=label, seed=seed)

    jobs = [(m, c) for m in _factories(problem, study) for c in study.lr_grid]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs) + len(study.lr_grid) + 1, desc=f"async seed {seed}",
                   mininterval=0.5)
    factories = _factories(problem, study)
    for method, c in jobs:
        label = _stepsize_label(method, c)
        t0 = time.perf_counter()
        with log(method, label) as lg, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # diverging baselines overflow
            res = run_async(problem, factories[method](c), max_time=T, concurrency=C,
                            compute_time=model, seed=seed, evaluate=evaluate,
                            eval_every=study.eval_every, logger=lg, record_events=False)
        _keep_best(runs, method, label, res.history, res.staleness, time.perf_counter() - t0,
                   c)
        if bar is not None:
            bar.update(1)
    # Theorem 3: τ_max of this schedule (the same for every FFGG run: delays do not depend
    # on θ, and θ changes on every arrival), γ = 1/(2L√(2Mτ_max)).
    tau_max = int(runs["async FFGG"]["staleness"].max())
    gamma = 1.0 / (2 * problem.L * math.sqrt(2 * problem.num_clients * tau_max))
    label = f"γ = 1/(2L√(2Mτ_max)) = {gamma * problem.L:.2g}/L"
    t0 = time.perf_counter()
    with log("async FFGG (Theorem 3 γ)", label) as lg:
        res = run_async(problem, FFGG(make_solver("exact"), SGD(lr=gamma)), max_time=T,
                        concurrency=C, compute_time=model, seed=seed, evaluate=evaluate,
                        eval_every=study.eval_every, logger=lg, record_events=False)
    _keep_best(runs, "async FFGG (Theorem 3 γ)", label, res.history, res.staleness,
               time.perf_counter() - t0)
    if bar is not None:
        bar.update(1)
    # Synchronous FFGG: as many rounds as fit in T.
    times = synchronous_round_times(model, problem, _rounds_upper(model, problem, C, T, seed),
                                    C, seed)
    rounds = int(np.searchsorted(times, T, side="right")) - 1
    for c in study.lr_grid:
        label = _stepsize_label("sync FFGG", c)
        t0 = time.perf_counter()
        res = run_rounds(problem, FFGG(make_solver("exact"), SGD(lr=c / problem.L)),
                         rounds, clients_per_round=C, seed=seed, evaluate=evaluate,
                         eval_every=max(1, study.eval_every // C))
        # Simulated time of a round: its slowest sampled client (run_rounds' "time" is real).
        hist = [{**h, "step": h["round"] * C, "time": float(times[h["round"]])}
                for h in res.history]
        with log("sync FFGG", label) as lg:
            for h in hist:
                lg.log(h)
        _keep_best(runs, "sync FFGG", label, hist, None, time.perf_counter() - t0)
        if bar is not None:
            bar.update(1)
    for method in runs:
        with JsonlLogger(log_path, append=True, method=method, seed=seed) as lg:
            lg.log({"chosen": runs[method]["stepsize"]})
    processes = None
    if study.process_steps:
        processes = _real_concurrency(problem, study, model, seed, evaluate, runs)
    if bar is not None:
        bar.update(1)
        bar.close()
    return {"seed": seed, "runs": runs, "speeds": speeds, "theta_star2": float(star @ star),
            "shared_floor": _shared_floor(problem), "processes": processes,
            "sync_rounds": rounds, "tau_max": tau_max}


def _rounds_upper(model, problem, C, T, seed) -> int:
    """Enough synchronous rounds to exceed T (doubling search)."""
    r = 64
    while synchronous_round_times(model, problem, r, C, seed)[-1] <= T:
        r *= 2
    return r


def _shared_floor(problem) -> float:
    x = problem.shared_optimum()[: problem.d_theta]
    d = x - problem.theta_star()["theta"]
    return float(d @ d)


def _keep_best(runs, method, label, history, staleness, seconds, scale=None) -> None:
    final = history[-1]["dist2"]
    final = final if final == final else math.inf
    cur = runs.get(method)
    if cur is None or final < cur["final"]:
        runs[method] = {"stepsize": label, "scale": scale, "history": history,
                        "staleness": staleness, "final": final, "seconds": seconds}


def _real_concurrency(problem, study, model, seed, evaluate, runs) -> dict:
    """Async FFGG with the chosen γ on real worker processes vs the simulated clock with the
    same number of workers and steps."""
    label, c = runs["async FFGG"]["stepsize"], runs["async FFGG"]["scale"]
    alg = FFGG(make_solver("exact"), SGD(lr=c / problem.L))
    W, steps = study.process_workers, study.process_steps
    t0 = time.perf_counter()
    real = run_processes(problem, alg, steps=steps, concurrency=W, compute_time=model,
                         time_unit=study.process_time_unit, seed=seed, evaluate=evaluate,
                         eval_every=steps)
    wall = time.perf_counter() - t0
    sim = run_async(problem, alg, steps=steps, concurrency=W, compute_time=model, seed=seed,
                    evaluate=evaluate, eval_every=steps)
    return {"stepsize": label, "workers": W, "steps": steps, "wall": wall,
            "busy_mean": float(real.steps["busy"].mean()),
            "real": {"final": real.history[-1]["dist2"], "tau_max": int(real.staleness.max()),
                     "tau_mean": float(real.staleness.mean()),
                     "time": float(real.steps["arrival_time"][-1])},
            "sim": {"final": sim.history[-1]["dist2"], "tau_max": int(sim.staleness.max()),
                    "tau_mean": float(sim.staleness.mean()),
                    "time": float(sim.steps["arrival_time"][-1]) * study.process_time_unit}}


# ---------------------------------------------------------------------------------------------
# report


def _plot_errors(seed_result: dict, path: Path, x: str, xlabel: str, T: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for i, method in enumerate(METHODS):
        r = seed_result["runs"].get(method)
        if r is None:
            continue
        hist = r["history"]
        xs = [h[x] + 1 if x == "round" else h[x] for h in hist]  # log axis: steps + 1
        ys = [min(max(h["dist2"], 1e-32), 1e32) if h["dist2"] == h["dist2"] else np.nan
              for h in hist]
        # own line style, earlier methods wider: curves that coincide stay visible
        # (a marker at the last point shows where a run that lies under another one ends)
        ax.plot(xs, ys, lw=1.2 + 0.5 * (len(METHODS) - 1 - i), ls=STYLES[i % len(STYLES)][0],
                marker=STYLES[i % len(STYLES)][1], markevery=[len(xs) - 1], ms=7, mfc="none",
                mew=1.5, alpha=0.85, label=f"{method} ({r['stepsize']})")
    ax.axhline(seed_result["shared_floor"], color="gray", ls=":", lw=1,
               label="‖θ̄* − θ*‖² of the best shared model")
    ax.set_yscale("log")
    if x == "round":
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("‖θ − θ*‖²")
    ax.set_title(f"overpersonalized least squares, seed {seed_result['seed']}"
                 + (f", simulated budget T = {T:g}" if T else ""), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    pio.savefig(fig, path, dpi=120)
    plt.close(fig)


def _plot_delays(seed_result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tau = seed_result["runs"]["async FFGG"]["staleness"]
    sp = np.sort(seed_result["speeds"])[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.hist(tau, bins=np.arange(tau.max() + 2) - 0.5 if tau.max() < 60 else 60, color="C0")
    a1.set_yscale("log")
    a1.set_xlabel("delay τ of the applied update (server steps)")
    a1.set_ylabel("updates")
    a1.set_title(f"async FFGG: {len(tau)} updates, mean τ = {tau.mean():.1f}, "
                 f"max τ = {tau.max()}", fontsize=10)
    a2.bar(np.arange(len(sp)), sp, color="C1")
    a2.set_yscale("log")
    a2.set_xlabel("client (sorted)")
    a2.xaxis.set_major_locator(MaxNLocator(integer=True))
    a2.set_ylabel("device speed")
    a2.set_title(f"device speeds: max/min = {sp[0] / sp[-1]:.0f}×", fontsize=10)
    for a in (a1, a2):
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    pio.savefig(fig, path, dpi=120)
    plt.close(fig)


def _first_time_below(history, thr) -> float:
    for h in history:
        if h["rel_dist2"] <= thr:
            return h["time"]
    return math.nan


def comparison(results: list[dict], quick: bool) -> list[str]:
    """Every method's final relative error against async FFGG's, paired by seed (the
    problem, the device speeds and the schedule come from the seed), with the t interval
    over seeds and its verdict (:func:`~partialfl.pipeline.report.error_ratio_section`)."""
    ref = "async FFGG"

    def finals(method: str) -> np.ndarray:
        return np.array([r["runs"][method]["history"][-1]["rel_dist2"] for r in results])

    pairs = {m: (finals(m), finals(ref)) for m in METHODS
             if m != ref and all(m in r["runs"] for r in results)}
    return error_ratio_section(pairs, reference=ref, error=f"final {REL_DIST2}",
                               verdict=not quick)


def _summary(results: list[dict], study: AsyncStudy, quick: bool, seconds: float) -> str:
    seeds = [r["seed"] for r in results]
    spreads = [float(r["speeds"].max() / r["speeds"].min()) for r in results]
    lines = ["# async: asynchronous FFGG on overpersonalized least squares"
             + (" (quick)" if quick else ""), "",
             f"{study.num_clients} clients (n = {study.n}, d_θ = {study.d_theta}, "
             f"d_w = {study.d_w}), {study.concurrency} active at a time, simulated budget "
             f"T = {study.time_budget:g}; job time Exp(1)/speed_m with log-normal speeds "
             f"(σ = {study.speed_sigma}); max/min speed per seed: "
             + ", ".join(f"{s:.0f}×" for s in spreads) + f". Seeds {seeds}; "
             "each method's stepsize is its best on the grid "
             f"{', '.join(f'{c:g}' for c in study.lr_grid)} (× 1/L, 1/L_joint, or η), per seed.",
             ""]
    if quick:
        lines += [quick_note(f"{study.num_clients} clients, budget T = {study.time_budget:g}, "
                             f"{len(study.lr_grid)} stepsizes, {len(seeds)} seed(s)"), ""]
    header = ["method", "stepsize (seed " + str(seeds[0]) + ")", "server steps",
              "client updates", "mean / max delay", f"final {REL_DIST2} (median; θ⁰ = 0)",
              "time to 1e-8 (median)"]
    rows = []
    for method in METHODS:
        per = [r["runs"][method] for r in results if method in r["runs"]]
        if not per:
            continue
        last = per[0]["history"][-1]
        finals = [p["history"][-1]["rel_dist2"] for p in per]
        hits = [_first_time_below(p["history"], 1e-8) for p in per]
        st = per[0]["staleness"]
        rows.append([
            method, per[0]["stepsize"], last["round"], last["step"],
            "—" if st is None else f"{st.mean():.1f} / {st.max()}",
            f"{float(np.median(finals)):.2e}",
            "not reached" if all(h != h for h in hits) else f"{np.nanmedian(hits):.0f}",
        ])
    lines += [markdown_table(header, rows), ""]
    lines += ["## Paired comparison with async FFGG (over seeds)", "",
              *comparison(results, quick), ""]
    floor = [r["shared_floor"] / r["theta_star2"] for r in results]
    lines += ["Best possible shared model (non-personalized optimum x̄*): ‖θ̄* − θ*‖²/‖θ*‖² = "
              + ", ".join(f"{f:.3g}" for f in floor) + " per seed.",
              f"Synchronous FFGG fits {results[0]['sync_rounds']} rounds of "
              f"{study.concurrency} clients in T (seed {seeds[0]}): every round waits for its "
              "slowest sampled device.", ""]
    pr = results[0]["processes"]
    if pr:
        lines += ["## Real concurrency (worker processes)", "",
                  f"Async FFGG ({pr['stepsize']}) on {pr['workers']} worker processes that "
                  f"sleep for their client's compute time ({study.process_time_unit * 1e3:g} ms "
                  f"per simulated unit), {pr['steps']} updates applied in arrival order, vs. "
                  "the simulated clock with the same workers and steps (seed "
                  f"{seeds[0]}); wall time {pr['wall']:.1f} s including worker start-up, mean "
                  f"real compute per job {pr['busy_mean'] * 1e3:.2f} ms.", "",
                  markdown_table(["runtime", "final ‖θ−θ*‖²", "mean / max delay",
                                  "time of last update (s)"],
                                 [["worker processes", f"{pr['real']['final']:.2e}",
                                   f"{pr['real']['tau_mean']:.2f} / {pr['real']['tau_max']}",
                                   f"{pr['real']['time']:.2f}"],
                                  ["simulated clock", f"{pr['sim']['final']:.2e}",
                                   f"{pr['sim']['tau_mean']:.2f} / {pr['sim']['tau_max']}",
                                   f"{pr['sim']['time']:.2f}"]]), ""]
    lines += ["Plots: `async_error_steps.png` (vs server steps, i.e. changes of θ; log "
              "axis), `async_error_time.png` (vs simulated wall-clock), `async_delays.png` "
              "(delay histogram of async FFGG and the device speeds), all for seed "
              f"{seeds[0]}. Metrics of every run: `async_seed<s>.jsonl`.",
              f"Total time: {seconds:.0f} s.", ""]
    return "\n".join(lines)


@register("reproduction", "async",
          doc="Asynchronous FFGG vs sync FFGG, FedBuff, async SGD on least squares")
def reproduce_async(out_dir: Path, *, quick: bool = False, seeds: list[int] | None = None,
                    data_dir: Path | None = None, progress: bool = True) -> Path:
    """Run the study, write JSONL, plots and ``summary.md``; returns the summary path."""
    study = QUICK if quick else FULL
    seeds = list(seeds) if seeds else ([0] if quick else [0, 1, 2])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = [run_seed(study, out_dir, s, progress) for s in seeds]
    first = results[0]
    _plot_errors(first, out_dir / "async_error_steps.png", "round",
                 "server steps (θ updates) + 1", None)
    _plot_errors(first, out_dir / "async_error_time.png", "time", "simulated wall-clock time",
                 study.time_budget)
    _plot_delays(first, out_dir / "async_delays.png")
    path = out_dir / "summary.md"
    pio.write_text(path, _summary(results, study, quick, time.perf_counter() - t0))
    return path
