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

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.build import Run, Task, build, build_loss_metric, build_split, load_spec_plugins
from partialfl.config import ConfigError, apply_overrides, from_dict, load_toml
from partialfl.pipeline.files import config_differences, json_default, write_json
from partialfl.pipeline.run_files import (
    RUN_FILES,
    record_end,
    record_start,
    refuse_linked_folders,
    remove_run,
)
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


def _stage3(plan: dict[str, Any]) -> str:
    """What stage 3 does: fine-tune w, or (Ditto, local-only: every parameter personal)
    nothing, the clients deploy their personal models v_m."""
    if not plan.get("full_personal"):
        return f"fine-tune {plan['finetune_epochs']} epochs"
    new = ("fresh model, the personalize budget" if plan.get("fresh_model")
           else f"from θ, {plan['finetune_epochs']} epochs")
    return ("no fine-tuning (each client deploys its personal model; new clients train "
            f"theirs {new})")


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
        f"rounds, {_stage3(plan)}",
        f"device     {plan['device']} ({plan['precision']}, backend {plan['backend']}, "
        f"{plan.get('threads', 1)} torch thread(s): results repeat at this count)",
    ]
    return "\n".join(lines)


def run_built(run: Run, out: str | Path, *, progress: bool | None = None,
              on_round: Callable[[str, int], None] | None = None,
              config: str | Path | None = None) -> dict[str, Any]:
    """Run a built spec into ``out``; returns stage 3's metrics (plus ``new_clients``).
    ``config``: the TOML file the spec came from, recorded in ``source.json`` (so that
    ``partialfl evaluate --allow-code`` finds the model module beside it)."""
    from partialfl.devices import use_threads
    from partialfl.pipeline.stages import run_pipeline
    from partialfl.pipeline.train_report import write_report

    spec, out = run.spec, Path(out)
    use_threads(spec.threads)
    out.mkdir(parents=True, exist_ok=True)
    refuse_linked_folders(out)  # no write may leave the run folder through a link
    record_start(out, spec.name)  # the user's own files already there (never deleted by
    # --overwrite; one named like a file of the run is refused)
    def record_spec() -> None:
        write_json(out / "spec.json", spec.to_dict())
        if config is not None:
            write_json(out / "source.json", {"config": str(Path(config).resolve())})

    resuming = (out / "spec.json").exists()
    if not resuming:  # a resume records its spec once the pipeline accepted it (another
        record_spec()  # configuration is refused, and the run's record stays its own)
    show = spec.logging.progress if progress is None else progress
    res = run_pipeline(spec.effective(), run.task, out, progress=show, on_round=on_round,
                       save_personalized=True)
    if resuming:
        record_spec()
    metrics = dict(res.metrics)
    if run.new_clients is not None:
        metrics["new_clients"] = _new_clients(run, out)
    write_report(out, tensorboard=spec.logging.tensorboard)
    if spec.logging.wandb is not None or spec.logging.mlflow is not None:
        from partialfl.pipeline.trackers import export_run

        export_run(out, spec)
    record_end(out)  # the files this run wrote: what --overwrite may delete
    return metrics


def _new_clients(run: Run, out: Path) -> dict[str, Any]:
    """The held-out clients of a finished run, evaluated as ``partialfl evaluate`` does
    (:func:`~partialfl.pipeline.evaluation.evaluate_run` on the run's deployed model: a
    split model fine-tunes w; Ditto / local-only train each client's personal model);
    written to ``new_clients.json``."""
    from partialfl.pipeline.evaluation import evaluate_run

    task = run.task
    ev = evaluate_run(out, run.new_clients, model_fn=task.model_fn, split_fn=task.split_fn,
                      loss_fn=task.loss_fn, metric=task.metric, device=_device(run.spec))
    new = {**ev["test"].as_dict("test"), "test_acc_before_ft": ev["before"].accuracy,
           "per_client_test_acc": ev["test"].per_client,
           "per_client_test_correct": ev["test"].per_client_correct,
           "per_client_test_total": ev["test"].per_client_total,
           "client_ids": list(run.new_clients.client_ids)}
    write_json(out / "new_clients.json", new)
    return new


def _device(spec: RunSpec) -> str:
    from partialfl.devices import resolve_device

    return str(resolve_device(spec.device))


def evaluate_train_run(run_dir: str | Path, data: str | Path | None = None, *,
                       finetune_epochs: int | None = None, lr: float | None = None
                       ) -> dict[str, Any]:
    """New-client evaluation of a finished train run (``partialfl evaluate``): its spec
    (``spec.json``) is rebuilt for the model; the new clients are the run's held-out clients
    (``data.holdout``) or, with ``data``, every client of that path read as the spec's
    ``data`` table reads its own (same source and options)."""
    import dataclasses

    from partialfl.build import build_data
    from partialfl.devices import use_threads
    from partialfl.pipeline.evaluation import evaluate_run

    run_dir = Path(run_dir)
    spec = load_run_spec(data=pio.read_json(run_dir / "spec.json"))
    use_threads(spec.threads)  # the run's own count: its stage 3 repeats exactly
    run = build(spec)
    if data is not None:
        d = dataclasses.replace(spec.data, path=str(Path(data).expanduser().resolve()),
                                holdout=0, num_clients=None)
        new, _ = build_data(dataclasses.replace(spec, data=d))
        _check_fits(new, run.task.data, f"--data {data}")
    elif run.new_clients is None:
        raise ValueError(f"{run_dir} held out no clients (data.holdout = 0): pass --data "
                         "PATH with the new clients' data")
    else:
        new = run.new_clients
        _check_held_out(run_dir, list(new.client_ids))
    task = run.task
    ev = evaluate_run(run_dir, new, model_fn=task.model_fn, split_fn=task.split_fn,
                      finetune_epochs=finetune_epochs, lr=lr, loss_fn=task.loss_fn,
                      metric=task.metric, device=_device(spec))
    return {**ev, "client_ids": list(new.client_ids)}


def _check_fits(new, data, what: str) -> None:
    """``new`` clients' examples of the shapes and dtypes the run's model was trained on
    (``data``) and labels among its classes, else a ValueError naming the difference."""
    def kind(d) -> tuple:
        return (tuple(d.train_x[0].shape[1:]), d.train_x[0].dtype, tuple(d.train_y[0].shape[1:]))

    if kind(new) != kind(data):
        raise ValueError(f"{what}: examples (x shape, dtype, y shape) {kind(new)}; the run's "
                         f"model was trained on {kind(data)}")
    from partialfl.build.run import check_tokens

    check_tokens(new, data, what)
    top = max((int(y.max()) for y in (*new.train_y, *new.test_y) if y.numel()), default=-1)
    if top >= int(data.num_classes):
        raise ValueError(f"{what}: label {top}, but the run's model has "
                         f"{int(data.num_classes)} classes")


def _check_held_out(run_dir: Path, ids: list[str]) -> None:
    """Refuse held-out clients rebuilt from ``spec.json`` that are not those the run held
    out: none of its training clients (``metrics.json``), the same as ``new_clients.json``
    (a ``spec.json`` edited or from another run — another ``data.seed`` — scored training
    clients as "never seen in training")."""
    m = pio.read_json(run_dir / "metrics.json") if (run_dir / "metrics.json").is_file() else {}
    seen = set(map(str, m.get("client_ids") or [])) & set(ids)
    f = run_dir / "new_clients.json"
    held = pio.read_json(f).get("client_ids") if f.is_file() else None
    if seen or (held is not None and list(map(str, held)) != ids):
        why = (f"{len(seen)} of them trained in this run ({', '.join(sorted(seen)[:3])})"
               if seen else f"{f.name} lists others")
        raise pio.FileFormatError(
            f"{run_dir / 'spec.json'} does not describe this run: the clients it holds out "
            f"are not the run's new clients ({why}); restore the run's spec.json or pass "
            "--data PATH")


def finished(out: str | Path) -> bool:
    """Whether ``out`` holds a finished train run: its spec and report (written last but one),
    or its record of the files it wrote without its spec (a removal by ``--overwrite`` cut
    short: see :mod:`~partialfl.pipeline.run_files`)."""
    out = Path(out)
    return ((out / "spec.json").is_file() and (out / "report.md").is_file()) or \
        removal_cut_short(out)


def removal_cut_short(out: str | Path) -> bool:
    """Whether ``out`` holds a finished run whose removal by ``--overwrite`` was cut short
    (its record of the files it wrote, without its spec): only ``--overwrite`` finishes it."""
    out = Path(out)
    return not (out / "spec.json").is_file() and (out / RUN_FILES).is_file()


def claim_out(out: str | Path, overwrite: bool = False, spec: RunSpec | None = None) -> None:
    """Make ``out`` ready for a run: a finished run there is refused (a one-line error naming
    the folder, what differs from ``spec`` if anything, and ``--overwrite``) or, with
    ``overwrite``, deleted — the files that run wrote and nothing else
    (:mod:`~partialfl.pipeline.run_files`); an unfinished one is left to resume."""
    out = Path(out)
    if not finished(out):
        return
    if not overwrite:
        diff = ""
        if spec is not None and (out / "spec.json").exists():
            old = pio.read_json(out / "spec.json")
            new = json.loads(json.dumps(spec.to_dict(), default=json_default))
            diff = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in
                             config_differences(old, new)[:3])
        what = f" with another configuration ({diff})" if diff else ""
        raise FileExistsError(f"{out} holds a finished run{what}; pass --overwrite to run it "
                              "again (or choose another --out)")
    remove_run(out)


def run_train(spec: RunSpec, out: str | Path | None = None, *, dry_run: bool = False,
              progress: bool | None = None) -> tuple[Run, dict[str, Any] | None]:
    """Build ``spec``; unless ``dry_run``, run it into ``out`` (default ``runs/NAME``)."""
    from partialfl.pipeline.stages import check_synchronous

    run = build(spec)
    check_synchronous(run.spec)  # (a dry run says so too)
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


__all__ = ["DataSpec", "ModelSpec", "claim_out", "evaluate_train_run", "finished",
           "format_plan", "load_run_spec", "removal_cut_short", "run_built", "run_train",
           "train"]
