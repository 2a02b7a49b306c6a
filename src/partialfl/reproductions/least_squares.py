"""Reproductions of the paper's Figure 1 (Sec. 4.2) on Example 1.

* ``ls-tau``     — Figure 1(a): FFGG with CG fine-tuning, τ ∈ {1, 5, 10, 20, 30, 40}.
* ``ls-compare`` — Figure 1(b–d): FFGG (GD fine-tuner) vs Scaffold, Local GD and L2GD,
  τ ∈ {100, 200, 500}.

Each writes ``<run>.jsonl`` per run, PNG plots (log-scale error vs communication rounds and vs
local gradient computations), and ``summary.md`` into the output folder. The sweeps and sizes
come from ``configs/ls-tau.toml`` and ``configs/ls-compare.toml`` (``[quick]`` is merged over
``[base]`` with ``--quick``).
"""

from __future__ import annotations

import os
import time
from importlib import resources
from pathlib import Path

from partialfl import io as pio
from partialfl.build import problem_of
from partialfl.config import ConfigError, deep_merge, load_toml
from partialfl.pipeline.closed_form import load_closed_form, run_closed_form, summary_markdown
from partialfl.pipeline.jobs import run_jobs
from partialfl.pipeline.report import REL_DIST2, error_ratio_section, plot_curves, quick_note
from partialfl.registry import register


def load_sweep(name: str, quick: bool) -> tuple[list[str], list[int], dict]:
    """(methods, taus, base config dict) of a packaged sweep config."""
    path = resources.files("partialfl") / "configs" / f"{name}.toml"
    with resources.as_file(path) as p:
        data = load_toml(p)
    sweep = data.get("sweep", {})
    base = data.get("base", {})
    if quick:
        base = deep_merge(base, data.get("quick", {}))
    methods = list(sweep.get("methods", ["ffgg"]))
    taus = [int(t) for t in sweep.get("tau", [])]
    if not taus:
        raise ConfigError(f"{name}: [sweep] tau is empty")
    return methods, taus, base


def _single_thread() -> None:
    """Worker initialiser: one BLAS thread per worker process (the workers share the cores)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)


def _run_job(job: tuple[dict, str, bool]) -> tuple[list[dict], float]:
    cfg_dict, out_dir, progress = job
    cfg = load_closed_form(cfg_dict)
    t0 = time.perf_counter()
    res = run_closed_form(cfg, Path(out_dir), progress=cfg.name if progress else False)
    return res.history, time.perf_counter() - t0


def run_sweep(name: str, out_dir: Path, quick: bool, seeds, progress: bool,
              workers: int | None = None) -> list[dict]:
    """Run every (seed, method, τ) of a packaged sweep; returns one row per run.

    Runs are independent, so they are spread over ``workers`` processes (default: one per
    core, at most 2; :func:`~partialfl.pipeline.jobs.run_jobs`), each limited to one BLAS
    thread. Problems are built once in this process before the workers fork, so the workers
    share them.
    """
    methods, taus, base = load_sweep(name, quick)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, jobs = [], []
    for seed in seeds or [0]:
        for method in methods:
            for tau in taus:
                cfg_dict = deep_merge(base, {"method": {"algorithm": method, "label": method},
                                             "personalize": {"client": {"tau": tau}},
                                             "seed": seed, "problem": {"seed": seed}})
                run_name = f"{method}-tau{tau}" + (f"-seed{seed}" if seeds else "")
                cfg_dict = {**cfg_dict, "name": run_name}
                load_closed_form(cfg_dict)  # validate everything before running anything
                rows.append({"method": method, "tau": tau, "seed": seed, "name": run_name})
                jobs.append(cfg_dict)
    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        results = [_run_job((j, str(out_dir), progress)) for j in jobs]
    else:
        for j in jobs:  # build (and cache) each problem once, before forking
            problem_of(load_closed_form(j))
        results = run_jobs(_run_job, [(j, str(out_dir), False) for j in jobs], workers,
                           progress and name, start_method="fork", ordered=True,
                           setup=_single_thread)
    for row, (history, seconds) in zip(rows, results):
        row["history"], row["seconds"] = history, seconds
    return rows


def _size_notes(name: str, quick: bool, rows: list[dict]) -> list[str]:
    """What this run was (sizes of the sweep's config), and for a quick run that its size
    cannot support a verdict."""
    _, _, base = load_sweep(name, quick)
    p, r = base.get("problem", {}), base.get("personalize", {})
    size = (f"{p.get('num_clients')} clients × {p.get('n'):,} rows, d_θ = {p.get('d_theta')}, "
            f"d_w = {p.get('d_w')}, {r.get('rounds')} rounds, seeds "
            f"{sorted({row['seed'] for row in rows})}")
    return [quick_note(size) if quick else f"Size: {size} (the paper's Example 1).", ""]


def _coinciding(rows: list[dict], rtol: float = 0.01) -> list[str]:
    """A note naming the τ whose final distances agree within ``rtol`` (their curves lie on
    top of each other; the plot staggers their markers)."""
    groups: list[list[dict]] = []
    for r in sorted(rows, key=lambda r: r["history"][-1]["rel_dist2"]):
        v = r["history"][-1]["rel_dist2"]
        if groups and abs(v - groups[-1][0]["history"][-1]["rel_dist2"]) <= rtol * v:
            groups[-1].append(r)
        else:
            groups.append([r])
    return [f"τ ∈ {{{', '.join(str(r['tau']) for r in sorted(g, key=lambda r: r['tau']))}}} "
            f"end within {rtol:.0%} of each other, so their curves coincide in the plot (each "
            "has its own line style and markers)." for g in groups if len(g) > 1]


def comparison(rows: list[dict], pairs: dict[str, tuple[dict, dict]], reference: str,
               quick: bool) -> list[str]:
    """The paired comparison over seeds of the final ‖θ − θ*‖²/‖θ*‖² of runs matching each
    ``label -> (run keys, reference run keys)`` (e.g. ``({"method": "scaffold", "tau": 100},
    {"method": "ffgg", "tau": 100})``): the seed draws the problem (and any sampling), both
    sides use the same seeds (:func:`~partialfl.pipeline.report.error_ratio_section`)."""
    import numpy as np

    seeds = sorted({r["seed"] for r in rows})

    def finals(key: dict) -> np.ndarray:
        by_seed = {r["seed"]: r["history"][-1]["rel_dist2"] for r in rows
                   if all(r[k] == v for k, v in key.items())}
        return np.array([by_seed[s] for s in seeds])

    return ["## Paired comparison over seeds", "",
            *error_ratio_section({lab: (finals(a), finals(b)) for lab, (a, b) in pairs.items()},
                                 reference=reference, error=f"final {REL_DIST2}",
                                 verdict=not quick), ""]


@register("reproduction", "ls-tau",
          doc="Figure 1(a): FFGG with CG, tau in {1,5,10,20,30,40} on least squares")
def reproduce_tau(out_dir: Path, *, quick: bool = False, seeds=None, data_dir=None,
                  progress: bool = True) -> Path:
    """Figure 1(a): FFGG + CG for several τ; more local work → faster convergence."""
    out_dir = Path(out_dir)
    rows = run_sweep("ls-tau", out_dir, quick, seeds, progress)
    first = [r for r in rows if r["seed"] == rows[0]["seed"]]  # plots: the first seed
    curves = {f"τ = {r['tau']}": r["history"] for r in first}
    plot_curves(out_dir / "ls_tau.png", [curves],
                titles=["FFGG (CG fine-tuning), Example 1"], x="round", y="rel_dist2",
                ylabel=REL_DIST2)
    plot_curves(out_dir / "ls_tau_F.png", [curves], titles=["FFGG (CG)"], x="round",
                y="F_norm2", ylabel="‖F(θʳ)‖²")
    notes = [f"Plots: `ls_tau.png` (relative squared distance to θ*), `ls_tau_F.png` (‖F‖²), "
             f"seed {rows[0]['seed']}.",
             *_coinciding(first),
             "Loss gap: (1/M)Σ f_m(θ, w_m) − min_{θ,w} f_m with w_m from the CG fine-tuner."]
    taus = sorted({r["tau"] for r in rows})
    notes = _size_notes("ls-tau", quick, rows) + notes + [""] + comparison(
        rows, {f"τ = {t}": ({"tau": t}, {"tau": taus[0]}) for t in taus[1:]},
        f"τ = {taus[0]}", quick)
    path = out_dir / "summary.md"
    title = "ls-tau: Figure 1(a)" + (" (quick)" if quick else "")
    pio.write_text(path, summary_markdown(rows, title, notes))
    return path


@register("reproduction", "ls-compare",
          doc="Figure 1(b-d): FFGG (GD) vs Scaffold, Local GD, L2GD, tau in {100,200,500}")
def reproduce_compare(out_dir: Path, *, quick: bool = False, seeds=None, data_dir=None,
                      progress: bool = True) -> Path:
    """Figure 1(b–d): FFGG (GD) vs Scaffold, Local GD and L2GD for each τ."""
    out_dir = Path(out_dir)
    rows = run_sweep("ls-compare", out_dir, quick, seeds, progress)
    taus = sorted({r["tau"] for r in rows})
    panels = [{r["method"]: r["history"] for r in rows
               if r["tau"] == t and r["seed"] == rows[0]["seed"]} for t in taus]  # first seed
    titles = [f"τ = {t}" for t in taus]
    plot_curves(out_dir / "ls_compare_rounds.png", panels, titles, x="round", y="rel_dist2",
                ylabel=REL_DIST2)
    plot_curves(out_dir / "ls_compare_grads.png", panels, titles, x="grad_evals",
                y="rel_dist2", ylabel=REL_DIST2,
                xlabel="local gradient computations per client")
    plot_curves(out_dir / "ls_compare_loss.png", panels, titles, x="round", y="loss_gap",
                ylabel="(1/M)Σ f_m(deployed) − min f_m")
    notes = [
        "Plots: `ls_compare_rounds.png` and `ls_compare_grads.png` (distance of the global θ "
        "to θ*), `ls_compare_loss.png` (personalized loss gap of the deployed models), seed "
        f"{rows[0]['seed']}.",
        "Local GD and Scaffold train one shared (θ, w); L2GD trains one full model per client "
        "and is compared through the θ-part of its average model x̄ and its clients' own "
        "models. Only FFGG targets θ*, the solution of the partially personalized problem.",
    ]
    ref, *others = dict.fromkeys(r["method"] for r in rows)  # the sweep's first: FFGG
    notes = _size_notes("ls-compare", quick, rows) + notes + [""] + comparison(
        rows, {f"{m}, τ = {t}": ({"method": m, "tau": t}, {"method": ref, "tau": t})
               for t in taus for m in others}, f"{ref.upper()} (same τ)", quick)
    path = out_dir / "summary.md"
    title = "ls-compare: Figure 1(b–d)" + (" (quick)" if quick else "")
    pio.write_text(path, summary_markdown(rows, title, notes))
    return path
