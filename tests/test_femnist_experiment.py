"""The femnist-table reproduction (real data: skipped without ../shared/data)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _nn_toy import one_thread

from partialfl.data.femnist import load_femnist_npz, pixel_mean_std
from partialfl.registry import entry
from partialfl.reproductions.femnist import (
    FEMNIST,
    QUICK,
    evaluate_new_writers,
    load_data,
    reproduce_table,
)
from partialfl.reproductions.femnist_kfold import (
    collect_kfold,
    kfold_new_writers,
    load_fold,
    writer_folds,
)

pytestmark = pytest.mark.data


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_load_data_holds_out_writers_and_normalises_with_training_stats(data_dir):
    seen, new, info = load_data(data_dir, None, 10)
    everyone = load_femnist_npz(data_dir, normalize="leaf")
    assert seen.num_clients == everyone.num_clients - 10 and new.num_clients == 10
    assert not set(seen.client_ids) & set(new.client_ids)
    assert set(seen.client_ids) | set(new.client_ids) == set(everyone.client_ids)
    ids = list(everyone.client_ids)
    raw_seen = torch.cat([everyone.train_x[ids.index(c)] for c in seen.client_ids])
    mean, std = pixel_mean_std(raw_seen.numpy()[:, 0])
    np.testing.assert_allclose(info["pixel_mean"], mean, atol=1e-6)
    x = torch.cat(list(seen.train_x))[:, 0].numpy()
    ref = (raw_seen.numpy()[:, 0] - mean) / np.maximum(std, 0.1)
    np.testing.assert_allclose(x, ref, atol=1e-5)
    assert entry("reproduction", "femnist-table").build is reproduce_table


@pytest.mark.slow
def test_quick_table_runs_resumes_and_evaluates_new_writers(tmp_path, data_dir):
    path = reproduce_table(tmp_path, quick=True, data_dir=data_dir, progress=False)
    text = path.read_text()
    for label, _ in FEMNIST.rows:
        assert f"| {label} |" in text
    assert "## Deviations from the paper" in text
    assert text.count("joint training vs fine-tuning the same part): ") == 2 * 6  # + new
    from _summaries import check_standalone_summary

    check_standalone_summary(text, quick=True)
    assert "300 rounds" not in text and "stage 1 6 rounds, stage 2 3 rounds" in text
    assert text.count("paired difference vs FedAvg") == 2  # training and new writers
    for png in ("learning_curves.png", "per_client_accuracy.png"):
        assert (tmp_path / png).stat().st_size > 1000
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(res) == {label for label, _ in FEMNIST.rows}
    for label, _ in FEMNIST.rows:
        (m,) = res[label]
        assert 0 <= m["test_acc"] <= 1 and 0 <= m["new_test_acc"] <= 1
        assert len(m["per_client_test_acc"]) == QUICK.num_writers - QUICK.holdout
        assert sum(m["per_client_test_correct"]) / sum(m["per_client_test_total"]) == \
            pytest.approx(m["test_acc"])
        assert sum(m["new_per_client_test_correct"]) / sum(m["new_per_client_test_total"]) == \
            pytest.approx(m["new_test_acc"])
    # everything is checkpointed: a second call recomputes nothing and gives the same table
    assert reproduce_table(tmp_path, quick=True, data_dir=data_dir,
                           progress=False).read_text().split("Wall-clock")[0] == \
        text.split("Wall-clock")[0]
    run = tmp_path / "seed0" / "ffgg-adapter"
    ev = evaluate_new_writers(run, data_dir)
    assert ev["num_clients"] == QUICK.holdout
    assert ev["test"].accuracy == pytest.approx(res["FFGG (adapter)"][0]["new_test_acc"])
    # the same through the command line
    from partialfl.cli import main

    out = tmp_path / "eval.json"
    assert main(["evaluate", str(run), "--data-dir", str(data_dir), "--json", str(out)]) == 0
    cli = json.loads(out.read_text())["ffgg-adapter"]
    assert cli["num_clients"] == QUICK.holdout
    assert cli["test"]["accuracy"] == pytest.approx(ev["test"].accuracy)
    assert list(cli["test"]["per_client"]) == ev["client_ids"]
    # the whole table folder: every run, by its folder
    assert main(["evaluate", str(tmp_path), "--data-dir", str(data_dir), "--json",
                 str(out)]) == 0
    table = json.loads(out.read_text())
    assert set(table) == {f"seed0/{m.name}" for _, m in FEMNIST.rows}
    assert table["seed0/ffgg-adapter"]["test"]["accuracy"] == pytest.approx(ev["test"].accuracy)


@pytest.mark.slow
def test_table_from_the_store_with_processes_matches_memory(tmp_path, data_dir):
    """Reduced size: the table read from an on-disk store with the processes backend gives
    the same numbers as in memory with the sequential backend."""
    from dataclasses import replace

    from partialfl.cli import main

    size = replace(QUICK, pretrain_rounds=2, rounds=1, num_writers=6, holdout=2)
    reproduce_table(tmp_path / "mem", data_dir=data_dir, progress=False, size=size)
    reproduce_table(tmp_path / "disk", data_dir=data_dir, progress=False, size=size,
                    backend="processes", store=tmp_path / "store")
    a, b = (json.loads((tmp_path / d / "results.json").read_text())["results"]
            for d in ("mem", "disk"))
    for label, _ in FEMNIST.rows:
        for k in ("test_acc", "new_test_acc", "per_client_test_acc"):
            assert a[label][0][k] == b[label][0][k], (label, k)
    # a store written for other writers is refused
    with pytest.raises(ValueError, match="holds the writers of num_writers"):
        reproduce_table(tmp_path / "other", data_dir=data_dir, progress=False,
                        size=replace(size, num_writers=7), store=tmp_path / "store")
    assert main(["reproduce", "ls-compare", "--store", str(tmp_path / "store")]) == 2


def test_writer_folds_and_load_fold(data_dir):
    folds = writer_folds(data_dir, 5)
    everyone = load_femnist_npz(data_dir, normalize="leaf")
    assert sorted(w for f in folds for w in f) == sorted(everyone.client_ids)
    assert sorted(len(f) for f in folds) == [16, 17, 17, 17, 17]
    seen, new, info = load_fold(data_dir, folds[2])
    assert list(new.client_ids) == [c for c in everyone.client_ids if c in set(folds[2])]
    assert seen.num_clients == 84 - len(folds[2])
    assert not set(seen.client_ids) & set(new.client_ids)
    # the same normalisation as load_data would give with that hold-out
    ids = list(everyone.client_ids)
    raw_seen = torch.cat([everyone.train_x[ids.index(c)] for c in seen.client_ids])
    np.testing.assert_allclose(info["pixel_mean"], pixel_mean_std(raw_seen.numpy()[:, 0])[0],
                               atol=1e-6)


@pytest.mark.slow
def test_quick_kfold_every_writer_is_new_once_and_resumes(tmp_path, data_dir):
    path = kfold_new_writers(FEMNIST, tmp_path, folds=2, quick=True, data_dir=data_dir,
                             progress=False)
    text = path.read_text()
    assert "| FFGG (adapter) |" in text and "verdict" in text and "MDE" in text
    from _summaries import check_standalone_summary

    check_standalone_summary(text, quick=True)
    assert "| better |" not in text and "| worse |" not in text
    rec = json.loads((tmp_path / "kfold.json").read_text())
    new_ids = [w for r in rec["runs"] if r["label"] == "FedAvg" for w in r["new"]["client_ids"]]
    assert sorted(new_ids) == sorted(w for f in rec["folds"] for w in f)
    assert len(new_ids) == QUICK.num_writers
    for r in rec["runs"]:  # a fold's new writers are never among its training writers
        assert not set(r["new"]["client_ids"]) & set(r["seen"]["client_ids"])
        assert sum(r["new"]["total"]) > 0
    again = collect_kfold(FEMNIST, tmp_path, folds=2, data_dir=data_dir,
                          num_writers=QUICK.num_writers)
    assert sorted(map(json.dumps, again["runs"])) == sorted(map(json.dumps, rec["runs"]))
    # resumed: nothing recomputed, the same summary up to the measured times
    assert kfold_new_writers(FEMNIST, tmp_path, folds=2, quick=True, data_dir=data_dir,
                             progress=False).read_text().split("Cost")[0] == text.split("Cost")[0]


def test_a_fold_count_the_writers_cannot_fill_is_refused_before_training(tmp_path, data_dir,
                                                                        monkeypatch):
    """``reproduce femnist-table --folds 10^20`` exited with the right line only after stage 1
    had trained (adversarial round 10); the folds are now checked before the table runs."""
    from partialfl.reproductions import femnist

    def trained(*a, **k):
        raise AssertionError("the table ran before the folds were checked")

    monkeypatch.setattr(femnist.FEMNIST, "reproduce", trained)
    with pytest.raises(ValueError, match="folds must be an integer in 2.."):
        femnist.reproduce_table(tmp_path, quick=True, data_dir=data_dir, progress=False,
                                folds=10**20)
