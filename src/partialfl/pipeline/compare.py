"""``partialfl compare RUN… | STUDY``: a user's runs in the reproductions' paired table.

Every finished run (a folder with ``metrics.json``, found as ``partialfl evaluate`` finds them,
:func:`~partialfl.pipeline.runs.find_runs`) is grouped with the runs whose configuration
(``config.json``) is the same but for the seed: a group is one *method* (a setting of the
sweep), its runs its seeds. The groups are labelled by their method's name (``ffgg-output``)
when that tells them apart, else by the keys in which they differ
(``method.split=input, personalize.client.lr=0.1``), and compared with
:func:`~partialfl.pipeline.report.paired_section`:
pooled test accuracy with its 95% bootstrap interval over clients and seeds, the paired
difference from the baseline (the first group, or ``baseline``), its verdict and minimum
detectable difference (:mod:`partialfl.stats`). Pairing needs the same clients (by id) and
the same seeds in every group; runs that cannot be paired are refused with a one-line error
naming them. New clients (``new_clients.json``) get a second table the same way.

Writes ``compare.md`` and ``compare.png`` (each group's accuracy with its interval, training
and new clients) to ``out``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partialfl import io as pio


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def load_runs(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every finished run under ``paths`` (run, study or table folders): its folder,
    ``config.json``, ``metrics.json`` and ``new_clients.json`` (or None)."""
    from partialfl.pipeline.runs import confined, find_runs
    from partialfl.pipeline.study import read_index

    runs, seen = [], set()
    for p in paths:
        found = find_runs(p)
        index = read_index(p)
        if index is not None:  # a study: its runs in the order of its sweep values and seeds
            order = {r["folder"]: i for i, r in enumerate(index["runs"])}
            found.sort(key=lambda r: order.get(r.name, len(order)))
        for run in found:
            key = run.resolve()
            if key in seen:
                continue
            seen.add(key)
            if not (run / "metrics.json").is_file() or not (run / "config.json").is_file():
                raise FileNotFoundError(f"{run}: no metrics.json / config.json (not a finished "
                                        "pipeline run)")
            new = run / "new_clients.json"
            confined(run, [run / n for n in ("config.json", "metrics.json",
                                               "new_clients.json")])
            runs.append({"folder": run, "config": _checked(run / "config.json"),
                         "metrics": _checked(run / "metrics.json"),
                         "new": _checked(new) if new.is_file() else None})
    return runs


def _checked(path: Path) -> dict[str, Any]:
    """A run's JSON file, checked for what the comparison reads (a crafted one crashed it
    or was tabled as a wrong accuracy): a config's ``seed`` an integer >= 0, a metrics file's
    per-client counts (:func:`~partialfl.stats.check_counts`)."""
    from partialfl.stats import check_counts

    d = pio.read_json(path)
    seed = d.get("seed", 0) if path.name == "config.json" else 0
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise pio.FileFormatError(f"{path}: seed is {str(seed)[:60]!r}, not an integer >= 0")
    if "per_client_test_correct" in d:
        try:
            check_counts(d)
        except ValueError as e:
            raise pio.FileFormatError(f"{path}: {e} (damaged?)") from None
    return d


def group_runs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``label -> runs`` (see the module docstring), groups in order of first appearance,
    runs by seed; two runs of one group with the same seed are refused."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        cfg = {k: v for k, v in r["config"].items() if k != "seed"}
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(r)
    flats = {k: _flat(json.loads(k)) for k in groups}
    keys = sorted({n for f in flats.values() for n in f})
    differ = [n for n in keys if len({json.dumps(f.get(n), sort_keys=True)
                                      for f in flats.values()}) > 1]
    names = {k: str(g[0]["metrics"].get("method", g[0]["folder"].name))
             for k, g in groups.items()}
    unique = len(set(names.values())) == len(names)
    out = {}
    for k, members in groups.items():
        keys = ", ".join(f"{n.removesuffix('.name')}={flats[k][n]}" for n in differ
                         if flats[k].get(n) is not None)
        label = names[k] if unique or not keys else keys
        members = sorted(members, key=lambda r: r["config"].get("seed", 0))
        seeds = [r["config"].get("seed", 0) for r in members]
        if len(set(seeds)) != len(seeds):
            dup = next(s for s in seeds if seeds.count(s) > 1)
            a, b = [str(r["folder"]) for r in members if r["config"].get("seed", 0) == dup][:2]
            raise ValueError(f"{a} and {b} are the same configuration and seed {dup}: pass "
                             "one of them")
        out[label] = members
    return out


def _counts(members: list[dict], which: str) -> tuple | None:
    from partialfl.pipeline.report import counts_from_runs

    recs = []
    for r in members:
        m = r["metrics"] if which == "metrics" else r["new"]
        if m is None:
            return None
        recs.append({**m, "seed": r["config"].get("seed", 0)})
    return counts_from_runs(recs)


def _check_paired(groups: dict[str, list[dict]], baseline: str, which: str) -> None:
    """One line naming the runs that cannot be paired with the baseline's."""
    base = groups[baseline]
    seeds = [r["config"].get("seed", 0) for r in base]
    for label, members in groups.items():
        s = [r["config"].get("seed", 0) for r in members]
        if s != seeds:
            raise ValueError(f"cannot pair {label!r} (seeds {s}) with {baseline!r} (seeds "
                             f"{seeds}): compare runs of the same seeds")
        for r, b in zip(members, base):
            mr = r["metrics"] if which == "metrics" else r["new"]
            mb = b["metrics"] if which == "metrics" else b["new"]
            if mr is not None and mb is not None and mr.get("client_ids") != mb.get("client_ids"):
                raise ValueError(f"cannot pair {r['folder']} with {b['folder']}: they were "
                                 "evaluated on different clients (other data or partition)")


def compare(paths: Sequence[str | Path], out: str | Path, *, baseline: str | None = None,
            seed: int = 0) -> Path:
    """Write ``compare.md`` and ``compare.png`` of the runs under ``paths`` into ``out``
    (see the module docstring); returns the markdown's path."""
    from partialfl.pipeline.report import markdown_table, paired_section
    from partialfl.pipeline.train_report import divergence_line

    groups = group_runs(load_runs(paths))
    if baseline is None:
        baseline = next(iter(groups))
    elif baseline not in groups:
        raise ValueError(f"--baseline {baseline!r} is not a group; groups: {list(groups)}")
    lines = ["# Comparison", "",
             f"{sum(len(g) for g in groups.values())} runs in {len(groups)} group(s) (runs "
             "whose configuration differs only in the seed form one group); baseline: "
             f"{baseline}.", "",
             markdown_table(["group", "seeds", "runs"],
                            [[lab, " ".join(str(r["config"].get("seed", 0)) for r in g),
                              ", ".join(f"`{r['folder']}`" for r in g)]
                             for lab, g in groups.items()]), ""]
    diverged = [f"`{r['folder']}`" for g in groups.values() for r in g
                if divergence_line(r["metrics"])]
    bad = {lab for lab, g in groups.items() if any(divergence_line(r["metrics"]) for r in g)}
    if diverged:
        lines += [f"**Warning: {len(diverged)} run(s) diverged (final loss not finite): "
                  f"{', '.join(diverged)}; their accuracies are those of diverged models.**",
                  ""]
    intervals: dict[str, dict[str, Any]] = {}
    for which, title, clients in (("metrics", "Training clients", "clients"),
                                  ("new", "New clients (held out of training)", "new clients")):
        counts = {lab: _counts(g, which) for lab, g in groups.items()}
        if counts[baseline] is None:
            continue
        _check_paired(groups, baseline, which)
        if (n := counts[baseline][0].shape[-1]) < 2:
            lines += [f"## {title}", "", f"({n} client{'' if n == 1 else 's'}: no interval "
                      "over clients.)", ""]
            continue
        lines += [f"## {title}", "",
                  *paired_section(counts, baseline, unit="examples", clients=clients,
                                  seed=seed, verdict=len(groups) > 1), ""]
        intervals[title] = _intervals(counts, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from partialfl.pipeline.run_files import record_added

    names = ("compare.md", "compare.png")
    pio.clean_stale_writes(out, recursive=False, targets=(*names, "run_files.json"))  # killed
    for name in names:  # into a run folder: its files from now on
        record_added(out, name)
    _plot(out / "compare.png", intervals, bad)
    lines.append("Plot: `compare.png` (accuracy with its 95% interval per group"
                 + ("; groups with a diverged run in red, marked 'diverged')." if bad else ")."))
    pio.write_text(out / "compare.md", "\n".join(lines) + "\n")
    return out / "compare.md"


def _intervals(counts: dict[str, tuple | None], seed: int) -> dict[str, Any]:
    from partialfl.stats import accuracy_interval

    return {lab: accuracy_interval(c[0], c[1], seed=seed) for lab, c in counts.items()
            if c is not None}


def _plot(path: Path, panels: dict[str, dict[str, Any]], diverged: set[str] = frozenset()
          ) -> list[str]:
    """Each panel's accuracies with their intervals; a group in ``diverged`` (one of its
    runs diverged) is drawn in red and labelled so. Returns the labels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 0.6 * max(
        [len(p) for p in panels.values()] or [1]) + 1.8), squeeze=False)
    for ax, (title, ivs) in zip(axes[0], panels.items()):
        labels = list(ivs)
        for i, k in enumerate(labels):
            iv = ivs[k]
            ax.errorbar([100 * iv.estimate], [i], xerr=[[100 * (iv.estimate - iv.low)],
                                                         [100 * (iv.high - iv.estimate)]],
                        fmt="o", capsize=4, color="tab:red" if k in diverged else "tab:blue")
        drawn = [f"{k} (diverged)" if k in diverged else k for k in labels]
        ax.set_yticks(range(len(labels)), drawn, fontsize=8)
        for tick, k in zip(ax.get_yticklabels(), labels):
            tick.set_color("tab:red" if k in diverged else "black")
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xlabel("pooled test accuracy (%), 95% interval")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    pio.savefig(fig, path, dpi=120)
    plt.close(fig)
    return [t for ax in axes[0] for t in (x.get_text() for x in ax.get_yticklabels())]


__all__ = ["compare", "group_runs", "load_runs"]
