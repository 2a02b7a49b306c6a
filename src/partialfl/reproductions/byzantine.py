"""``partialfl reproduce byzantine``: Byzantine-robust FFGG (the paper's Algorithm 5).

Problem: the overpersonalized, heterogeneous least-squares instance
(:class:`~partialfl.problems.overpersonalized.OverpersonalizedLeastSquares`, 30 clients with
n = 6 examples, d_θ = 10, d_w = 4): every client fits its data exactly at θ* with its own
w*_m, so F_m(θ*) = 0 for every client, while no shared (θ, w) fits them all and no client can
identify θ* alone. A fraction δ ∈ {10%, 20%} of the clients is Byzantine (ids drawn with
``generator(seed, "byzantine")``), every client participates in every round.

Grid: every attack (none, ALIE, IPM ε = 0.1, IPM ε = 10, sign flip, Gaussian σ = 1, bit flip,
mimic, Inf, and ALIE / IPM with their scale tuned against the defence of the round) ×
aggregator (mean, CM, GM, Krum, CC, MDA, Meamed, CAF, SMEA) × {no bucketing, bucketing
s = 2}, for

* BR-FFGG: exact fine-tuning, g_m = ∇₁f_m(θ, w*_m(θ)), θ ← θ − Agg(g)/L (γ = 1/L of Example 1);
* the robust non-personalized baseline: the same aggregators on full gradients ∇f_m(x) of one
  shared x = (θ, w), x ← x − Agg(∇f)/L_joint (clients send Δ = −∇f_m(x), and the attacks act
  on what is sent; the aggregators are odd-equivariant, Agg(−X) = −Agg(X)).

Outputs: ``byzantine_delta{δ}_seed{s}.jsonl`` (every evaluation of every cell), plots of
‖θ − θ*‖² vs rounds (one panel per attack) for both methods and each δ, and ``summary.md``
with the table of final ‖θ − θ*‖² per attack × aggregator × bucketing.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partialfl import io as pio
from partialfl.aggregation.common import count
from partialfl.algorithms.asynchronous import joint_sgd
from partialfl.algorithms.byzantine import ByzantineConfig, ByzantineRobust
from partialfl.algorithms.ffgg import FFGG
from partialfl.build import make_aggregator, make_attack, make_solver
from partialfl.pipeline.report import error_ratio_section, markdown_table, quick_note
from partialfl.problems.overpersonalized import OverpersonalizedLeastSquares
from partialfl.registry import register
from partialfl.runtime import JsonlLogger, run_rounds
from partialfl.server import SGD

#: (label, attack name, options)
ATTACK_GRID: tuple[tuple[str, str, dict], ...] = (
    ("none", "none", {}),
    ("ALIE", "alie", {}),
    ("IPM ε=0.1", "ipm", {"epsilon": 0.1}),
    ("IPM ε=10", "ipm", {"epsilon": 10.0}),
    ("sign flip", "sign-flip", {}),
    ("Gaussian σ=1", "gaussian", {"sigma": 1.0}),
    ("bit flip", "bit-flip", {}),
    ("mimic", "mimic", {}),
    ("Inf", "inf", {}),
    ("ALIE-opt", "alie-opt", {}),
    ("IPM-opt", "ipm-opt", {}),
)
#: MoNNA is not in the grid: it needs a trusted reference the server chose (its own update),
#: and this study's server holds no data (a client's row may be Byzantine).
AGGREGATOR_GRID = ("mean", "cm", "gm", "krum", "cc", "mda", "meamed", "caf", "smea")
#: exhaustive rules (C(k, f) subsets per call) are skipped in cells with more subsets than this
MAX_SUBSETS = 20_000
KINDS = {"br-ffgg": "BR-FFGG (partially personalized)",
         "shared": "robust SGD on the shared model (non-personalized)"}


@dataclass(frozen=True)
class ByzantineStudy:
    """Sizes, Byzantine fractions, rounds and the success threshold of the ``byzantine``
    reproduction (see the module docstring)."""

    num_clients: int = 30
    n: int = 6
    d_theta: int = 10
    d_w: int = 4
    heterogeneity: float = 1.0
    fractions: tuple[float, ...] = (0.1, 0.2)
    rounds: int = 1500
    bucket_size: int = 2
    eval_every: int = 10
    #: "converged" in the observations: final ‖θ − θ*‖² ≤ this · ‖θ*‖²
    threshold: float = 1e-10
    #: aggregator evaluations of the line search of ALIE-opt / IPM-opt per round (byzfl: 20)
    opt_evals: int = 20
    #: a part of the grid (attack labels of ATTACK_GRID, names of AGGREGATOR_GRID); empty:
    #: all of it
    attacks: tuple[str, ...] = ()
    aggregators: tuple[str, ...] = ()

    def __post_init__(self):
        labels = [lab for lab, _, _ in ATTACK_GRID]
        for what, chosen, allowed in (("attacks", self.attacks, labels),
                                      ("aggregators", self.aggregators, AGGREGATOR_GRID)):
            bad = [x for x in chosen if x not in allowed]
            if bad:
                raise ValueError(f"ByzantineStudy.{what}: unknown {bad}; allowed: "
                                 f"{', '.join(allowed)}")

    def attack_grid(self) -> tuple[tuple[str, str, dict], ...]:
        """The attacks of this study (all of ATTACK_GRID unless ``attacks`` picks some)."""
        return tuple(a for a in ATTACK_GRID if not self.attacks or a[0] in self.attacks)

    def aggregator_grid(self) -> tuple[str, ...]:
        """The aggregators of this study (all of AGGREGATOR_GRID unless ``aggregators``)."""
        return tuple(a for a in AGGREGATOR_GRID
                     if not self.aggregators or a in self.aggregators)


#: 30 clients so that Krum on s = 2 buckets keeps k ≥ 2f + 3 at δ = 20% (15 buckets, f = 6);
#: n = 6 < (d_θ + d_w)/2 examples per client: no client identifies θ* alone.
FULL = ByzantineStudy()
QUICK = ByzantineStudy(num_clients=20, fractions=(0.1,), rounds=120, eval_every=5,
                       threshold=1e-1, opt_evals=5)


def _algorithm(kind: str, problem, aggregator, byz: ByzantineConfig) -> ByzantineRobust:
    if kind == "br-ffgg":
        base = FFGG(make_solver("exact"), SGD(lr=1.0 / problem.L))
    else:
        base = joint_sgd(1.0 / float(problem.L_joint_clients.max()))
    return ByzantineRobust(base, aggregator, byz)


def _evaluator(problem):
    star = problem.theta_star()["theta"]
    shared_star = problem.shared_optimum()

    def evaluate(algorithm, state, prob, client_state, ctx) -> dict:
        th = algorithm.global_theta(state, problem)["theta"]
        d = th - star
        rec = {"dist2": float(d @ d), "dropped": state.extra.get("byz_dropped", 0),
               "rejected": state.extra.get("byz_rejected", 0)}
        if "w" in state.theta:  # shared model: also its distance to its own optimum
            x = np.concatenate([th, state.theta["w"]])
            e = x - shared_star
            rec["dist2_shared_opt"] = float(e @ e)
        else:
            rec["dist2_shared_opt"] = float("nan")
        return rec

    return evaluate


def feasible(agg_name: str, num_clients: int, delta: float, s: int) -> bool:
    """False for an exhaustive rule (MDA, SMEA) whose C(k, f) subsets exceed MAX_SUBSETS."""
    if agg_name not in ("mda", "smea"):
        return True
    k = -(-num_clients // s)
    return math.comb(k, k - count(s * delta, k)) <= MAX_SUBSETS


def run_grid(study: ByzantineStudy, out_dir: Path, seed: int, progress: bool):
    """Every cell of the grid for one seed: ``(rows, problem)``, one row per cell."""
    problem = OverpersonalizedLeastSquares(
        num_clients=study.num_clients, n=study.n, d_theta=study.d_theta, d_w=study.d_w,
        seed=seed, heterogeneity=study.heterogeneity)
    evaluate = _evaluator(problem)
    cells = [(delta, a, agg, s, kind) for delta in study.fractions for a in study.attack_grid()
             for agg in study.aggregator_grid() for s in (1, study.bucket_size) for kind in KINDS
             if feasible(agg, study.num_clients, delta, s)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cells), desc=f"byzantine seed {seed}", mininterval=0.5)
    star = problem.theta_star()["theta"]
    rows = []
    for delta, (label, att_name, att_kw), agg_name, s, kind in cells:
        if att_name.endswith("-opt"):
            att_kw = {**att_kw, "evals": study.opt_evals}
        byz = ByzantineConfig.sample(problem.num_clients, delta, seed,
                                     make_attack(att_name, **att_kw))
        agg = make_aggregator(agg_name, delta=delta, bucketing=s, seed=seed)
        alg = _algorithm(kind, problem, agg, byz)
        path = out_dir / f"byzantine_delta{delta:g}_seed{seed}.jsonl"
        t0 = time.perf_counter()
        with JsonlLogger(path, append=True, delta=delta, attack=label, aggregator=agg_name,
                         bucketing=s, method=kind, seed=seed) as log, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # GM max_iter notes, overflow
            res = run_rounds(problem, alg, study.rounds, seed=seed, evaluate=evaluate,
                             eval_every=study.eval_every, logger=log)
        rows.append({"delta": delta, "attack": label, "aggregator": agg_name, "bucketing": s,
                     "kind": kind, "seed": seed, "history": res.history,
                     "byzantine": byz.clients, "seconds": time.perf_counter() - t0,
                     "theta_star2": float(star @ star)})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows, problem


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    if v != v:
        return "nan"
    if math.isinf(v):
        return "inf"
    return f"{v:.1e}"


def _final(rows, rel: bool = False, **key) -> float | None:
    """Median over seeds of the final ‖θ − θ*‖² (``rel``: divided by ‖θ*‖²) of one cell;
    None for a cell that was not run."""
    vals = [r["history"][-1]["dist2"] / (r["theta_star2"] if rel else 1.0) for r in rows
            if all(r[k] == v for k, v in key.items())]
    return float(np.median(vals)) if vals else None


def _rel_finals(rows, seeds, labels, **key) -> np.ndarray | None:
    """Final ‖θ − θ*‖² / ‖θ*‖² ``[seeds, attacks]`` of one (δ, method, aggregator,
    bucketing); None unless every attack (``labels``) ran for every seed."""
    out = {(r["seed"], r["attack"]): r["history"][-1]["dist2"] / r["theta_star2"]
           for r in rows if all(r[k] == v for k, v in key.items())}
    if any((s, lab) not in out for s in seeds for lab in labels):
        return None
    return np.array([[out[s, lab] for lab in labels] for s in seeds])


def comparison(rows, study: ByzantineStudy, quick: bool) -> list[str]:
    """Paired comparisons over seeds (the problem, the Byzantine ids and the attacks' noise
    come from the seed), each averaged over the attacks of the grid: BR-FFGG against the
    robust shared model with the same aggregator and bucketing, and BR-FFGG with bucketing
    against BR-FFGG without (:func:`~partialfl.pipeline.report.error_ratio_section`)."""
    seeds = sorted({r["seed"] for r in rows})
    labels = [lab for lab, _, _ in study.attack_grid()]
    lines = ["## Paired comparisons over seeds (log10 final error, averaged over the "
             f"{len(labels)} attacks)", ""]
    b = study.bucket_size
    for i, delta in enumerate(study.fractions):
        personal, bucket = {}, {}
        for agg in study.aggregator_grid():
            for s in (1, b):
                ffgg, shared = (_rel_finals(rows, seeds, labels, delta=delta, kind=k,
                                            aggregator=agg, bucketing=s)
                                for k in ("br-ffgg", "shared"))
                if ffgg is not None and shared is not None:
                    personal[f"{agg}{'+b' if s > 1 else ''}"] = (ffgg, shared)
            with_b, without = (_rel_finals(rows, seeds, labels, delta=delta, kind="br-ffgg",
                                           aggregator=agg, bucketing=s) for s in (b, 1))
            if with_b is not None and without is not None:
                bucket[agg] = (with_b, without)
        lines += [f"### δ = {delta:.0%}: BR-FFGG vs the robust shared model (same aggregator "
                  "and bucketing)", "",
                  *error_ratio_section(personal, reference="the shared model",
                                       error="final ‖θ − θ*‖²/‖θ*‖²", verdict=not quick,
                                       explain=False), "",
                  f"### δ = {delta:.0%}: BR-FFGG with bucketing (s = {b}) vs without", "",
                  *error_ratio_section(bucket, reference="no bucketing",
                                       error="final ‖θ − θ*‖²/‖θ*‖²", verdict=not quick,
                                       explain=i == len(study.fractions) - 1,
                                       cells="attacks"), ""]
    return lines


def _plot(rows, study: ByzantineStudy, path: Path, delta: float, kind: str, seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = study.attack_grid()
    n = len(attacks)
    ncol = 4
    nrow = (n + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.0 * ncol, 3.0 * nrow + 0.8),
                             squeeze=False, sharex=True)
    colors = dict(zip(AGGREGATOR_GRID, plt.get_cmap("tab10").colors))
    for ax, (label, _, _) in zip(axes.flat, attacks):
        top = None
        for r in rows:
            if (r["delta"], r["kind"], r["attack"], r["seed"]) != (delta, kind, label, seed):
                continue
            top = 1e3 * r["history"][0]["dist2"]
            xs = [h["round"] for h in r["history"]]
            ys = [min(max(h["dist2"], 1e-32), top) if h["dist2"] == h["dist2"] else top
                  for h in r["history"]]
            # earlier aggregators drawn wider, so rules that coincide stay visible
            width = 1.0 + 0.6 * (len(AGGREGATOR_GRID) - 1 - AGGREGATOR_GRID.index(
                r["aggregator"]))
            ax.plot(xs, ys, color=colors[r["aggregator"]],
                    ls="-" if r["bucketing"] == 1 else "--", lw=width, alpha=0.85,
                    label=r["aggregator"] + (f" + bucketing s={r['bucketing']}"
                                             if r["bucketing"] > 1 else ""))
        ax.set_yscale("log")
        if top is not None:
            ax.set_ylim(top=top * 3)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[-1]:
        ax.set_xlabel("rounds")
    for ax in axes[:, 0]:
        ax.set_ylabel("‖θ − θ*‖²")
    for ax in axes.flat[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.suptitle(f"{KINDS[kind]}, {delta:.0%} Byzantine clients, seed {seed} (diverging "
                 "runs are drawn at 10³·‖θ⁰ − θ*‖², the top edge)", fontsize=11)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    pio.savefig(fig, path, dpi=110)
    plt.close(fig)


def _summary(rows, study, problem_stats, quick, seconds) -> str:
    lines = ["# byzantine: Byzantine-robust FFGG on overpersonalized least squares"
             + (" (quick)" if quick else ""), ""]
    lines += [
        f"Problem: {study.num_clients} clients, n = {study.n}, d_θ = {study.d_theta}, "
        f"d_w = {study.d_w}, planted w♮_m spread h = {study.heterogeneity}; "
        f"{study.rounds} rounds, full participation; bucketing s = {study.bucket_size}. "
        "Entries: final ‖θ − θ*‖² (median over seeds "
        f"{sorted({r['seed'] for r in rows})}); start ‖θ⁰ − θ*‖² = ‖θ*‖² = "
        f"{problem_stats['theta_star2']:.3g} (seed {problem_stats['seed']}). "
        "'+b' = with bucketing; 'inf': ‖θ − θ*‖² overflows (θ itself stays finite: "
        "non-finite updates are dropped, steps that would make θ non-finite rejected); "
        f"'–': not run (MDA and SMEA are exhaustive: more than {MAX_SUBSETS:,} subsets). "
        "ALIE-opt / IPM-opt tune their scale against the aggregator of the cell every round "
        f"({study.opt_evals} line-search evaluations).",
        f"The best any shared model can do: its optimum x̄* has ‖θ̄* − θ*‖² = "
        f"{problem_stats['shared_floor']:.3g} (seed {problem_stats['seed']}; the "
        "non-personalized floor).",
        "",
    ]
    if study.attacks or study.aggregators:
        lines += [f"**Part of the grid**: attacks {', '.join(a[0] for a in study.attack_grid())}"
                  f"; aggregators {', '.join(study.aggregator_grid())} (the full grid has "
                  f"{len(ATTACK_GRID)} attacks × {len(AGGREGATOR_GRID)} aggregators).", ""]
    if quick:
        lines += [quick_note(f"{study.num_clients} clients, {study.rounds} rounds, δ ∈ "
                             f"{{{', '.join(f'{d:.0%}' for d in study.fractions)}}}"), ""]
    aggs, attacks = study.aggregator_grid(), study.attack_grid()
    header = ["attack"] + [f"{a}{'+b' if s > 1 else ''}" for a in aggs
                           for s in (1, study.bucket_size)]
    for delta in study.fractions:
        for kind, title in KINDS.items():
            table = []
            for label, _, _ in attacks:
                table.append([label] + [_fmt(_final(rows, delta=delta, kind=kind, attack=label,
                                                    aggregator=a, bucketing=s))
                                        for a in aggs
                                        for s in (1, study.bucket_size)])
            byz = sorted({r["byzantine"] for r in rows if r["delta"] == delta})
            lines += [f"## {title}, δ = {delta:.0%} Byzantine (ids {byz[0]})", "",
                      markdown_table(header, table), ""]
    # Observations computed from the table (no hand-written numbers).
    lines += ["## Observations (computed from the table)", ""]
    thr = study.threshold
    for delta in study.fractions:
        for kind, title in KINDS.items():
            for s in (1, study.bucket_size):
                cells = [(a, lab) for a in aggs if a != "mean"
                         and feasible(a, study.num_clients, delta, s)
                         for lab, _, _ in attacks]
                ok = [c for c in cells
                      if _final(rows, rel=True, delta=delta, kind=kind, attack=c[1],
                                aggregator=c[0], bucketing=s) <= thr]
                bad = [f"{a}/{lab}" for a, lab in cells if (a, lab) not in ok]
                lines.append(
                    f"- δ = {delta:.0%}, {title}, robust aggregators "
                    f"{'with' if s > 1 else 'without'} bucketing: {len(ok)}/{len(cells)} cells "
                    f"reach ‖θ − θ*‖² ≤ {thr:g}·‖θ*‖²"
                    + (f"; not: {', '.join(bad)}" if 0 < len(bad) <= 12 else ""))
            if "mean" not in aggs:
                continue
            mean_bad = [lab for lab, _, _ in attacks
                        if not _final(rows, rel=True, delta=delta, kind=kind, attack=lab,
                                      aggregator="mean", bucketing=1) <= thr]
            lines.append(f"- δ = {delta:.0%}, {title}, mean: fails to reach {thr:g}·‖θ*‖² "
                         f"under {', '.join(mean_bad) if mean_bad else 'no attack'}")
    lines += ["", *comparison(rows, study, quick)]
    lines += ["", f"Total time: {seconds:.0f} s. Plots: `byzantine_<method>_delta<δ>.png` "
              "(first seed; solid: no bucketing, dashed: bucketing)."]
    return "\n".join(lines) + "\n"


@register("reproduction", "byzantine",
          doc="Byzantine-robust FFGG: attacks x aggregators (+bucketing) on least squares")
def reproduce_byzantine(out_dir: Path, *, quick: bool = False, seeds: list[int] | None = None,
                        data_dir: Path | None = None, progress: bool = True,
                        study: ByzantineStudy | None = None) -> Path:
    """Run the grid, write JSONL, plots and ``summary.md``; returns the summary path.
    ``study`` replaces the full / quick size (e.g. a part of the grid)."""
    if study is None:
        study = QUICK if quick else FULL
    seeds = list(seeds) if seeds else [0]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("byzantine_delta*_seed*.jsonl"):
        f.unlink()  # loggers append per cell: start clean
    t0 = time.perf_counter()
    rows, stats = [], {}
    for seed in seeds:
        r, problem = run_grid(study, out_dir, seed, progress)
        rows += r
        if not stats:
            star = problem.theta_star()["theta"]
            e = problem.shared_optimum()[: problem.d_theta] - star
            stats = {"theta_star2": float(star @ star), "shared_floor": float(e @ e),
                     "seed": seed}
    for delta in study.fractions:
        for kind in KINDS:
            _plot(rows, study, out_dir / f"byzantine_{kind}_delta{delta:g}.png", delta, kind,
                  seeds[0])
    path = out_dir / "summary.md"
    pio.write_text(path, _summary(rows, study, stats, quick, time.perf_counter() - t0))
    return path
