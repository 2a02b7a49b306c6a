"""``partialfl train CONFIG.toml``: a neural run from one :class:`~partialfl.spec.RunSpec`.

:func:`load_run_spec` reads and validates the TOML (``--set`` overrides, ``--device``; a
relative ``data.path`` is relative to the config file's folder);
:func:`partialfl.build.build` loads the data, builds the model, split and algorithm (so a bad
name, a missing data folder or an impossible split fails before anything is written);
:func:`run_train` then runs the three-stage pipeline (:mod:`partialfl.pipeline.stages`:
checkpoints every ``checkpoint_every`` rounds, resumes when run again into the same folder),
evaluates the held-out new clients and writes the report
(:mod:`partialfl.pipeline.train_report`). :func:`train` is the Python form for a user's own
model and data.

Files in ``--out``: ``spec.json``, ``stage1/`` (pre-training: ``stage1.jsonl`` …),
``stage2.jsonl``, ``metrics.json`` (stage 3, per-client accuracies by client id),
``new_clients.json`` (if ``data.holdout``), ``report.md``, ``learning_curves.png``,
``per_client_accuracy.png`` and, with ``logging.tensorboard``, ``tensorboard/``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from partialfl.build import Run, Task, build, build_loss_metric, build_split, load_spec_plugins
from partialfl.config import ConfigError, apply_overrides, from_dict, load_toml
from partialfl.pipeline.files import write_json
from partialfl.spec import DataSpec, ModelSpec, RunSpec


def load_run_spec(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                  device: str | None = None, data: dict | None = None) -> RunSpec:
    """The validated spec of a TOML file (or of ``data``) with ``key=value`` overrides. A
    model run without ``[model]`` / ``[data]`` gets the defaults (emnist_cnn on FEMNIST). A
    relative ``data.path`` in the file is taken relative to the file's folder when it exists
    there (else the working folder); one given by an override, relative to the working
    folder; the spec holds it as an absolute path (processes started in other folders, such
    as Flower's SuperNodes, read the same data)."""
    raw = load_toml(path) if path is not None else dict(data or {})
    if path is not None:
        raw = _data_path(raw, Path(path).resolve().parent)
    raw = _data_path(apply_overrides(raw, list(overrides)), Path.cwd())
    if device is not None:
        raw["device"] = device
    if path is not None:
        raw.setdefault("name", Path(path).stem)
    load_spec_plugins(raw.get("plugins", []))
    if "problem" not in raw:
        raw.setdefault("model", {})
        raw.setdefault("data", {})
    return from_dict(RunSpec, raw)


def _data_path(raw: dict, folder: Path) -> dict:
    """``raw`` with a relative ``data.path`` made absolute against ``folder`` (left as is if
    nothing exists there and ``folder`` is not the working folder: the working folder then
    decides)."""
    d = raw.get("data")
    if not (isinstance(d, dict) and isinstance(d.get("path"), str) and d["path"]):
        return raw
    p = Path(d["path"]).expanduser()
    if p.is_absolute() or (folder != Path.cwd() and not (folder / p).exists()):
        return raw if not p.is_absolute() else {**raw, "data": {**d, "path": str(p)}}
    return {**raw, "data": {**d, "path": os.path.normpath(folder / p)}}


def format_plan(plan: dict[str, Any]) -> str:
    """The dry-run plan, one fact per line."""
    counts = plan.get("split_counts") or {}
    g, p = counts.get("global_params"), counts.get("personal_params")
    lines = [
        f"run        {plan['name']}",
        f"data       {plan['data']}",
        f"clients    {plan['clients']} training ({plan['train_examples']} train / "
        f"{plan['test_examples']} test examples), {plan['new_clients']} new (held out)",
        f"model      {plan['model']}: {plan['parameters']:,} parameters, "
        f"{plan['num_classes']} classes",
        f"split      {plan['split']}: {g:,} global, {p:,} personal parameters",
        f"algorithm  {plan['algorithm']}",
        f"stages     {' → '.join(plan['stages']) or '(none)'}: pre-train "
        f"{plan['rounds']['pretrain']} rounds, personalize {plan['rounds']['personalize']} "
        f"rounds, fine-tune {plan['finetune_epochs']} epochs",
        f"device     {plan['device']} ({plan['precision']}, backend {plan['backend']}, "
        f"{plan.get('threads', 1)} torch thread(s): results repeat at this count)",
    ]
    return "\n".join(lines)


def run_built(run: Run, out: str | Path, *, progress: bool | None = None,
              on_round: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Run a built spec into ``out``; returns stage 3's metrics (plus ``new_clients``)."""
    from partialfl.devices import use_threads
    from partialfl.pipeline.evaluation import evaluate_new_clients
    from partialfl.pipeline.stages import run_pipeline
    from partialfl.pipeline.train_report import write_report

    spec, out = run.spec, Path(out)
    use_threads(spec.threads)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "spec.json", spec.to_dict())
    show = spec.logging.progress if progress is None else progress
    res = run_pipeline(spec.effective(), run.task, out, progress=show, on_round=on_round)
    metrics = dict(res.metrics)
    if run.new_clients is not None:
        ft = spec.effective().finetune
        _, w_pre = res.split.params()
        ev = evaluate_new_clients(res.theta, None, res.split, run.new_clients, ft.epochs,
                                  lr=ft.lr, batch_size=ft.batch_size, clip_norm=ft.clip_norm,
                                  w_pretrained=w_pre, seed=spec.seed,
                                  loss_fn=run.task.loss_fn, metric=run.task.metric,
                                  vectorize=False)
        new = {**ev["test"].as_dict("test"), "test_acc_before_ft": ev["before"].accuracy,
               "per_client_test_acc": ev["test"].per_client,
               "client_ids": list(run.new_clients.client_ids)}
        write_json(out / "new_clients.json", new)
        metrics["new_clients"] = new
    write_report(out, tensorboard=spec.logging.tensorboard)
    return metrics


def run_train(spec: RunSpec, out: str | Path | None = None, *, dry_run: bool = False,
              progress: bool | None = None) -> tuple[Run, dict[str, Any] | None]:
    """Build ``spec``; unless ``dry_run``, run it into ``out`` (default ``runs/NAME``)."""
    run = build(spec)
    if dry_run:
        return run, None
    return run, run_built(run, Path(out or Path("runs") / spec.name), progress=progress)


def train(model_fn: Callable[[int], Any], data, out: str | Path, **spec: Any):
    """Train ``model_fn(seed) -> nn.Module`` on ``data`` (a FederatedDataset) with the
    spec's other tables given as keywords (e.g. ``method={"algorithm": "ffgg", "split":
    "output"}``, ``personalize={"rounds": 20}``); returns the metrics. The Python form of
    ``partialfl train`` for a user's own model and data::

        from partialfl.pipeline.train import train
        metrics = train(lambda seed: MyNet(), my_federated_dataset, "runs/mine",
                        method={"algorithm": "ffgg", "split": "output"})
    """
    bad = sorted(set(spec) & {"model", "data", "problem"})
    if bad:
        raise ConfigError(f"train(): {bad} come from the model_fn and data arguments")
    s = from_dict(RunSpec, {"name": Path(out).name, **spec})
    text = data.train_x[0].dim() == 2 and not data.train_x[0].is_floating_point()
    loss_fn, metric = build_loss_metric(s, text)
    task = Task(data=data, model_fn=model_fn, loss_fn=loss_fn, metric=metric,
                split_fn=build_split, name=f"user-{Path(out).name}")
    return run_built(Run(s, task=task), out)


__all__ = ["DataSpec", "ModelSpec", "format_plan", "load_run_spec", "run_built", "run_train",
           "train"]
