"""A ``partialfl train`` run's report, rebuilt from its logs alone (``partialfl report``).

Reads ``stage1/stage1.jsonl``, ``stage2.jsonl`` (evaluations), ``stage1/stage1_train.jsonl``,
``stage2_train.jsonl`` (per round: training loss, examples/s, rounds/s), ``metrics.json`` and
``new_clients.json`` of a run folder and writes ``report.md`` (one markdown table),
``learning_curves.png`` (test metric per round, both federated stages),
``per_client_accuracy.png`` (the distribution of the final per-client test accuracy, training
and new clients) and, with ``tensorboard=True``, TensorBoard scalars (``tensorboard/``, tags
``stage1/test_acc``, ``stage2/train_loss`` …, step = round; needs the
``partialfl[tensorboard]`` extra). JSONL stays the record: the event files are derived.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.pipeline.report import markdown_table, plot_curves

#: the numbers a report reads from a log record, a ``metrics.json`` and a ``spec.json``
RECORD_NUMBERS = ("test_acc", "train_loss", "examples_per_s", "rounds_per_s", "dp_epsilon",
                  "dp_delta", "dp_noise_multiplier", "dp_clip_norm")
METRIC_NUMBERS = ("test_acc", "test_acc_before_ft", "test_acc_p10", "test_acc_p50",
                  "test_acc_p90", "train_acc")
#: the files of a run folder a report reads
READS = ("stage1/stage1.jsonl", "stage2.jsonl", "stage1/stage1_train.jsonl",
         "stage2_train.jsonl", "metrics.json", "new_clients.json", "spec.json")
#: a DP record gives all of these or none (the report's privacy line reads them together)
DP_KEYS = ("dp_epsilon", "dp_delta", "dp_noise_multiplier", "dp_clip_norm")


def _is_number(v: Any) -> bool:
    """A JSON number a float holds (NaN and ±inf allowed; not a bool, not an integer past the
    float range)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _bad(path: Path, where: str, key: str, v: Any, want: str) -> pio.FileFormatError:
    return pio.FileFormatError(f"{path}{where}: {key} is {str(v)[:60]!r}, not {want} "
                               "(damaged, or not a run folder of this version?)")


def _hist(path: Path) -> list[dict[str, Any]]:
    """The records of a run's JSONL log, checked for what the report reads (a wrong type
    or a missing round ended ``partialfl report`` in a traceback): every record has an
    integer ``round`` >= 0, the :data:`RECORD_NUMBERS` it has are numbers, and its DP keys
    are all there or none."""
    from partialfl.runtime import read_jsonl

    recs = read_jsonl(path) if path.exists() else []
    for i, r in enumerate(recs, 1):
        where = f", record {i}"
        rnd = r.get("round")
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not 0 <= rnd < 2 ** 53:
            raise _bad(path, where, "round", rnd, "a round number (an integer >= 0)")
        for k in RECORD_NUMBERS:
            if k in r and not _is_number(r[k]):
                raise _bad(path, where, k, r[k], "a number")
        if any(k in r for k in DP_KEYS) and not all(k in r for k in DP_KEYS):
            raise pio.FileFormatError(f"{path}{where}: a DP record needs all of "
                                      f"{', '.join(DP_KEYS)} (damaged?)")
    return recs


def _json(path: Path) -> dict[str, Any] | None:
    return pio.read_json(path) if path.exists() else None


def _metrics(path: Path) -> dict[str, Any] | None:
    """A run's ``metrics.json`` / ``new_clients.json`` (None when absent), checked for what
    the report reads: :data:`METRIC_NUMBERS` numbers or null, ``client_ids`` a list,
    ``per_client_test_acc`` a list of numbers or nulls."""
    m = _json(path)
    if m is None:
        return None
    for k in METRIC_NUMBERS:
        if m.get(k) is not None and not _is_number(m[k]):
            raise _bad(path, "", k, m[k], "a number")
    if not isinstance(m.get("client_ids", []), list):
        raise _bad(path, "", "client_ids", m["client_ids"], "a list")
    pc = m.get("per_client_test_acc", [])
    if not isinstance(pc, list) or not all(v is None or _is_number(v) for v in pc):
        raise _bad(path, "", "per_client_test_acc", pc, "a list of numbers")
    return m


def _spec(path: Path) -> dict[str, Any]:
    """The run's ``spec.json`` ({} when absent), checked for what the report reads: its
    ``name`` and ``method.algorithm`` are strings."""
    spec = _json(path) or {}
    method = spec.get("method", {})
    if not isinstance(method, dict):
        raise _bad(path, "", "method", method, "a table")
    for k, v in (("name", spec.get("name", "")), ("method.algorithm",
                                                  method.get("algorithm", ""))):
        if not isinstance(v, str):
            raise _bad(path, "", k, v, "a string")
    return spec


def stage_histories(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """``{"stage1": records, "stage2": records}`` of a run folder (missing stages: [])."""
    run_dir = Path(run_dir)
    return {"stage1": _hist(run_dir / "stage1" / "stage1.jsonl"),
            "stage2": _hist(run_dir / "stage2.jsonl")}


#: the per-round training scalars written to TensorBoard (from ``stage*_train.jsonl``)
TRAIN_SCALARS = ("train_loss", "examples_per_s", "rounds_per_s")


def train_histories(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """``{"stage1": records, "stage2": records}`` of the per-round training logs
    (``stage1/stage1_train.jsonl``, ``stage2_train.jsonl``; a resumed stage logged some
    rounds twice: the last record of each round is kept), sorted by round."""
    run_dir = Path(run_dir)
    out = {}
    for stage, f in (("stage1", run_dir / "stage1" / "stage1_train.jsonl"),
                     ("stage2", run_dir / "stage2_train.jsonl")):
        last = {int(r["round"]): r for r in _hist(f)}
        out[stage] = [last[k] for k in sorted(last)]
    return out


def _pct(v) -> str:
    return "–" if v is None or v != v else f"{100 * float(v):.2f}"


#: the final metrics of a model run whose non-finite value says that it diverged
DIVERGENCE_KEYS = ("test_loss", "train_loss")


def diverged(metrics: Mapping[str, Any]) -> list[str]:
    """The final losses of a model run (its ``metrics.json``) that are not finite: the run
    diverged, also where θ stayed finite (a blown-up θ overflows the logits)."""
    return [k for k in DIVERGENCE_KEYS if isinstance(metrics.get(k), int | float)
            and not math.isfinite(metrics[k])]


def divergence_line(metrics: Mapping[str, Any]) -> str:
    """The report's and the CLI's sentence for a diverged run ('' if it did not)."""
    bad = diverged(metrics)
    return (f"the run diverged: {', '.join(bad)} not finite at the end; the accuracies are "
            "those of a diverged model (lower the learning rates of the stage that diverged: "
            "personalize.server.lr, personalize.client.lr; stage 3: finetune.lr)"
            ) if bad else ""


def run_divergence(run_dir: Path) -> str:
    """:func:`divergence_line` of the run in ``run_dir`` (its ``metrics.json``; '' without
    one)."""
    return divergence_line(_metrics(Path(run_dir) / "metrics.json") or {})


def report_table(run_dir: Path) -> str:
    m = _metrics(run_dir / "metrics.json")
    if m is None:
        raise FileNotFoundError(f"{run_dir / 'metrics.json'} not found: is {run_dir} a "
                                "finished `partialfl train` run folder?")
    rows = [["training clients", len(m.get("client_ids", [])), _pct(m.get("test_acc_before_ft")),
             _pct(m.get("test_acc")),
             " / ".join(_pct(m.get(f"test_acc_p{q}")) for q in (10, 50, 90)),
             _pct(m.get("train_acc"))]]
    new = _metrics(run_dir / "new_clients.json")
    if new is not None:
        rows.append(["new clients (held out)", len(new.get("client_ids", [])),
                     _pct(new.get("test_acc_before_ft")), _pct(new.get("test_acc")),
                     " / ".join(_pct(new.get(f"test_acc_p{q}")) for q in (10, 50, 90)), "–"])
    return markdown_table(["clients", "count", "test acc before fine-tuning (%)",
                           "test acc (%)", "per-client p10 / p50 / p90 (%)",
                           "train acc (%)"], rows)


def privacy_lines(hists: dict[str, list[dict]]) -> list[str]:
    """The guarantee of θ of a run with a ``[privacy]`` block: every private federated
    stage's ε (its accountant, last record) and, when both are private, the two together by
    basic composition (ε₁ + ε₂, δ₁ + δ₂): both release θ computed from the same clients."""
    from partialfl.pipeline.closed_form import privacy_note

    names = {"stage1": "stage 1 (pre-training)", "stage2": "stage 2 (personalization)"}
    lines = [line for stage, recs in hists.items()
             for line in privacy_note(recs, f", {names.get(stage, stage)}")]
    last = [recs[-1] for recs in hists.values() if recs and "dp_epsilon" in recs[-1]]
    if len(last) > 1:
        eps = sum(r["dp_epsilon"] for r in last)
        lines.append(f"Both stages together (basic composition, an upper bound): ε ≤ "
                     f"{eps:.2f}, δ ≤ {sum(r['dp_delta'] for r in last):.3g}.")
    return lines


def write_tensorboard(run_dir: Path, hists: dict[str, list[dict]],
                      train: dict[str, list[dict]] | None = None) -> Path:
    """Scalars of every logged number under ``run_dir/tensorboard`` (rewritten): the
    evaluation records ``hists`` and the per-round :data:`TRAIN_SCALARS` of ``train``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from partialfl.config import ConfigError

        raise ConfigError("logging.tensorboard needs the tensorboard package: pip install "
                          "'partialfl[tensorboard]'") from None
    from partialfl.pipeline.run_files import confined, record_added

    tb = run_dir / "tensorboard"
    confined(run_dir, [tb])  # a linked folder: its files (outside the run) would be deleted
    record_added(run_dir, tb.name)  # never the user's own folder; --overwrite deletes it
    tb.mkdir(parents=True, exist_ok=True)
    for f in tb.glob("events.out.tfevents.*"):
        f.unlink()  # ours only: derived from the JSONL, rebuilt every time
    w = SummaryWriter(str(tb))
    try:
        for stage, recs in hists.items():
            for r in recs:
                for k, v in r.items():
                    if k != "round" and isinstance(v, int | float) and not isinstance(v, bool):
                        w.add_scalar(f"{stage}/{k}", float(v), int(r["round"]))
        for stage, recs in (train or {}).items():
            for r in recs:
                for k in TRAIN_SCALARS:
                    if isinstance(r.get(k), int | float):
                        w.add_scalar(f"{stage}/{k}", float(r[k]), int(r["round"]))
    finally:
        w.close()
    return tb


def _per_client_plot(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, f in (("training clients", "metrics.json"), ("new clients", "new_clients.json")):
        m = _metrics(run_dir / f)
        if m is None:
            continue
        a = np.sort(np.asarray(m.get("per_client_test_acc", []), float))
        a = a[~np.isnan(a)]
        if a.size:
            ax.step(100 * a, np.arange(1, a.size + 1) / a.size, where="post",
                    label=f"{label} ({a.size})")
    ax.set_xlabel("per-client test accuracy (%)")
    ax.set_ylabel("fraction of clients (CDF)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    pio.savefig(fig, run_dir / "per_client_accuracy.png", dpi=120)
    plt.close(fig)


def write_report(run_dir: str | Path, *, tensorboard: bool = False,
                 rebuild: bool = False) -> Path:
    """(Re)build ``report.md`` and the plots of a run folder from its logs. ``rebuild``
    (``partialfl report``): only of a finished run — an interrupted one is refused (one
    line), since its report would mark it finished and stop its resume."""
    from partialfl.pipeline.run_files import RUN_FILES, confined

    run_dir = Path(run_dir)
    confined(run_dir, [run_dir / f for f in READS])  # a link would report another run
    hists = stage_histories(run_dir)
    spec = _spec(run_dir / "spec.json")
    table = report_table(run_dir)
    if rebuild and (run_dir / "spec.json").is_file() and not (run_dir / "report.md").exists() \
            and not (run_dir / RUN_FILES).exists():
        raise ValueError(f"{run_dir} holds a run that has not finished (interrupted): resume "
                         f"it first (`partialfl train CONFIG --out {run_dir}`), which writes "
                         "its report")
    if rebuild:  # the temporary files of a killed `partialfl report` (of its own writes)
        pio.clean_stale_writes(run_dir, recursive=False, targets=(
            "report.md", "learning_curves.png", "per_client_accuracy.png", RUN_FILES))

    def pct(recs):
        return [{"round": r["round"], "test_acc": 100 * r["test_acc"]} for r in recs
                if isinstance(r.get("test_acc"), int | float)]

    panels = [{"FedAvg pre-training": pct(hists["stage1"])},
              {spec.get("method", {}).get("algorithm", "stage 2"): pct(hists["stage2"])}]
    plot_curves(run_dir / "learning_curves.png", panels,
                ["stage 1: pre-training", "stage 2: personalization (deployed)"],
                x="round", y="test_acc", ylabel="test accuracy (%)", logy=False)
    _per_client_plot(run_dir)
    if tensorboard:
        write_tensorboard(run_dir, hists, train_histories(run_dir))
    name = spec.get("name", run_dir.name)
    privacy = privacy_lines(hists)
    why = divergence_line(_metrics(run_dir / "metrics.json") or {})
    text = "\n".join([f"# {name}", "", *([f"**Warning: {why}.**", ""] if why else []), table,
                      "", *(f"{p}\n" for p in privacy),
                      "Plots: `learning_curves.png`, `per_client_accuracy.png`. Logs: "
                      "`stage1/stage1.jsonl`, `stage2.jsonl`, `metrics.json`.", ""])
    pio.write_text(run_dir / "report.md", text)
    return run_dir / "report.md"
