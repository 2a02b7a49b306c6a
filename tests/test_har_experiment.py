"""The har-table pieces: Ditto / local-only through the pipeline (toy data), the HAPT table's
data preparation and its quick run (real data; skipped when absent)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl import io as pio
from partialfl.algorithms.ditto import Ditto
from partialfl.build import Task
from partialfl.config import ConfigError
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.pipeline.evaluation import evaluate_run
from partialfl.pipeline.files import CLIENT_STATE, THETA1, THETA2
from partialfl.pipeline.stages import run_pipeline
from partialfl.problems.model import ModelProblem
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _cfg(method: MethodConfig, clients_per_round=3) -> RunSpec:
    stage = StageConfig(rounds=3, clients_per_round=clients_per_round,
                        client=SGDConfig(lr=0.1, batch_size=4), eval_every=1)
    return RunSpec(method=method, pretrain=stage, personalize=stage,
                          finetune=FinetuneConfig(lr=0.1, epochs=2, batch_size=4))


def test_method_config_for_full_personal_models():
    with pytest.raises(ConfigError, match="Ditto needs lam >= 0"):
        MethodConfig(algorithm="ditto", split="none")
    with pytest.raises(ConfigError, match="unknown key 'method.lam'"):
        MethodConfig(algorithm="ffgg", split="output", options={"lam": 1.0})
    with pytest.raises(ConfigError, match="keeps a full personal model"):
        MethodConfig(algorithm="ditto", split="output", options={"lam": 1.0})
    cfg = _cfg(MethodConfig(algorithm="ditto", split="none", options={"lam": 0.5}))
    assert RunSpec.from_dict(cfg.to_dict()) == cfg


def test_ditto_pipeline_deploys_personal_models_and_evaluates_new_clients(tmp_path):
    data = toy_data(8)
    task = Task(data=data, model_fn=toy_model, name="toy")
    res = run_pipeline(_cfg(MethodConfig(algorithm="ditto", split="none",
                                         options={"lam": 0.5})), task,
                       tmp_path / "d", progress=False)
    m = res.metrics
    assert m["test_acc"] == m["test_acc_before_ft"]  # no stage 3
    n = sum(p.numel() for p in toy_model().parameters())
    assert m["split_counts"]["personal_params"] == n
    # the deployed models are the clients' v_m (not θ): recompute the accuracy from them
    cs = pio.load_tensors(tmp_path / "d" / CLIENT_STATE)[0]
    pb = ModelProblem(make_split(toy_model(), "none"), data)
    from partialfl.pipeline.evaluation import evaluate_model

    v = Ditto.personal_v(res.theta, cs)
    assert evaluate_model(pb, v, {}, "test").accuracy == pytest.approx(m["test_acc"])
    assert evaluate_model(pb, res.theta, {}, "test").accuracy != pytest.approx(m["test_acc"])
    new = toy_data(3, seed=5)
    ev = evaluate_run(tmp_path / "d", new, model_fn=toy_model)
    # a new Ditto client: v from θ by 2 epochs of proximal SGD (λ = 0.5), by hand
    theta = pio.load_tensors(tmp_path / "d" / THETA2)[0]
    pn = ModelProblem(make_split(toy_model(), "none"), new)
    allc = np.arange(3)
    stacked = {k: t.unsqueeze(0).repeat(3, *([1] * t.dim())) for k, t in theta.items()}
    ref = run_sgd(pn, allc, stacked, {}, train="theta", cfg=SGDConfig(lr=0.1, epochs=2,
                  batch_size=4), seed=0, round_=-1, stream="new-clients", prox=(0.5, theta))
    assert ev["test"].accuracy == pytest.approx(evaluate_model(pn, ref.theta, {}, "test").accuracy)
    assert ev["before"].accuracy == pytest.approx(evaluate_model(pn, theta, {}, "test").accuracy)


def test_local_only_ignores_pretraining_and_trains_each_client_alone(tmp_path):
    data = toy_data(6)
    task = Task(data=data, model_fn=toy_model, name="toy")
    cfg = _cfg(MethodConfig(algorithm="local", split="none"), clients_per_round=None)
    res = run_pipeline(cfg, task, tmp_path / "l", progress=False)
    fresh = {n: p.detach() for n, p in toy_model(cfg.seed).named_parameters()}
    assert max_diff(res.theta, fresh) == 0  # θ never moves and is not the stage-1 model
    s1 = pio.load_tensors(tmp_path / "l" / "stage1" / THETA1)[0]
    assert max_diff(s1, fresh) > 1e-3
    # client m's model = 3 rounds of one local epoch from the fresh model, nothing else
    cs = pio.load_tensors(tmp_path / "l" / CLIENT_STATE)[0]
    pb = ModelProblem(make_split(toy_model(), "none"), data)
    for m in (0, 4):
        v = {n: t.clone() for n, t in fresh.items()}
        for r in range(3):
            v = {n: t[0] for n, t in run_sgd(
                pb, [m], v, {}, train="theta", cfg=SGDConfig(lr=0.1, batch_size=4),
                seed=cfg.seed, round_=r, stream="personal").theta.items()}
        assert max_diff(v, {n: cs["v/" + n][m] for n in v}) < 1e-6
    assert res.metrics["split_counts"]["global_params"] == 0
    ev = evaluate_run(tmp_path / "l", toy_data(2, seed=3), model_fn=toy_model)
    assert math.isfinite(ev["test"].accuracy)


# ----------------------------------------------------------------------------- real data
def test_load_data_holds_out_subjects_and_standardises_with_training_stats(data_dir):
    from partialfl.reproductions.har import load_data

    seen, new, info = load_data(data_dir, holdout=5)
    assert seen.num_clients == 21 and new.num_clients == 5
    assert not set(seen.client_ids) & set(new.client_ids)
    x = torch.cat(list(seen.train_x)).double()
    np.testing.assert_allclose(x.mean(dim=(0, 2)).numpy(), 0, atol=1e-4)
    np.testing.assert_allclose(x.std(dim=(0, 2), unbiased=False).numpy(), 1, atol=1e-4)
    assert seen.num_classes == 6 and seen.train_x[0].shape[1:] == (6, 128)
    assert info["new_subjects"] == list(new.client_ids)


@pytest.mark.slow
def test_quick_table_runs_and_reports_every_row(tmp_path, data_dir):
    from partialfl.reproductions.har import HAR, reproduce_table

    path = reproduce_table(tmp_path, quick=True, data_dir=data_dir, progress=False)
    text = path.read_text()
    for label, _ in HAR.rows:
        assert f"| {label} |" in text
    # every jointly personalized row against its matched baseline, with intervals but no
    # verdict at the quick size
    matched = text.split("## Joint training vs fine-tuning the same part: training")[1]
    matched = matched.split("\n## ")[0]
    for label, base in HAR.matched([lab for lab, _ in HAR.rows]).items():
        line = next(ln for ln in matched.splitlines() if ln.startswith(f"| {label} |"))
        assert f"| {base} |" in line and "[" in line and "(quick run)" in line
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert all(len(v) == 1 and 0 <= v[0]["test_acc"] <= 1 for v in res.values())
    assert all(0 <= v[0]["new_test_acc"] <= 1 for v in res.values())
    for png in ("learning_curves.png", "per_client_accuracy.png", "per_subject_accuracy.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # the paired intervals against FedAvg, without a verdict at the quick size
    assert "## Paired comparison with FedAvg: training subjects" in text
    section = text.split("## Paired comparison with FedAvg")[1].split("\n## ")[0]
    table = [ln for ln in section.splitlines() if ln.startswith("| FFGG")]
    assert table and all("[" in ln for ln in table)  # intervals
    assert not any(v in ln for ln in table for v in ("better", "worse", "no detectable"))
    # `partialfl evaluate` on the table folder: the held-out subjects of every run, with the
    # accuracy the table measured for them
    from partialfl.cli import main

    out = tmp_path / "eval.json"
    assert main(["evaluate", str(tmp_path), "--data-dir", str(data_dir), "--json",
                 str(out)]) == 0
    ev = json.loads(out.read_text())
    label = next(k for k in ev if k.endswith("ffgg-output"))
    assert ev[label]["test"]["accuracy"] == pytest.approx(res["FFGG (output)"][0]["new_test_acc"])
