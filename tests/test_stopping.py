"""Stage budgets by a plateau rule on validation data and stage 3 chosen on validation data
(issue 17): the rule against a brute-force reading, the validation split, exact resume, and
that no choice reads a test example."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl.build import Task
from partialfl.config import ConfigError
from partialfl.data.federated import FederatedDataset
from partialfl.data.validation import carve_validation, validation_sizes
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.stages import run_pipeline
from partialfl.pipeline.stopping import (
    FinetuneGrid,
    StopConfig,
    ValidationConfig,
    budget_plot,
    plateau_table,
    plateaued,
)
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _brute(vals, window, delta, mode="max"):
    """First evaluation index k at which the last `window` values beat all earlier ones by
    less than `delta` (written out with loops)."""
    for k in range(window, len(vals)):
        best_before = None
        for j in range(0, k - window + 1):
            v = vals[j] if mode == "max" else -vals[j]
            best_before = v if best_before is None or v > best_before else best_before
        best_recent = None
        for j in range(k - window + 1, k + 1):
            v = vals[j] if mode == "max" else -vals[j]
            best_recent = v if best_recent is None or v > best_recent else best_recent
        if best_recent - best_before < delta:
            return k
    return None


@pytest.mark.parametrize("mode", ["max", "min"])
def test_plateau_rule_matches_brute_force(mode):
    rng = np.random.default_rng(0)
    metric = "val_acc" if mode == "max" else "val_loss"
    for trial in range(200):
        n = int(rng.integers(2, 15))
        vals = list(np.round(np.cumsum(rng.normal(0.01, 0.02, n)), 3))
        window = int(rng.integers(1, 4))
        delta = float(rng.choice([0.0, 0.005, 0.02]))
        stop = StopConfig(metric=metric, mode=mode, min_delta=delta, window=window)
        hist = [{metric: v} for v in vals]
        first = next((k for k in range(len(vals)) if plateaued(hist[:k + 1], stop)), None)
        assert first == _brute(vals, window, delta, mode), (trial, vals, window, delta)


def test_plateau_rule_examples_and_errors():
    stop = StopConfig(min_delta=0.01, window=2)
    h = [{"val_acc": v} for v in (0.5, 0.6, 0.65, 0.655, 0.659)]
    assert not plateaued(h[:4], stop)  # 0.655 vs best-before 0.6: +0.055
    assert plateaued(h, stop)  # last two (0.655, 0.659) vs 0.65: +0.009 < 0.01
    with pytest.raises(ConfigError, match="not logged"):
        plateaued([{"test_acc": 1.0}] * 3, stop)
    with pytest.raises(ConfigError, match="validation metric"):
        StopConfig(metric="test_acc")
    with pytest.raises(ConfigError, match="stop.window"):
        StopConfig(window=0)
    with pytest.raises(ConfigError, match="eval_every"):
        StageConfig(rounds=3, stop=StopConfig())
    with pytest.raises(ConfigError, match="personalize.stop reads validation data"):
        RunSpec(personalize=StageConfig(rounds=3, eval_every=1, stop=StopConfig()))
    with pytest.raises(ConfigError, match="finetune_grid.lr"):
        FinetuneGrid(lr=(0.0,))
    assert FinetuneGrid(epochs=(0, 2), lr=(0.1, 0.2)).settings() == [(0, 0.1), (2, 0.1),
                                                                     (2, 0.2)]


def test_validation_split_is_carved_from_training_data_only():
    data = toy_data(6)
    v = carve_validation(data, 0.25, 2, seed=3)
    n = data.train_sizes()
    assert list(v.sizes) == list(validation_sizes(n, 0.25, 2))
    for m in range(data.num_clients):
        k = v.sizes[m]
        assert k == (0 if n[m] < 2 else min(n[m] - 1, max(2, round(0.25 * n[m]))))
        # fit and val share the remaining training examples; together with val: the train set
        assert torch.equal(v.fit.train_x[m], v.val.train_x[m])
        both = torch.cat([v.val.train_x[m], v.val.test_x[m]]).flatten(1)
        orig = data.train_x[m].flatten(1)
        assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, orig.tolist()))
        assert v.val.test_x[m].shape[0] == k
        assert torch.equal(v.fit.test_x[m], data.test_x[m])  # the real test data untouched
    again = carve_validation(data, 0.25, 2, seed=3)
    other = carve_validation(data, 0.25, 2, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(v.val.test_x, again.val.test_x))
    assert not all(torch.equal(a, b) for a, b in zip(v.val.test_x, other.val.test_x)
                   if a.shape[0] > 1)
    with pytest.raises(ValueError, match="fraction"):
        carve_validation(data, 1.5, 2, seed=0)


def _plateau_cfg(algorithm="ffgg", split="output", rounds=30, finetune_split=None, **kw):
    stop = StopConfig(min_delta=0.02, window=2)
    stage = StageConfig(rounds=rounds, clients_per_round=3,
                        client=SGDConfig(lr=0.1, batch_size=4), eval_every=2, stop=stop)
    method = MethodConfig(algorithm=algorithm, split=split, finetune_split=finetune_split)
    return RunSpec(method=method, pretrain=replace(stage, rounds=6, stop=None),
                          personalize=stage, finetune=FinetuneConfig(lr=0.1, epochs=2,
                                                                    batch_size=4),
                          validation=ValidationConfig(0.3, 2),
                          finetune_grid=FinetuneGrid(epochs=(0, 1, 3), lr=(0.03, 0.3)),
                          checkpoint_every=3, **kw)


def _garbage_test(data: FederatedDataset, seed: int = 99) -> FederatedDataset:
    g = torch.Generator().manual_seed(seed)
    tx = [torch.randn(x.shape, generator=g) * 50 for x in data.test_x]
    ty = [torch.randint(0, data.num_classes, y.shape, generator=g) for y in data.test_y]
    return FederatedDataset(data.train_x, data.train_y, tx, ty, data.client_ids,
                            data.num_classes)


def _curves(path):
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in path.open()]


@pytest.mark.parametrize("row", [("ffgg", "output", None), ("fedsim", "output", None),
                                 ("fedavg", "none", "adapter")],
                         ids=["ffgg", "fedsim", "fedavg-ft-adapter"])
def test_no_choice_reads_a_test_example(tmp_path, row):
    """Garbage test inputs and random test labels change the test accuracy but none of the
    choices: stopping rounds, validation curves, stage-3 setting, θ — for a jointly
    personalized row, a stateful one and a matched baseline (FedAvg, then fine-tuning of
    zero-initialised adapters: its stage-3 choice too)."""
    data = toy_data(8)
    cfg = _plateau_cfg(*row[:2], finetune_split=row[2])
    a = run_pipeline(cfg, Task(data=data, model_fn=toy_model, name="toy"), tmp_path / "a",
                     progress=False)
    b = run_pipeline(cfg, Task(data=_garbage_test(data), model_fn=toy_model, name="toy"),
                     tmp_path / "b", progress=False)
    for f in ("stage1/stage1.jsonl", "stage2.jsonl"):
        ca, cb = _curves(tmp_path / "a" / f), _curves(tmp_path / "b" / f)
        assert ca == cb and all("val_acc" in r and "test_acc" not in r for r in ca)
    ma, mb = a.metrics, b.metrics
    for k in ("finetune_choice", "stage2_rounds", "stage2_stopped", "val_acc"):
        assert ma[k] == mb[k], k
    assert max_diff(a.theta, b.theta) == 0
    assert ma["test_acc"] != mb["test_acc"]  # the test data did change
    # the rule stopped stage 2 before its cap, at a round it logged
    assert ma["stage2_stopped"] and ma["stage2_rounds"] < 30
    assert _curves(tmp_path / "a" / "stage2.jsonl")[-1]["round"] == ma["stage2_rounds"]
    # the chosen setting is the grid's best on validation (ties: first)
    c = ma["finetune_choice"]
    vals = [row[2] for row in c["val"]]
    assert [c["epochs"], c["lr"]] == c["val"][int(np.argmax(vals))][:2]
    assert ma["val_acc"] == pytest.approx(max(vals))
    assert len(c["val"]) == 5


def test_plateau_run_resumes_at_the_same_stop(tmp_path):
    cfg = _plateau_cfg("fedsim")
    task = Task(data=toy_data(8), model_fn=toy_model, name="toy")
    ref = run_pipeline(cfg, task, tmp_path / "ref", progress=False)
    stop_round = ref.metrics["stage2_rounds"]

    class Cut(Exception):
        pass

    def hook(stage, r):
        if stage == "stage2" and r == stop_round - 2:
            raise Cut

    with pytest.raises(Cut):
        run_pipeline(cfg, task, tmp_path / "cut", progress=False, on_round=hook)
    res = run_pipeline(cfg, task, tmp_path / "cut", progress=False)
    assert res.metrics["stage2_rounds"] == stop_round
    assert max_diff(res.theta, ref.theta) == 0
    assert res.metrics["test_acc"] == ref.metrics["test_acc"]
    assert _curves(tmp_path / "cut" / "stage2.jsonl") == _curves(tmp_path / "ref" /
                                                                 "stage2.jsonl")


def test_validation_needs_an_in_memory_dataset():
    from partialfl.pipeline.stages import validation_tasks

    with pytest.raises(ConfigError, match="FederatedDataset, got object"):
        validation_tasks(_plateau_cfg(), Task(data=object(), model_fn=toy_model))


def test_configs_without_the_rule_keep_their_identity():
    cfg = RunSpec()
    d = cfg.to_dict()
    assert "validation" not in d and "finetune_grid" not in d
    assert "stop" not in d["personalize"]
    assert RunSpec.from_dict(d) == cfg
    p = _plateau_cfg()
    assert RunSpec.from_dict(p.to_dict()) == p


def test_budget_plot_and_table(tmp_path):
    cfg = _plateau_cfg(rounds=8)
    task = Task(data=toy_data(6), model_fn=toy_model, name="toy")
    methods = (("FFGG (output)", cfg.method),)
    res = run_pipeline(cfg, task, tmp_path / "seed0" / cfg.method.name,
                       stage1_dir=tmp_path / "stage1", progress=False)
    path = budget_plot(tmp_path, methods, [0])
    assert path.exists() and path.stat().st_size > 10_000
    table = plateau_table({"FFGG (output)": [res.metrics]}, {"seed0/FFGG (output)": 60.0})
    assert f"{res.metrics['stage2_rounds']} (" in table
    # the stages' recorded minutes, not this invocation's time (~0 for a reloaded run)
    m = res.metrics
    assert table.rstrip().endswith(f"| {(m['stage2_seconds'] + m['stage3_seconds']) / 60:.1f} |")
    no_times = {k: v for k, v in m.items() if k not in ("stage2_seconds", "stage3_seconds")}
    assert plateau_table({"FFGG (output)": [no_times]},
                         {"seed0/FFGG (output)": 60.0}).rstrip().endswith("| 1.0 |")


@pytest.mark.slow  # ~15 s on the shared machine
@pytest.mark.data
def test_shakespeare_tiny_table_under_the_rule(tmp_path):
    """The table driver passes the rule, the validation split and the grid to every run and
    reports where each method stopped (tiny size; needs the shared corpus)."""
    from partialfl.data.paths import default_data_dir
    from partialfl.data.shakespeare import FILE_NAME
    from partialfl.pipeline.stopping import plateau_settings
    from partialfl.reproductions import shakespeare as sh

    d = default_data_dir()
    if d is None or not (d / FILE_NAME).exists():
        pytest.skip(f"{FILE_NAME} not found (set PARTIALFL_DATA_DIR to ../shared/data)")
    # min_delta 1 (100 points): the rule fires at the first evaluation it may, round 1
    size = replace(sh.QUICK, max_clients=4, max_train=64, vocab_size=100, pretrain_rounds=2,
                   rounds=4, clients_per_round=2, d_model=8, d_ff=16, threads=1,
                   plateau=plateau_settings(window=1, min_delta=1.0,
                                            grid=FinetuneGrid(epochs=(0, 1), lr=(0.1,))))
    path = sh.reproduce_table(tmp_path, size=size, progress=False)
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    for label, _ in sh.SHAKESPEARE.rows:
        (m,) = res[label]
        assert m["stage2_rounds"] == 1 and m["stage2_stopped"] and m["stage2_cap"] == 4
        # stage 3 chosen on validation for every row with a personal part (plain FedAvg: none)
        assert (m["finetune_choice"]["epochs"] in (0, 1)) if label != "FedAvg" else \
            "finetune_choice" not in m
    text = path.read_text()
    assert "Stage budgets (plateau rule" in text and "1 (plateau)" in text
    assert (tmp_path / "budget_curves.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.data
def test_femnist_quick_table_under_the_rule(tmp_path, data_dir):
    from partialfl.reproductions.femnist import reproduce_table

    path = reproduce_table(tmp_path, quick=True, data_dir=data_dir, progress=False,
                           plateau=True)
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    for ms in res.values():
        (m,) = ms
        assert 1 <= m["stage2_rounds"] <= m["stage2_cap"] and "val_acc" in m
    assert "Stage budgets (plateau rule" in path.read_text()
    assert (tmp_path / "budget_curves.png").exists()


def test_tables_at_convergence_rule_every_stage_under_caps_beyond_the_fixed_budgets():
    """``--plateau`` (no explicit size) runs the FEMNIST and tiny-Shakespeare tables with the
    rule on stage 1 too and caps beyond the fixed budgets, evaluated often enough for the
    rule's window to fit well inside each cap."""
    from partialfl.reproductions import femnist as fm
    from partialfl.reproductions import shakespeare as sh

    for mod, cfgs in ((fm, fm.FEMNIST.stage_configs(fm.PLATEAU)),
                      (sh, sh.stage_configs(sh.PLATEAU))):
        pre, pers = cfgs[0], cfgs[1](MethodConfig())
        assert pre.stop is not None and pers.stop is not None, mod.__name__
        assert pre.rounds > mod.FULL.pretrain_rounds and pers.rounds > mod.FULL.rounds
        for st in (pre, pers):
            assert st.stop.window * st.eval_every <= st.rounds // 4, (mod.__name__, st)
            assert st.rounds % st.eval_every == 0  # the cap round is evaluated
    # the fixed tables keep stage 1 fixed
    assert fm.FEMNIST.stage_configs(fm.FULL)[0].stop is None
    assert sh.stage_configs(sh.FULL)[0].stop is None


def test_summaries_of_the_tables_at_convergence_state_the_rule_not_fixed_budgets():
    """A ``--plateau`` table is full size (verdicts given, no "quick run" note) and its
    summary states caps, stopping rounds and the validation-chosen stage 3 instead of the
    fixed tables' round counts and 5 epochs."""
    from partialfl.reproductions import femnist as fm
    from partialfl.reproductions import shakespeare as sh

    assert fm.FEMNIST.is_full(fm.PLATEAU) and fm.FEMNIST.is_full(replace(fm.PLATEAU, seeds=(0,)))
    assert sh.SHAKESPEARE.is_full(sh.PLATEAU)
    assert not fm.FEMNIST.is_full(replace(fm.PLATEAU, rounds=7))
    res = {"FedAvg": [{"stage1_rounds": 450}], "FFGG (input)": [{"stage1_rounds": 450}]}
    (stages,) = fm._stages(fm.PLATEAU, res)
    assert "cap 600, stopped at round 450" in stages and "cap 1000" in stages
    assert "chosen on validation" in stages and "5 epochs" not in stages
    assert "300 rounds" in fm._stages(fm.FULL, res)[0]
    dev = fm._deviations(fm.PLATEAU, 74)
    assert "plateau rule" in dev[0] and "600" in dev[0] and "300 rounds" not in " ".join(dev)
    assert sh._budget(sh.PLATEAU, 500, res) == ("until the plateau rule on validation data "
                                                "(cap 500 rounds, stopped at round 450)")
    assert sh._budget(sh.FULL, 200) == "200 rounds"
