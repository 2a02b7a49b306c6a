"""Plots (PNG, matplotlib's Agg backend) and markdown tables made from metric histories."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partialfl import io as pio


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table with ``header`` and one line per row."""
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def percent_mean_std(xs) -> str:
    """``"mean ± std"`` of fractions in percent (NaNs ignored; one value: no ± part)."""
    import numpy as np

    xs = np.asarray([x for x in xs if x == x], dtype=float)
    if xs.size == 0:
        return "–"
    if xs.size == 1:
        return f"{100 * xs.mean():.2f}"
    return f"{100 * xs.mean():.2f} ± {100 * xs.std():.2f}"


def accuracy_cells(runs: Sequence[dict]) -> list[str]:
    """The table cells shared by the neural-network reproductions for one method's runs (one
    metrics dict per seed): final test accuracy, test accuracy before stage 3, the per-client
    p10 / p50 / p90 test accuracy (means over seeds) and train accuracy, in percent."""
    def col(key: str) -> str:
        return percent_mean_std([m.get(key, float("nan")) for m in runs])

    return [col("test_acc"), col("test_acc_before_ft"),
            " / ".join(col(f"test_acc_p{q}").split(" ±")[0] for q in (10, 50, 90)),
            col("train_acc")]


def versus_baselines(results: dict[str, Sequence[dict]], matched: dict[str, str],
                     claim_margin: float | None = None, verdict: bool = True,
                     counts: dict[str, tuple] | None = None) -> list[str]:
    """Markdown bullets: plain FedAvg, then every row with a matched baseline (``matched``:
    row label → its "FedAvg + FT (same part)" label) against FedAvg and against that
    baseline — joint training vs fine-tuning the same part — (means over seeds), and the
    paper's claims, each vs FedAvg and vs the split's matched baseline: every FFGG split
    above, and (with ``claim_margin``) the best one by at least that much. With ``counts``
    (label → per-client ``(correct, total[, ids])``, see :func:`paired_section`) a claim
    "holds" only when the paired 95% interval of every difference lies above the threshold,
    "does NOT hold" when one lies below it, else it is "not shown at this size"; without,
    the point estimates decide. ``verdict=False`` (a run too small to tell) gives the numbers
    but no verdict on the claims."""
    import numpy as np

    from partialfl.stats import paired_difference

    def mean(label: str) -> float:
        return float(np.mean([m["test_acc"] for m in results[label]]))

    fedavg = mean("FedAvg")
    rows = {lab: mean(lab) for lab in matched if results.get(lab)}
    ffgg = {lab: v for lab, v in rows.items() if lab.startswith("FFGG")}
    lines = [f"- FedAvg (no fine-tuning): {100 * fedavg:.2f}%."]
    lines += [f"- {lab}: {100 * v:.2f}% ({100 * (v - fedavg):+.2f} points vs FedAvg; "
              f"{100 * (v - mean(matched[lab])):+.2f} vs {matched[lab]}, "
              f"{100 * mean(matched[lab]):.2f}%: joint training vs fine-tuning the same part)"
              for lab, v in rows.items()]
    if not ffgg:
        return lines
    best = max(ffgg, key=ffgg.get)
    lines.append(f"- Ranking of the FFGG splits: "
                 f"{' > '.join(sorted(ffgg, key=ffgg.get, reverse=True))}; best {best}, "
                 f"{100 * (ffgg[best] - fedavg):+.2f} points over FedAvg, "
                 f"{100 * (ffgg[best] - mean(matched[best])):+.2f} over {matched[best]}.")
    if not verdict:
        claims = "every FFGG split above FedAvg" + (
            f", the best by ≥ {100 * claim_margin:g} point(s)" if claim_margin is not None else "")
        return lines + [f"- Paper's claims ({claims}): not judged; this run is too small to "
                        "support a verdict."]

    def diff(label: str, base: str) -> tuple[float, float, float]:
        """(estimate, low, high) of label − base: the paired interval, or the means."""
        if counts and counts.get(label) is not None and counts.get(base) is not None:
            d = paired_difference(counts[label][0], counts[label][1], counts[base][0],
                                  counts[base][1])
            return d.estimate, d.low, d.high
        e = mean(label) - mean(base)
        return e, e, e

    def claim(labels, base_of, threshold: float) -> str:
        ds = {lab: diff(lab, base_of(lab)) for lab in labels}
        if any(h < threshold for _, _, h in ds.values()):
            return "does NOT hold"
        if all(lo >= threshold if threshold else lo > 0 for _, lo, _ in ds.values()):
            return "holds"
        open_ = [lab for lab, (_, lo, _) in ds.items() if lo < threshold or lo <= 0]
        return (f"not shown at this size (the interval of {', '.join(open_)} reaches "
                f"{100 * threshold:g})")

    how = ("paired 95% intervals" if counts else "point estimates")
    lines.append(f"- Paper's claim, every FFGG split above FedAvg: "
                 f"{claim(ffgg, lambda _: 'FedAvg', 0.0)}; above its matched baseline (the "
                 f"same part fine-tuned after FedAvg): {claim(ffgg, matched.get, 0.0)} ({how}).")
    if claim_margin is not None:
        lines.append(f"- Paper's claim, the best split ({best}) beats FedAvg by ≥ "
                     f"{100 * claim_margin:g} point(s): "
                     f"{claim([best], lambda _: 'FedAvg', claim_margin)}; its matched "
                     f"baseline by ≥ {100 * claim_margin:g}: "
                     f"{claim([best], matched.get, claim_margin)} ({how}).")
    return lines


def _small(points: float) -> str:
    """A small positive number of points: 3 decimals, or 2 significant digits below 0.001."""
    return f"{points:.3f}" if points >= 0.001 else f"{points:.1e}"


def quick_note(size: str) -> str:
    """The line every quick run's summary carries: what its reduced ``size`` is and that it
    cannot support a verdict on the paper's claims."""
    return (f"**Quick run** ({size}): a reduced size that checks that everything runs end to "
            "end; it is too small to support a verdict on the paper's claims (run without "
            "`--quick` for the full size).")


def plain_markdown(text: str) -> str:
    """``text`` with Sphinx cross-reference roles (``:mod:`x```, ``:data:`~a.b```) turned
    into plain markdown code (```x```, ```b```), so docstring prose reads well in a
    summary."""
    import re

    def code(m: re.Match) -> str:
        target = m.group(1)
        if target.startswith("~"):
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return re.sub(r":(?:mod|data|func|class|meth|attr|obj|exc):`([^`]+)`", code, text)


def docstring_bullets(doc: str, heading: str) -> list[str]:
    """The ``* `` bullets after ``heading`` in a module docstring (``""``: all of ``doc``), as
    markdown ``- `` items (so a reproduction's documented deviations are written into its
    summary verbatim)."""
    items: list[str] = []
    cur: list[str] = []
    started = False
    for line in (doc.split(heading, 1)[1] if heading else doc).strip().splitlines():
        if line.startswith("* "):
            if cur:
                items.append(" ".join(cur))
            cur, started = [line[2:].strip()], True
        elif line.strip() and started:
            cur.append(line.strip())
    if cur:
        items.append(" ".join(cur))
    return [f"- {plain_markdown(i).replace('``', '`')}" for i in items]


#: the relative squared distance to θ* (``rel_dist2``), as plots and tables label it
REL_DIST2 = "‖θʳ − θ*‖² / ‖θ⁰ − θ*‖²"

#: (line style, marker) of the i-th curve of a panel: curves that coincide stay visible
STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P"),
          ("-.", "X"), (":", "*"))


def plot_curves(path: Path, panels: list[dict[str, list[dict]]], titles: Sequence[str], *,
                x: str, y: str, ylabel: str, xlabel: str | None = None,
                logy: bool = True, y_per_panel: Sequence[str] | None = None) -> Path:
    """One panel per dict ``label -> history`` (list of metric records), shared y label
    (``y_per_panel`` plots another metric in each panel). Every curve of a panel has its own
    line style and hollow markers of decreasing size, placed at staggered points so that
    curves lying on top of each other remain distinguishable; round axes integer ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    ys_keys = list(y_per_panel) if y_per_panel is not None else [y] * len(panels)
    for ax, curves, title, yk in zip(axes[0], panels, titles, ys_keys):
        n = max(1, len(curves))
        def _clip(v):  # within ±1e100, a log axis 200 decades: a diverged run overflowed
            return min(max(v, -1e100), 1e100) if v - v == 0 else float("nan")
        ys_all = [_clip(h[yk]) for hist in curves.values() for h in hist if yk in h]
        big = any(abs(h[yk]) > 1e100 for hist in curves.values() for h in hist if yk in h)
        floor = max(1e-300, max((abs(v) for v in ys_all if v == v), default=1.0) * 1e-200)
        for i, (label, hist) in enumerate(curves.items()):
            xs = [h[x] for h in hist if yk in h]
            ys = [_clip(h[yk]) for h in hist if yk in h]
            if logy:
                ys = [max(v, floor) if v == v else float("nan") for v in ys]
            ls, marker = STYLES[i % len(STYLES)]
            every = max(1, len(xs) // 8)
            # hollow markers, the first curve's largest: equal points show as nested rings
            ax.plot(xs, ys, label=label, lw=1.4, ls=ls, marker=marker, mfc="none",
                    ms=4 + 6 * (n - 1 - i) / max(1, n - 1), mew=1.2,
                    markevery=(min(i * every // n, len(xs) - 1) if xs else 0, every),
                    alpha=0.9)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title + ("\n(values > 1e100 drawn at 1e100)" if big else ""))
        ax.set_xlabel(xlabel or ("communication rounds" if x == "round" else x))
        if x in ("round", "step", "grad_evals"):
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-4, 4))
            lo, hi = ax.get_xlim()
            if hi - lo < 2:  # one evaluated round (a stage of 0 rounds): integer ticks too
                ax.set_xlim((lo + hi) / 2 - 0.5, (lo + hi) / 2 + 1)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(ylabel)
    legend_beside(axes[0][-1])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pio.savefig(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


#: a panel with more curves than this gets its legend beside the axes, not over the curves
LEGEND_INSIDE_MAX = 4


def legend_beside(ax, fontsize: int = 8) -> None:
    """The panel's legend where it hides no curve: inside at matplotlib's least covered
    place for a few curves, else to the right of the axes (save with
    ``bbox_inches="tight"`` so it stays in the image)."""
    n = len(ax.get_legend_handles_labels()[0])
    if n <= LEGEND_INSIDE_MAX:
        ax.legend(fontsize=fontsize, loc="best")
    else:
        ax.legend(fontsize=fontsize - 1, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0, frameon=False)


def jsonable(v):
    """``v`` with numpy arrays / scalars (also nested in dicts, lists, tuples) made JSON-able."""
    import numpy as np

    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.floating | np.integer):
        return v.item()
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    return v


def pipeline_plots(out_dir: Path, methods: Sequence[tuple[str, Any]], seeds: Sequence[int],
                   results: dict[str, Sequence[dict]], *, ylabel: str, clients: str) -> None:
    """The two plots of a three-stage-pipeline table in ``out_dir``:

    * ``learning_curves.png``: stage-1 test accuracy (``stage1/stage1.jsonl``) and, per method
      (``(label, MethodConfig)``), the stage-2 deployed test accuracy averaged over ``seeds``
      at the rounds every seed evaluated (``seed{s}/{method.name}/stage2.jsonl``);
    * ``per_client_accuracy.png``: the CDF of the final per-client test accuracy over all
      seeds (``per_client_test_acc`` of each run in ``results``).

    A row whose stage 2 is another row's (no ``stage2.jsonl`` of its own) has no curve."""
    import matplotlib
    import numpy as np

    from partialfl.runtime import read_jsonl

    def percent(hist: list[dict]) -> list[dict]:
        return [{"round": r["round"], "test_acc": 100 * r["test_acc"]} for r in hist
                if "test_acc" in r]

    s1 = out_dir / "stage1" / "stage1.jsonl"
    stage1 = {"FedAvg pre-training": percent(read_jsonl(s1))} if s1.exists() else {}
    stage2 = {}
    for label, method in methods:
        curves = [{r["round"]: r["test_acc"] for r in percent(read_jsonl(f))}
                  for f in (out_dir / f"seed{s}" / method.name / "stage2.jsonl" for s in seeds)
                  if f.exists()]
        if curves:
            rounds = sorted(set.intersection(*(set(c) for c in curves)))
            stage2[label] = [
                {"round": r, "test_acc": float(np.mean([c[r] for c in curves]))} for r in rounds]
    plot_curves(out_dir / "learning_curves.png", [stage1, stage2],
                ["stage 1: FedAvg pre-training", "stage 2: deployed test accuracy"],
                x="round", y="test_acc", ylabel=ylabel, logy=False)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    n = max(1, len(results) - 1)
    for i, (label, ms) in enumerate(results.items()):
        accs = np.sort(np.concatenate([np.asarray(m["per_client_test_acc"], float)
                                       for m in ms])) if ms else np.zeros(0)
        accs = accs[~np.isnan(accs)]
        if accs.size:
            # the empirical CDF as steps; earlier curves drawn wider so equal ones stay visible
            ax.step(np.r_[100 * accs[0], 100 * accs], np.r_[0, np.arange(1, accs.size + 1)
                                                             / accs.size], where="post",
                    ls=STYLES[i % len(STYLES)][0], lw=1.2 + 2.0 * (n - i) / n, alpha=0.85,
                    label=label)
    ax.set_xlabel("per-client test accuracy (%)")
    ax.set_ylabel(f"fraction of {clients} (CDF, all seeds)")
    ax.grid(alpha=0.3)
    legend_beside(ax, 7)
    fig.tight_layout()
    pio.savefig(fig, out_dir / "per_client_accuracy.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- uncertainty
def counts_from_runs(runs: Sequence[dict], prefix: str = "per_client_test"
                     ) -> tuple[Any, Any, list[str]] | None:
    """``(correct [S, M], total [S, M], client_ids)`` of one method's runs (one metrics dict
    per seed, with ``{prefix}_correct`` / ``{prefix}_total`` per client, as the pipeline's
    ``metrics.json`` stores them), rows in seed order; None when a run lacks the counts (a
    run made before they were recorded). Raises if the runs disagree on the clients."""
    import numpy as np

    if not runs or any(f"{prefix}_correct" not in m for m in runs):
        return None
    runs = sorted(runs, key=lambda m: m.get("seed", 0))
    ids = [list(m.get("client_ids", [])) for m in runs]
    if any(i != ids[0] for i in ids):
        raise ValueError("the runs of one method evaluated different clients")
    return (np.asarray([m[f"{prefix}_correct"] for m in runs], float),
            np.asarray([m[f"{prefix}_total"] for m in runs], float), ids[0])


def paired_section(counts: dict[str, tuple], baseline: str = "FedAvg", *, unit: str,
                   clients: str, seed: int = 0, explain: bool = True,
                   verdict: bool = True) -> list[str]:
    """Markdown lines: every method's pooled accuracy with its bootstrap interval, its paired
    difference from ``baseline`` with interval, the verdict stated from that interval and the
    minimum detectable difference, then what backs the numbers (test ``unit`` s, ``clients``,
    seeds) and how the intervals were computed (:mod:`partialfl.stats`).

    ``counts``: row label -> ``(correct [S, M], total [S, M])`` or ``(…, client_ids)``; every
    row must have the baseline's clients and seeds (paired). Rows without counts (None) are
    listed as such. ``explain=False`` leaves out the paragraph on the method (for a second
    section of one summary); ``verdict=False`` (a quick run) gives the intervals but no
    verdict."""
    from partialfl.stats import DEFAULT_BOOT, accuracy_interval, paired_difference

    if baseline not in counts or counts[baseline] is None:
        return [f"(No per-client counts for {baseline}: no paired intervals.)"]
    bc, bt = counts[baseline][0], counts[baseline][1]
    ids = counts[baseline][2] if len(counts[baseline]) > 2 else None

    def pct(iv) -> str:
        return f"{100 * iv.estimate:.2f} [{100 * iv.low:.2f}, {100 * iv.high:.2f}]"

    rows, missing = [], []
    for label, cnt in counts.items():
        if cnt is None:
            missing.append(label)
            continue
        if ids is not None and len(cnt) > 2 and list(cnt[2]) != list(ids):
            raise ValueError(f"{label!r} was evaluated on other clients than {baseline!r}")
        acc = accuracy_interval(cnt[0], cnt[1], seed=seed)
        if label == baseline:
            rows.append([label, pct(acc), "(baseline)", "", ""])
            continue
        d = paired_difference(cnt[0], cnt[1], bc, bt, seed=seed)
        rows.append([label, pct(acc),
                     f"{100 * d.estimate:+.2f} [{100 * d.low:+.2f}, {100 * d.high:+.2f}]",
                     d.verdict if verdict else "– (quick run)", f"{100 * d.mde:.2f}"])
    ref = accuracy_interval(bc, bt, seed=seed)
    lines = [markdown_table(["method", "accuracy % [95% CI]",
                             f"paired difference vs {baseline}, points [95% CI]",
                             "verdict", "MDE, points"], rows), ""]
    lines.append(
        f"Each number rests on {ref.examples:,} test {unit} of {ref.clients} {clients}"
        f"{'' if ref.seeds == 1 else f' per seed, {ref.seeds} seeds'} (one {unit[:-1]} = "
        f"{_small(100 / ref.examples)} points).")
    if explain:
        lines[-1] += (
            f" Intervals: 95% bootstrap over {clients} ({DEFAULT_BOOT} replicates, bootstrap "
            f"seed {seed}; each replicate draws the {ref.clients} {clients} with replacement"
            + (" and, independently, the seeds, whose pooled accuracies are averaged"
               if ref.seeds > 1 else "")
            + "; expanded percentile interval). A difference is *paired*: every replicate "
            f"draws the same {clients} for both methods. Verdict: \"better\" / \"worse\" when "
            "the interval of the difference excludes 0, otherwise \"no detectable difference "
            "at this size\". MDE (minimum detectable difference) = 2.80 × the bootstrap SE of "
            "the difference: the smallest true difference this sample detects with 80% "
            "probability at 95% confidence.")
    if missing:
        lines += ["", f"No per-client counts for {', '.join(missing)}."]
    return lines


def matched_section(counts: dict[str, tuple], matched: dict[str, str], *, unit: str,
                    clients: str, seed: int = 0, verdict: bool = True,
                    explain: bool = True) -> list[str]:
    """Markdown lines: every row with a matched baseline (``matched``: row → its "FedAvg + FT
    (same part)" label) against *that* row, paired over clients × seeds
    (:func:`partialfl.stats.paired_difference`): both accuracies, the difference with its
    95% interval, the verdict and the MDE; then one line per row, "joint training vs
    fine-tuning the same part". ``counts`` as for :func:`paired_section`; ``verdict=False``
    (a quick run) gives the intervals but no verdict."""
    from partialfl.stats import accuracy_interval, paired_difference

    def pct(iv) -> str:
        return f"{100 * iv.estimate:.2f} [{100 * iv.low:.2f}, {100 * iv.high:.2f}]"

    rows, lines, missing = [], [], []
    for label, base in matched.items():
        a, b = counts.get(label), counts.get(base)
        if a is None or b is None:
            missing.append(label)
            continue
        if len(a) > 2 and len(b) > 2 and list(a[2]) != list(b[2]):
            raise ValueError(f"{label!r} was evaluated on other clients than {base!r}")
        d = paired_difference(a[0], a[1], b[0], b[1], seed=seed)
        diff = f"{100 * d.estimate:+.2f} [{100 * d.low:+.2f}, {100 * d.high:+.2f}]"
        said = d.verdict if verdict else "– (quick run)"
        rows.append([label, base, pct(accuracy_interval(a[0], a[1], seed=seed)),
                     pct(accuracy_interval(b[0], b[1], seed=seed)), diff, said,
                     f"{100 * d.mde:.2f}"])
        lines.append(f"- {label} vs {base} (joint training vs fine-tuning the same part): "
                     f"{diff} points: " + (said if verdict else "no verdict at this size") + ".")
    if not rows:
        return ["(No per-client counts for the matched comparison.)"]
    out = [markdown_table(["method", "matched baseline", "method % [95% CI]",
                           "baseline % [95% CI]", "difference, points [95% CI]", "verdict",
                           "MDE, points"], rows), "", *lines]
    if explain:
        out += ["", f"Both rows of a pair end with the same architecture and the same personal "
                f"parameters per {clients[:-1] if clients.endswith('s') else clients}; only "
                "how θ was trained differs (jointly with the personal part, or by FedAvg "
                "before the part is fine-tuned). Intervals, verdicts and MDE as in the "
                f"paired comparison with FedAvg (bootstrap over {clients} and seeds, the same "
                "draws for both rows of a pair)."]
    if missing:
        out += ["", f"No per-client counts for {', '.join(missing)} or its baseline."]
    return out


def error_ratio_section(pairs: dict[str, tuple[Any, Any]], *, reference: str, error: str,
                        verdict: bool = True, explain: bool = True,
                        cells: str | None = None) -> list[str]:
    """Markdown lines for studies whose randomness is their seed: one row per comparison
    ``label -> (errors, reference_errors)`` (arrays ``[S]``, or ``[S, cells]`` averaged per
    seed, row s of both from seed s) with both geometric-mean final errors, the paired
    difference of log10 errors D = log10 e_ref − log10 e (orders of magnitude below the
    reference) with its t interval over seeds, the verdict stated from it and the MDE
    (:func:`partialfl.stats.log_error_ratio`). One seed: the difference, no interval, no
    verdict. ``verdict=False`` (a quick run): intervals but no verdict. ``reference`` names
    the reference in the header; ``error`` the error measured; ``cells`` what the averaged
    cells are (for the explanation)."""
    import numpy as np

    from partialfl.stats import ERROR_CEILING, ERROR_FLOOR, clipped_log10, log_error_ratio

    def geo(e) -> str:
        return f"{10 ** float(np.mean(clipped_log10(e))):.2e}"

    rows, n_seeds = [], set()
    for label, (e, b) in pairs.items():
        e, b = np.asarray(e, float), np.asarray(b, float)
        s = e.shape[0] if e.ndim else 1
        n_seeds.add(s)
        if s < 2:
            d = float(np.mean(clipped_log10(b) - clipped_log10(e)))
            rows.append([label, f"{geo(e)} / {geo(b)}", f"{d:+.2f} (one seed: no interval)",
                         "– (one seed)", "–"])
            continue
        iv = log_error_ratio(e, b)
        rows.append([label, f"{geo(e)} / {geo(b)}",
                     f"{iv.estimate:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}]",
                     iv.verdict if verdict else "– (quick run)", f"{iv.mde:.2f}"])
    lines = [markdown_table(["comparison", f"{error}, geometric mean (method / reference)",
                             f"orders of magnitude below {reference} [95% CI]",
                             f"verdict vs {reference}", "MDE, orders"], rows), ""]
    if not explain:
        return lines
    s = max(n_seeds) if n_seeds else 0
    text = (f"Paired over seeds: the data{', ' + cells if cells else ''} and every random draw "
            "of a run come from its seed, and both sides of a comparison use the same seeds. "
            "D = log10(reference error) − log10(method error) per seed"
            + (f" (averaged over the {cells} of the seed)" if cells else "")
            + f"; errors clipped to [{ERROR_FLOOR:g}, {ERROR_CEILING:g}] (below: rounding; "
            "non-finite or above: diverged). ")
    if s < 2:
        text += ("**One seed**: these numbers are for one draw of the problem and of the "
                 "run's randomness; no interval and no verdict (run with `--seeds 0 1 2`).")
    else:
        text += (f"Interval: 95% t interval over the {s} seeds (mean ± t_{{S−1}} · SE); "
                 "verdict \"better\" / \"worse\" when it excludes 0, otherwise \"no detectable "
                 "difference at this size\"; MDE = (t_{S−1,0.975} + t_{S−1,0.80}) · SE, the "
                 "smallest true difference (in orders of magnitude) these seeds detect with "
                 "about 80% probability.")
    return lines + [text]
