"""Optional W&B and MLflow loggers (extras ``partialfl[wandb]`` / ``partialfl[mlflow]``),
tested offline: the tracker run holds the JSONL's per-round numbers and the final metrics."""

from __future__ import annotations

import json

import pytest
from _user_project import client_folder, tiny_toml

from partialfl.cli import main


def _run(tmp_path, user_module, logging: str):
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data, logging)
    out = tmp_path / "o"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    recs = [json.loads(x) for x in (out / "stage2_train.jsonl").read_text().splitlines()]
    return out, recs, json.loads((out / "metrics.json").read_text())


def test_mlflow_file_store_holds_the_run(tmp_path, user_module, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="needs the mlflow extra "
                                 "(pip install 'partialfl[mlflow]')")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: file store opt-in
    uri = (tmp_path / "mlruns").as_uri()
    out, recs, m = _run(tmp_path, user_module,
                        f'mlflow = {{ tracking_uri = "{uri}", experiment = "study" }}\n')
    mlflow.set_tracking_uri(uri)
    client = mlflow.tracking.MlflowClient()
    exp = client.get_experiment_by_name("study")
    (run,) = client.search_runs([exp.experiment_id])
    hist = client.get_metric_history(run.info.run_id, "stage2/train_loss")
    assert sorted((h.step, round(h.value, 6)) for h in hist) == \
        [(r["round"], round(r["train_loss"], 6)) for r in recs]
    assert run.data.metrics["test_acc"] == pytest.approx(m["test_acc"])
    assert run.data.params["method.algorithm"] == "ffgg"


def test_wandb_offline_run_holds_the_run(tmp_path, user_module, monkeypatch):
    """A real offline W&B run (its records stay in a binary file: what the run was given is
    read through a spy on the real run's ``log`` and ``summary``)."""
    wandb = pytest.importorskip("wandb", reason="needs the wandb extra "
                                "(pip install 'partialfl[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, summary = [], {}
    real_init = wandb.init

    def init(**kw):
        run = real_init(**kw)
        real_log, real_finish = run.log, run.finish

        def log(rec, *a, **k):
            logged.append(dict(rec))
            return real_log(rec, *a, **k)

        def finish(*a, **k):
            summary.update({k_: run.summary[k_] for k_ in run.summary.keys()})
            return real_finish(*a, **k)

        run.log, run.finish = log, finish
        return run

    monkeypatch.setattr(wandb, "init", init)
    out, recs, m = _run(tmp_path, user_module, 'wandb = { project = "study" }\n')
    assert len(list((out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    got = [(r["stage2/round"], r["stage2/train_loss"]) for r in logged
           if "stage2/train_loss" in r]
    assert got == [(r["round"], r["train_loss"]) for r in recs]
    assert summary["test_acc"] == pytest.approx(m["test_acc"])


def test_unknown_mlflow_key_is_one_line(tmp_path, user_module, capsys):
    pytest.importorskip("mlflow")
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data, 'mlflow = { uri = "x" }\n')
    assert main(["train", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "logging.mlflow.uri" in err, err
