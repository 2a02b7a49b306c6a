"""Experiment trackers for a finished ``partialfl train`` run: Weights & Biases and MLflow,
through their own libraries (extras ``partialfl[wandb]``, ``partialfl[mlflow]``).

Configured in the spec's ``[logging]`` table::

    [logging]
    wandb = { project = "my-study", mode = "offline" }   # any keyword of wandb.init
    mlflow = { tracking_uri = "file:./mlruns", experiment = "my-study" }

Like TensorBoard (:func:`partialfl.pipeline.train_report.write_tensorboard`), a tracker run is
derived from the run folder's JSONL when the run ends (so a resumed run is logged once, in
full): every evaluation record (``stage1/test_acc`` …) and per-round training record
(``stage2/train_loss``, ``stage2/examples_per_s``, ``stage2/rounds_per_s``) with the round as
step, the final metrics (``test_acc``, ``new_clients/test_acc`` …) and the spec as the run's
configuration. ``WANDB_MODE=offline`` / a local MLflow store (``sqlite:///mlflow.db`` with
full MLflow; a ``file:`` store needs ``MLFLOW_ALLOW_FILE_STORE=true`` since MLflow 3.x) log
without a server. A tracker's failure is reported in one line; the run folder is complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.config import ConfigError


def _series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"stage1/test_acc": [(round, value), …], …}`` of the run's evaluation and
    per-round training logs."""
    from partialfl.pipeline.train_report import TRAIN_SCALARS, stage_histories, train_histories

    out: dict[str, list[tuple[int, float]]] = {}

    def add(stage, recs, keys=None):
        for r in recs:
            for k, v in r.items():
                if (k != "round" and (keys is None or k in keys)
                        and isinstance(v, int | float) and not isinstance(v, bool)):
                    out.setdefault(f"{stage}/{k}", []).append((int(r["round"]), float(v)))

    for stage, recs in stage_histories(run_dir).items():
        add(stage, recs)
    for stage, recs in train_histories(run_dir).items():
        add(stage, recs, TRAIN_SCALARS)
    return out


def final_metrics(run_dir: Path) -> dict[str, float]:
    """The run's scalar results: ``metrics.json``'s numbers and ``new_clients.json``'s
    (as ``new_clients/…``)."""
    out: dict[str, float] = {}
    for prefix, name in (("", "metrics.json"), ("new_clients/", "new_clients.json")):
        f = run_dir / name
        if f.exists():
            for k, v in pio.read_json(f).items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[prefix + k] = float(v)
    return out


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _need(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logging.{extra} needs the {module} package: pip install "
                          f"'partialfl[{extra}]'") from None


def to_wandb(run_dir: Path, spec, options: dict[str, Any]) -> None:
    """One W&B run of ``run_dir`` (``options``: keywords of ``wandb.init``; each stage's
    metrics against its own step metric ``STAGE/round``)."""
    wandb = _need("wandb", "wandb")
    opts = {"name": spec.name, "dir": str(run_dir), **options}
    run = wandb.init(config=_flat(spec.to_dict()), reinit="create_new", **opts)
    try:
        series = _series(run_dir)
        for stage in sorted({k.split("/")[0] for k in series}):
            run.define_metric(f"{stage}/round")
            run.define_metric(f"{stage}/*", step_metric=f"{stage}/round")
        by_step: dict[tuple[str, int], dict[str, float]] = {}
        for key, pts in series.items():
            stage = key.split("/")[0]
            for r, v in pts:
                by_step.setdefault((stage, r), {f"{stage}/round": r})[key] = v
        for (_stage, _r), rec in sorted(by_step.items()):
            run.log(rec)
        run.summary.update(final_metrics(run_dir))
    finally:
        run.finish()


def to_mlflow(run_dir: Path, spec, options: dict[str, Any]) -> None:
    """One MLflow run of ``run_dir`` (``options``: ``tracking_uri``, ``experiment``)."""
    mlflow = _need("mlflow", "mlflow")
    if options.get("tracking_uri"):
        mlflow.set_tracking_uri(str(options["tracking_uri"]))
    mlflow.set_experiment(str(options.get("experiment") or spec.name))
    params = {k: str(v)[:500] for k, v in _flat(spec.to_dict()).items()}
    with mlflow.start_run(run_name=spec.name):
        mlflow.log_params(params)
        for key, pts in _series(run_dir).items():
            for r, v in pts:
                mlflow.log_metric(key, v, step=r)
        mlflow.log_metrics(final_metrics(run_dir))


def export_run(run_dir: str | Path, spec) -> None:
    """Log the finished run at ``run_dir`` to the trackers its spec's ``logging`` names."""
    run_dir = Path(run_dir)
    for key, fn in (("wandb", to_wandb), ("mlflow", to_mlflow)):
        opts = getattr(spec.logging, key)
        if opts is None:
            continue
        try:
            fn(run_dir, spec, dict(opts))
        except ConfigError:
            raise
        except Exception as e:  # the tracker's own error, in one line; the run is written
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"logging.{key}: {type(e).__name__}: {msg} (the run itself is "
                              f"complete in {run_dir})") from e


__all__ = ["export_run", "final_metrics", "to_mlflow", "to_wandb"]
