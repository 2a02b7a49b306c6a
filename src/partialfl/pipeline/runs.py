"""``partialfl evaluate``: new-client evaluation of one finished run or of every run of a table.

A *run folder* holds ``deploy.safetensors`` (the trained θ and the split's tensors) and
``config.json``; a *table folder* (``runs/femnist-table``) holds one run folder per seed and
method (``seed0/ffgg-output``, …). Each run's θ is evaluated on the clients held out of its
training by an *evaluator* ``(run_dir, data_dir, *, finetune_epochs, lr) -> dict`` that knows
where those clients come from (a table's: :func:`partialfl.reproductions.tables.
new_client_evaluator`): every new client fine-tunes its w, then pooled accuracy and its
distribution over clients are reported, as a table (per-client accuracies by client id) or as
JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.pipeline.report import markdown_table
from partialfl.pipeline.run_files import confined

#: the deployed-model file of a finished run, and its pickle-based name in older versions
DEPLOY_NAMES = ("deploy.safetensors", "deploy.pt")

#: with more runs than this, the per-client table is left to ``--json`` (it would be too wide)
MAX_PER_CLIENT_COLUMNS = 4


def find_runs(path: str | Path) -> list[Path]:
    """The finished run folders at ``path`` or one or two levels below it (folders holding
    ``deploy.safetensors``: a table's ``seed*/METHOD``), sorted; a clear error naming what to
    pass when there is none. A folder holding a pickle-based ``deploy.pt`` (older version, or
    planted) is listed too, so that evaluating it refuses that file by name."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder: pass a run folder (e.g. "
                                "runs/femnist-table/seed0/ffgg-output) or a table folder")
    if any((path / name).is_file() for name in DEPLOY_NAMES):
        confined(path, [path / n for n in DEPLOY_NAMES if (path / n).is_file()])
        return [path]
    found = [p for name in DEPLOY_NAMES for pattern in (f"*/{name}", f"*/*/{name}")
             for p in path.glob(pattern) if p.is_file()]
    confined(path, found)
    runs = sorted({p.parent for p in found})
    if runs:
        return runs
    if (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / DEPLOY_NAMES[0]} not found: the run has not finished "
                                "(rerun its reproduction to complete it)")
    subs = sorted(p.name for p in path.iterdir() if p.is_dir())
    raise FileNotFoundError(
        f"no finished run in {path} (no {DEPLOY_NAMES[0]} in it or below); pass a run folder "
        "such as "
        "runs/femnist-table/seed0/ffgg-output or the table folder runs/femnist-table"
        + (f" (sub-folders here: {', '.join(subs[:12])})" if subs else ""))


def evaluate_runs(path: str | Path, evaluator: Callable[[Path], Callable[..., dict]],
                  data_dir=None, *, finetune_epochs: int | None = None,
                  lr: float | None = None, progress: bool = False) -> dict[str, dict[str, Any]]:
    """``label -> evaluation`` for every run of :func:`find_runs` (label: the run folder
    relative to ``path``, or its name for a single run); ``evaluator(run)`` gives the run's
    new-client evaluation, whose dict (that of
    :func:`~partialfl.pipeline.evaluation.evaluate_run`) carries ``client_ids``; ``diverged``
    added: the run's divergence sentence, or None."""
    path = Path(path)
    runs = find_runs(path)
    it = runs
    if progress and len(runs) > 1:
        from tqdm.auto import tqdm

        it = tqdm(runs, desc="evaluating runs", leave=False)
    from partialfl.pipeline.train_report import run_divergence

    out = {}
    for run in it:
        label = run.name if run == path else run.relative_to(path).as_posix()
        out[label] = evaluator(run)(run, data_dir, finetune_epochs=finetune_epochs, lr=lr)
        out[label]["diverged"] = run_divergence(run) or _finetune_divergence(out[label]) or None
    return out


def _finetune_divergence(result: dict[str, Any]) -> str:
    """A sentence when the new clients' fine-tuned models diverged (their test loss is not
    finite: the fine-tuning lr, e.g. ``--lr``, too large), else ''."""
    loss = result["test"].loss
    return "" if np.isfinite(loss) else (
        f"the new clients' fine-tuning diverged (test loss {loss}): lower the fine-tuning lr")


def _pct(v: float) -> str:
    return "–" if v != v else f"{100 * v:.2f}"


def evaluation_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown tables of :func:`evaluate_runs`' results: one row per run (pooled test accuracy
    before and after fine-tuning, percentiles over clients), then the per-client test accuracy
    with client ids as rows and runs as columns (up to :data:`MAX_PER_CLIENT_COLUMNS` runs)."""
    rows = []
    for label, r in results.items():
        t = r["test"]
        rows.append([label, r["num_clients"], _pct(r["before"].accuracy), _pct(t.accuracy),
                     f"{_pct(t.p10)} / {_pct(t.p50)} / {_pct(t.p90)}", _pct(t.mean_client)])
    bad = [f"`{lab}`" for lab, r in results.items() if r.get("diverged")]
    text = ["New clients: test accuracy (%) of clients never seen in training, after "
            "fine-tuning their personal parameters on the trained θ.", "",
            *([f"**Warning: {len(bad)} run(s) diverged (a loss not finite): "
               f"{', '.join(bad)}; their accuracies are those of diverged models.**", ""]
              if bad else []),
            markdown_table(["run", "clients", "before fine-tuning", "after fine-tuning",
                            "per-client p10 / p50 / p90", "mean over clients"], rows)]
    if len(results) <= MAX_PER_CLIENT_COLUMNS:
        labels = list(results)
        ids = list(results[labels[0]]["client_ids"])
        per = {lab: dict(zip(results[lab]["client_ids"], results[lab]["test"].per_client))
               for lab in labels}
        text += ["", "Per client (test accuracy % after fine-tuning):", "",
                 markdown_table(["client", *labels],
                                [[cid, *(_pct(per[lab].get(cid, float("nan")))
                                         for lab in labels)] for cid in ids])]
    else:
        text += ["", f"Per-client accuracies of all {len(results)} runs: `--json`."]
    return "\n".join(text)


def _plain(v):
    if isinstance(v, np.ndarray):
        return [None if x != x else float(x) for x in v.tolist()]
    if isinstance(v, np.floating | np.integer):
        return v.item()
    return v


def to_json(results: dict[str, dict[str, Any]]) -> str:
    """The results as JSON: per run, each evaluation (``test``, ``train``, ``before``) with its
    scalars and ``per_client`` as ``{client id: accuracy}``."""
    out = {}
    for label, r in results.items():
        ids = list(r["client_ids"])
        run: dict[str, Any] = {"num_clients": r["num_clients"], "split": r.get("split"),
                               "diverged": r.get("diverged")}
        for key in ("before", "test", "train"):
            if key not in r:
                continue
            ev = r[key]
            run[key] = {"accuracy": ev.accuracy, "p10": ev.p10, "p50": ev.p50, "p90": ev.p90,
                        "mean_client": ev.mean_client, "loss": ev.loss, "total": ev.total,
                        "per_client": dict(zip(ids, _plain(ev.per_client)))}
        out[label] = run
    return json.dumps(out, indent=2, default=_plain)


#: the keys of every run's entry in :func:`to_json`'s output
_JSON_KEYS = frozenset({"num_clients", "split", "diverged", "test"})


def is_evaluation_json(path: Path) -> bool:
    """Whether the file ``path`` holds what :func:`to_json` writes (an earlier ``partialfl
    evaluate --json FILE``, which a rerun may replace)."""
    try:
        if path.stat().st_size > 1 << 28:
            return False
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and bool(d) and all(
        isinstance(r, dict) and _JSON_KEYS <= r.keys() for r in d.values())

