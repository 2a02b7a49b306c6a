"""The summary and the plot of ``partialfl reproduce dp`` (:mod:`partialfl.reproductions.dp`),
written from its ``dp.json`` record alone.

Per data set, with every interval a 95% paired bootstrap over clients × seeds
(:func:`partialfl.stats.contrast_interval`, the same draws for every term):

* A(row, ε): every row's pooled test accuracy;
* gap(part, ε) = A(FFGG (part), ε) − A(FedAvg + FT (part), ε), joint training minus
  fine-tuning the same part, and gap(part, ε) − gap(part, ∞): does joint training help more
  under noise than without?
* drop(row, ε) = A(row, ε) − A(row, ∞), and drop(row, ε) − drop(FedAvg, ε): does a personal,
  noise-free part change the accuracy lost to privacy?
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from partialfl import io as pio
from partialfl.pipeline.report import markdown_table, quick_note


def _counts(panel: dict, eps: str, label: str):
    c = panel["by_eps"][eps]["counts"].get(label)
    return None if c is None else (np.asarray(c[0], float), np.asarray(c[1], float))


def contrast(panel: dict, terms) -> object | None:
    """The interval of Σ a · A(label, ε) over ``terms`` = [(a, label, eps)], or None when a
    term has no counts."""
    from partialfl.stats import contrast_interval

    got = [(a, _counts(panel, eps, label)) for a, label, eps in terms]
    if any(c is None for _, c in got):
        return None
    return contrast_interval([(a, c[0], c[1]) for a, c in got])


def _pts(iv, signed: bool = True) -> str:
    if iv is None:
        return "–"
    f = "+.2f" if signed else ".2f"
    return (f"{100 * iv.estimate:{f}} [{100 * iv.low:{f}}, {100 * iv.high:{f}}]")


def _verdict(iv, quick: bool, better: str, worse: str) -> str:
    if quick or iv is None:
        return "–"
    return better if iv.low > 0 else worse if iv.high < 0 else "no detectable difference"


def _labels(panel: dict) -> list[str]:
    """The rows, in the study's order (those with counts or a failure at any ε)."""
    out: dict[str, None] = {}
    for v in panel["by_eps"].values():
        out.update(dict.fromkeys([*v["counts"], *v.get("failed", {})]))
    return list(out)


def _failed(panel: dict, eps: str, label: str) -> list[str]:
    """The errors of ``label``'s runs that failed at ``eps`` (none: [])."""
    return panel["by_eps"][eps].get("failed", {}).get(label, [])


def _epsilons(record: dict, panel: dict | None = None) -> list[str]:
    """The study's ε names in order (those ``panel`` has, if given: a stopped study)."""
    return [e for e in record["epsilons"] if panel is None or e in panel["by_eps"]]


def _sym(eps: str) -> str:
    return "∞" if eps == "inf" else eps


def privacy_rows(panel: dict, epsilons: list[str] | None = None) -> list[list[str]]:
    """Per ε (in the order ``epsilons``; default: as run): the noise multiplier z, δ, the
    clip norms and the ε the runs report spent after stage 2 (the same for every row and
    seed: one mechanism)."""
    rows = []
    for eps in epsilons or list(panel["by_eps"]):
        v = panel["by_eps"][eps]
        pr = v["privacy"]
        if not pr:  # ε = 0: stage 2 ran no round (or every row failed)
            rows.append([_sym(eps), "–", "0 (nothing released)", "–", "–", "0"]
                        if eps == "0" else [_sym(eps), "–", "– (every row failed)", "–", "–",
                                            "–"])
            continue
        zs = {round(z, 6) for p in pr.values() for z in p["dp_noise_multiplier"]}
        spent = [e for p in pr.values() for e in p["dp_epsilon"]]
        clips = sorted({c for p in pr.values() for c in p["dp_clip_norm"]})
        delta = next(iter(pr.values()))["dp_delta"][0]
        rounds = next(iter(pr.values()))["round"][0]
        rows.append([_sym(eps), ", ".join(f"{z:.4g}" for z in sorted(zs)),
                     "∞" if math.isinf(max(spent)) else f"{max(spent):.4f}",
                     f"{delta:.3g}", ", ".join(f"{c:g}" for c in clips), str(rounds)])
    return rows


def panel_lines(panel: dict, epsilons: list[str], quick: bool) -> list[str]:
    """The markdown of one data set (see the module docstring)."""
    from partialfl.stats import accuracy_interval

    labels = _labels(panel)
    lines = [markdown_table(["ε", "noise multiplier z", "ε spent (accountant, after stage 2)",
                             "δ", "clip norms C (FedAvg rows, FFGG rows)", "stage-2 rounds"],
                            privacy_rows(panel, epsilons)), ""]
    acc, failures = [], []
    for label in labels:
        cells = []
        for eps in epsilons:
            c = _counts(panel, eps, label)
            if c is None and _failed(panel, eps, label):
                failures += [f"- {label} at ε = {_sym(eps)}: {why}"
                             for why in _failed(panel, eps, label)]
                cells.append(f"failed ({len(failures)})")
                continue
            cells.append(_pts(None if c is None else accuracy_interval(*c), signed=False))
        acc.append([label, *cells])
    lines += ["Test accuracy %, [95% CI] over clients × seeds:", "",
              markdown_table(["method", *(f"ε = {_sym(e)}" for e in epsilons)], acc), ""]
    if failures:
        lines += ["Failed rows (stage 2 stopped: too many client computations lost; no "
                  "accuracy, and no contrast involving them):", "",
                  *(f"{i}. {f[2:]}" for i, f in enumerate(failures, 1)), ""]
    noisy = [e for e in epsilons if e not in ("0", "inf")]  # "0": no private training
    if "inf" not in epsilons:
        noisy = []
        lines += ["(ε = ∞ has not finished: no contrast against it.)", ""]
    gap_rows, dd_rows, drop_rows = [], [], []
    for label, base in panel["matched"].items():
        gap_rows.append([label, *(_pts(contrast(panel, [(1, label, e), (-1, base, e)]))
                                  for e in epsilons)])
        for e in noisy:
            iv = contrast(panel, [(1, label, e), (-1, base, e), (-1, label, "inf"),
                                  (1, base, "inf")])
            dd_rows.append([label, _sym(e), _pts(iv),
                            _verdict(iv, quick, "joint training helps more under noise",
                                     "joint training helps less under noise")])
    lines += ["Joint training vs fine-tuning the same part, gap = FFGG (part) − FedAvg + FT "
              "(part), points [95% CI]:", "",
              markdown_table(["row", *(f"ε = {_sym(e)}" for e in epsilons)], gap_rows), ""]
    if noisy:
        lines += ["Does joint training help more under noise than without? gap(ε) − gap(∞), "
                  "points [95% CI]:", "",
                  markdown_table(["row", "ε", "gap(ε) − gap(∞)", "verdict"], dd_rows), ""]
    for label in labels:
        if label == "FedAvg":
            continue
        for e in noisy:
            mine = contrast(panel, [(1, label, e), (-1, label, "inf")])
            iv = contrast(panel, [(1, label, e), (-1, label, "inf"), (-1, "FedAvg", e),
                                  (1, "FedAvg", "inf")])
            drop_rows.append([label, _sym(e), _pts(mine), _pts(iv),
                              _verdict(iv, quick, "loses less than FedAvg",
                                       "loses more than FedAvg")])
    fed = [[_sym(e), _pts(contrast(panel, [(1, "FedAvg", e), (-1, "FedAvg", "inf")]))]
           for e in noisy]
    if noisy:
        lines += ["Does a personal, noise-free part change the accuracy–privacy trade-off? "
                  "FedAvg's own drop A(ε) − A(∞): "
                  + "; ".join(f"ε = {e}: {d}" for e, d in fed) + " points. Every other row:",
                  "", markdown_table(["row", "ε", "drop A(ε) − A(∞), points",
                                      "drop − FedAvg's drop, points [95% CI]", "verdict"],
                                     drop_rows), ""]
    if "0" in epsilons:
        add = [[label, *(_pts(contrast(panel, [(1, label, e), (-1, label, "0")]))
                         for e in epsilons if e != "0")] for label in labels]
        lines += ["What private training adds at all: A(ε) − A(0), where ε = 0 is the public θ "
                  "with the part fine-tuned and no private round, points [95% CI]:", "",
                  markdown_table(["row", *(f"ε = {_sym(e)}" for e in epsilons if e != "0")],
                                 add), ""]
    return lines


def epsilon_plot(path: Path, record: dict) -> Path:
    """One panel per data set: every row's accuracy against ε (categorical axis 1, 3, 8,
    ∞) with its 95% interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partialfl.stats import accuracy_interval

    panels = record["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, p in zip(axes[0], panels.values()):
        labels, epsilons = _labels(p), _epsilons(record, p)
        for i, label in enumerate(labels):
            # a failed row at some ε has no point there (the summary lists why)
            ivs = [None if (c := _counts(p, e, label)) is None else accuracy_interval(*c)
                   for e in epsilons]
            x = np.arange(len(epsilons)) + (i - (len(labels) - 1) / 2) * 0.06
            y = np.array([np.nan if iv is None else 100 * iv.estimate for iv in ivs])
            err = np.array([[0.0 if iv is None else 100 * (iv.estimate - iv.low) for iv in ivs],
                            [0.0 if iv is None else 100 * (iv.high - iv.estimate)
                             for iv in ivs]])
            # ε = 0 (no private training) is a reference point, not joined to the curve
            ref = np.array([e == "0" for e in epsilons])
            style = {"marker": "os^vDP*X"[i % 8], "ms": 4, "capsize": 2, "color": f"C{i}"}
            gone = [_sym(e) for e, iv in zip(epsilons, ivs) if iv is None]
            name = label + (f" (failed at ε = {', '.join(gone)})" if gone else "")
            ax.errorbar(x[~ref], y[~ref], yerr=err[:, ~ref], lw=1, label=name, **style,
                        ls="--" if label.startswith("FedAvg + FT") else "-")
            if ref.any():
                ax.errorbar(x[ref], y[ref], yerr=err[:, ref], ls="none", **style)
        ax.set_xticks(np.arange(len(epsilons)), [_sym(e) for e in epsilons])
        ax.set_xlabel("ε (client-level, stage 2; 0: no private training)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(p["title"], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("accuracy against ε, 95% intervals over clients × seeds", fontsize=9)
    fig.tight_layout()
    pio.savefig(fig, path, dpi=120)
    plt.close(fig)
    return Path(path)


def summary(record: dict, design: list[str]) -> str:
    """``summary.md`` of the study (see the module docstring)."""
    quick = record["quick"]
    lines = [f"# dp: partial personalization under client-level differential privacy of θ"
             f"{' (quick)' if quick else ''}", ""]
    if quick:
        lines += [quick_note("ε ∈ {0, 1, ∞}, one seed, a few clients and rounds"), ""]
    lines += ["Accuracy against the privacy budget ε of θ's updates in stage 2 "
              "(client-level, add or remove one private client), for FedAvg, FFGG with a "
              "personal input / output / adapter part, and FedAvg + FT (same part), which "
              "fine-tunes that part after FedAvg. Plot: `accuracy_vs_epsilon.png`; every "
              "number below is in `dp.json`.", ""]
    for key, p in record["panels"].items():
        s = p["size"]
        lines += [f"## {p['title']}", "",
                  f"{len(p['public'])} public {('subjects' if key == 'har' else 'writers')} "
                  f"(stage 1, {s['pretrain_rounds']} rounds, no noise), "
                  f"{len(p['private'])} private ones (stage 2, {s['rounds']} rounds, "
                  f"{s['clients_per_round']} expected per round, Poisson; stage 3, "
                  f"{s['finetune_epochs']} epochs of local fine-tuning); seeds {p['seeds']}. "
                  f"Clip norms: C_Δ = {p['clip']:g} for FedAvg's model change, "
                  f"C_∇ = C_Δ / {p['ffgg_server_lr']:g} for FFGG's gradient.", "",
                  *panel_lines(p, _epsilons(record, p), quick)]
    time = ("Measured time: not recorded (this summary was rebuilt from the finished "
            "tables, `partialfl.reproductions.dp.collect`)." if record["total_seconds"] is None
            else "Measured time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in
                                               record["seconds"].items())
            + f"; total {record['total_seconds'] / 60:.1f} min (wall-clock of this "
            "invocation; a resumed study reloads its finished runs).")
    lines += ["## Design", "", *design, "", time, ""]
    return "\n".join(lines)


__all__ = ["contrast", "epsilon_plot", "panel_lines", "privacy_rows", "summary"]
