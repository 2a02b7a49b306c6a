"""`partialfl train` runs as a product: Ditto's new clients personalized, every client's
deployed model saved in the ``load_personalized`` layout (issue 23 items 2 and 6)."""

from __future__ import annotations

import json

import pytest
import torch
from _user_project import client_folder, tiny_toml

from partialfl.cli import main
from partialfl.pipeline.deploy import PersonalizedModels, load_personalized
from partialfl.pipeline.train import format_plan, run_train
from partialfl.pipeline.train import load_run_spec as load_train_spec

DITTO = ["method.algorithm=ditto", "method.split=none", "method.lam=0.1"]


def test_ditto_new_clients_train_their_personal_model(tmp_path, user_module):
    data = client_folder(tmp_path / "clients")
    spec = load_train_spec(tiny_toml(tmp_path / "t.toml", user_module, data), DITTO)
    run, m = run_train(spec, tmp_path / "o", progress=False)
    new = m["new_clients"]
    # the old code evaluated new clients with split "none" and no training: before == after
    assert new["test_acc"] != new["test_acc_before_ft"]
    assert new == json.loads((tmp_path / "o" / "new_clients.json").read_text())
    plan = format_plan(run.plan)
    assert "fine-tune" not in plan and "no fine-tuning" in plan


def test_ffgg_plan_still_says_fine_tune(tmp_path, user_module):
    data = client_folder(tmp_path / "clients")
    spec = load_train_spec(tiny_toml(tmp_path / "t.toml", user_module, data))
    run, _ = run_train(spec, dry_run=True)
    assert "fine-tune 1 epochs" in format_plan(run.plan)


@pytest.mark.parametrize("method", [[], DITTO])
def test_train_run_saves_every_clients_model(tmp_path, user_module, method):
    """``load_personalized(run folder, …)`` gives client m's deployed model, whose accuracy on
    its test data is the run's per-client test accuracy."""
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    out = tmp_path / "o"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress",
                 *[a for kv in method for a in ("--set", kv)]]) == 0
    m = json.loads((out / "metrics.json").read_text())
    spec = load_train_spec(cfg, method)
    run, _ = run_train(spec, dry_run=True)
    data_ = run.task.data
    for i, cid in enumerate(m["client_ids"]):
        net = load_personalized(out, run.task.model_fn(0), cid)
        with torch.no_grad():
            pred = net(data_.test_x[i]).argmax(-1)
        acc = (pred == data_.test_y[i]).float().mean().item()
        assert acc == pytest.approx(m["per_client_test_acc"][i], abs=1e-6), cid
    models = PersonalizedModels.load(out, run.task.model_fn(0))
    assert models.client_ids == tuple(m["client_ids"])
