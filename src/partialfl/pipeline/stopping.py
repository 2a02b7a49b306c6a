"""Stage budgets chosen on validation data: a plateau stopping rule for the federated stages
and a small grid for stage 3's fine-tuning (epochs, lr), both read only the validation split
of :mod:`partialfl.data.validation` (carved from each client's training data).

Plateau rule (:func:`plateaued`): with v_0, …, v_k the values of ``metric`` at the
evaluations so far (round 0 first) and s = +1 (``mode`` max) or −1 (min), stop after
evaluation k when k ≥ ``window`` and

    max_{j > k−window} s·v_j − max_{j ≤ k−window} s·v_j < min_delta,

i.e. the last ``window`` evaluations improved the best value by less than ``min_delta``. The
stage's ``rounds`` is the cap. The rule is a function of the logged history only, so a
resumed run stops at the same round.

Stage-3 grid (:func:`choose_finetune`): every (epochs, lr) of the grid fine-tunes every
client's w from the same start; the setting with the best validation ``metric`` wins (ties:
the first in grid order, i.e. fewer epochs, then smaller lr); epochs 0 = no fine-tuning.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.config import ConfigError
from partialfl.spec import FinetuneGrid, StopConfig, ValidationConfig

#: stage 3's grid of a ``--quick --plateau`` table (CI): two settings
QUICK_GRID = FinetuneGrid(epochs=(0, 1), lr=(0.01,))


def plateau_settings(stage1: bool = False, window: int = 3, min_delta: float = 0.002,
                     grid: FinetuneGrid | None = None, quick: bool = False) -> tuple:
    """The ``Size.plateau`` of a FEMNIST / Shakespeare table under the plateau rule: (stage-1
    rule or None, stage-2 rule, validation split, stage-3 grid); windows count evaluations
    (``quick``: :data:`QUICK_GRID` unless ``grid`` is given)."""
    rule = StopConfig(metric="val_acc", mode="max", min_delta=min_delta, window=window)
    grid = grid or (QUICK_GRID if quick else FinetuneGrid())
    return (rule if stage1 else None, rule, ValidationConfig(0.1, 2), grid)


def stage1_stop(results: dict[str, Sequence[dict]]) -> str:
    """", stopped at round R" for the stage-1 stopping round(s) recorded in a table's run
    metrics (``stage1_rounds``), or "" when none is recorded."""
    r1 = sorted({m.get("stage1_rounds") for ms in results.values() for m in ms} - {None})
    return f", stopped at round {', '.join(map(str, r1))}" if r1 else ""


def plateaued(history: Sequence[dict[str, Any]], stop: StopConfig) -> bool:
    """Whether the plateau rule fires on the evaluation records ``history``."""
    if len(history) <= stop.window:
        return False
    try:
        vals = np.array([float(h[stop.metric]) for h in history])
    except KeyError:
        raise ConfigError(f"stop.metric {stop.metric!r} is not logged; logged: "
                          f"{', '.join(sorted(history[-1]))}") from None
    s = vals if stop.mode == "max" else -vals
    return bool(np.max(s[-stop.window:]) - np.max(s[:-stop.window]) < stop.min_delta)


def choose_finetune(val_problem, theta, w0, grid: FinetuneGrid, client, seed: int
                    ) -> tuple[dict[str, Any], Any]:
    """Run the grid on ``val_problem`` (its "test" split is the validation data); returns
    ``({"epochs", "lr", "val": [[epochs, lr, value], ...]}, w of the chosen setting)``.
    ``client`` is the stage-3 :class:`~partialfl.pipeline.ClientConfig` whose
    other fields (batch size, clipping) every setting keeps."""
    from partialfl.pipeline.evaluation import evaluate_model, finetune_personal

    best, table = None, []
    for epochs, lr in grid.settings():
        w = w0 if epochs == 0 else finetune_personal(
            val_problem, theta, w0, client.sgd(epochs=epochs, lr=lr, steps=None), seed)
        ev = evaluate_model(val_problem, theta, w, "test")
        v = ev.accuracy if grid.metric == "val_acc" else -ev.loss
        table.append([epochs, lr, ev.accuracy if grid.metric == "val_acc" else ev.loss])
        if best is None or v > best[0]:
            best = (v, epochs, lr, w)
    _, epochs, lr, w = best
    return {"epochs": epochs, "lr": lr, "metric": grid.metric, "val": table}, w


def budget_plot(out_dir: Path, methods: Sequence[tuple[str, Any]], seeds: Sequence[int],
                path: Path | None = None) -> Path:
    """Stage 1 then stage 2 on one round axis (validation accuracy when logged, else test),
    a marker where each (method, seed) stopped, and each method's budget in rounds and
    wall-clock seconds in the legend. Reads ``stage1/`` and ``seed{s}/{method.name}/``."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partialfl.pipeline.report import STYLES
    from partialfl.runtime import read_jsonl

    out_dir = Path(out_dir)
    s1 = read_jsonl(out_dir / "stage1" / "stage1.jsonl")
    key = "val_acc" if s1 and "val_acc" in s1[0] else "test_acc"
    t1 = json.loads((out_dir / "stage1" / "timing.json").read_text())
    r1 = int(s1[-1]["round"])
    fig, (ax, az) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(3, 2))

    def draw(*args, **kw):  # on the full axis and on the zoom into stage 2
        ax.plot(*args, **kw)
        kw.pop("label", None)
        az.plot(*args, **kw)

    draw([h["round"] for h in s1], [100 * h[key] for h in s1], color="k", lw=1.4,
         label=f"stage 1 FedAvg: {r1}{'' if t1.get('stopped') else ' (cap)'} rounds, "
               f"{t1['seconds'] / 60:.1f} min")
    draw([r1], [100 * s1[-1][key]], "k*", ms=11)
    ys2 = [100 * s1[-1][key]]
    xmax = r1 + 1
    for a in (ax, az):
        a.axvline(r1, color="grey", lw=0.8, ls=":")
    for i, (label, method) in enumerate(methods):
        ls, marker = STYLES[i % len(STYLES)]
        color = f"C{i}"
        desc = []
        for s in seeds:
            d = out_dir / f"seed{s}" / method.name
            if not (d / "stage2.jsonl").exists():
                continue
            h = read_jsonl(d / "stage2.jsonl")
            xs = [r1 + r["round"] for r in h]
            ys = [100 * r[key] for r in h]
            draw(xs, ys, ls=ls, color=color, lw=1.3)
            ys2 += ys
            xmax = max(xmax, xs[-1])
            tf = d / "stage2_timing.json"
            t = json.loads(tf.read_text()) if tf.exists() else {}
            draw([xs[-1]], [ys[-1]], marker=marker, color=color, ms=9,
                 mfc=color if t.get("stopped") else "none")
            if t:
                desc.append(f"{t['rounds']}{'' if t.get('stopped') else ' (cap)'} rounds, "
                            f"{t['seconds'] / 60:.1f} min")
        ax.plot([], [], ls=ls, marker=marker, color=color,
                label=f"{label}: " + ("; ".join(desc) if desc else "not run"))
    ax.set_xlabel("communication rounds (stage 1, then stage 2)")
    ax.set_ylabel(("validation" if key == "val_acc" else "test") + " accuracy (%)")
    ax.set_title("stage budgets (dotted: end of stage 1; filled marker: stopped by the "
                 "plateau rule, hollow: cap)", fontsize=9)
    # the zoom shows where the curves end up: a fresh model's first points (local training
    # only) would squash it, so its lower end is the 10th percentile of stage 2's points
    low = float(np.percentile(ys2, 10))
    ys2 = [y for y in ys2 if y >= low]
    pad = max(0.5, 0.15 * (max(ys2) - min(ys2)))
    az.set_xlim(r1 - 0.05 * (xmax - r1) - 1, xmax + 0.05 * (xmax - r1) + 1)
    az.set_ylim(min(ys2) - pad, max(ys2) + pad)
    az.set_title("zoom: stage 2", fontsize=9)
    az.set_xlabel("communication rounds")
    for a in (ax, az):
        a.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path) if path else out_dir / "budget_curves.png"
    pio.savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def plateau_table(results: dict[str, Sequence[dict]], timings: dict[str, float]) -> str:
    """A markdown table of each (method, seed)'s budget: stage-2 rounds (and whether the
    plateau rule or the cap ended it), the stage-3 setting chosen on validation data, the
    validation and test accuracy and the minutes stages 2 and 3 took when they ran (a row
    that reused another row's stage 2, ``stage2_from``: its stage 3)."""
    from partialfl.pipeline.report import markdown_table

    rows = []
    for label, ms in results.items():
        for m in ms:
            c = m.get("finetune_choice") or {}
            rounds = m.get("stage2_rounds", "?")
            how = ("plateau" if m.get("stage2_stopped")
                   else f"cap {m.get('stage2_cap', '?')}, not flat")
            # the stages' own recorded times: a resumed table reloads finished runs, so
            # this invocation's time for them is ~0
            t = (m["stage2_seconds"] + m.get("stage3_seconds", 0.0) if "stage2_seconds" in m
                 else timings.get(f"seed{m['seed']}/{label}", float("nan")))
            shared = m.get("stage2_from")  # stage 2 of another row: this row's cost is stage 3
            if shared:
                how += f"; {shared}'s stage 2"
                t = m.get("stage3_seconds", float("nan"))
            rows.append([label, m["seed"], f"{rounds} ({how})",
                         ("0 ep (no fine-tuning)" if c and not c["epochs"] else
                          f"{c['epochs']} ep, lr {c['lr']:g}" if c else "-"),
                         f"{100 * m['val_acc']:.2f}" if "val_acc" in m else "-",
                         f"{100 * m['test_acc']:.2f}", f"{t / 60:.1f}"])
    note = ("Under the plateau rule the round counts stated above are caps and stage 3 uses "
            "the epochs and lr chosen on validation data (below), not the fixed ones; the "
            "validation split is carved from each client's training data, and the test split "
            "is read once, by the final evaluation.\n\n")
    return "## Stage budgets (plateau rule on validation data)\n\n" + note + markdown_table(
        ["method", "seed", "stage-2 rounds", "stage 3 (chosen on validation)",
         "val acc %", "test acc %", "stages 2-3 min"], rows)
