"""Plots (PNG, matplotlib's Agg backend) and markdown tables made from metric histories."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


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
