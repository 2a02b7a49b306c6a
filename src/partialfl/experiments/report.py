"""Plots (PNG, matplotlib's Agg backend) and markdown tables made from metric histories."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
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


def docstring_bullets(doc: str, heading: str) -> list[str]:
    """The ``* `` bullets after ``heading`` in a module docstring, as markdown ``- `` items
    (so a reproduction's documented deviations are written into its summary verbatim)."""
    items: list[str] = []
    cur: list[str] = []
    for line in doc.split(heading, 1)[1].strip().splitlines():
        if line.startswith("* "):
            if cur:
                items.append(" ".join(cur))
            cur = [line[2:].strip()]
        elif line.strip():
            cur.append(line.strip())
    if cur:
        items.append(" ".join(cur))
    return [f"- {i}" for i in items]


def plot_curves(path: Path, panels: list[dict[str, list[dict]]], titles: Sequence[str], *,
                x: str, y: str, ylabel: str, xlabel: str | None = None,
                logy: bool = True) -> Path:
    """One panel per dict ``label -> history`` (list of metric records), shared y label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, curves, title in zip(axes[0], panels, titles):
        for label, hist in curves.items():
            xs = [h[x] for h in hist if y in h]
            ys = [h[y] for h in hist if y in h]
            if logy:
                ys = [max(v, 1e-300) if v == v else float("nan") for v in ys]
            ax.plot(xs, ys, label=label, lw=1.4)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel or ("communication rounds" if x == "round" else x))
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
