"""The shakespeare-table reproduction, end to end at toy size (needs the shared corpus)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from partialfl.data.paths import default_data_dir
from partialfl.data.shakespeare import FILE_NAME
from partialfl.registry import entry
from partialfl.reproductions.shakespeare import (
    FULL,
    METHODS,
    PAPER,
    QUICK,
    SHAKESPEARE,
    reproduce_table,
    stage_configs,
)
from partialfl.runtime import read_jsonl

pytestmark = pytest.mark.data

TINY = replace(QUICK, max_clients=4, max_train=64, vocab_size=100, pretrain_rounds=2, rounds=1,
               clients_per_round=2, d_model=8, d_ff=16, threads=1,
               adapter_dim=3)  # not the split's own default (4): the size's must reach the runs


def _data_dir():
    d = default_data_dir()
    if d is None or not (d / FILE_NAME).exists():
        pytest.skip(f"{FILE_NAME} not found (set PARTIALFL_DATA_DIR to ../shared/data)")
    return d


def _block_params(d: int, ff: int) -> int:
    return 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)


def _check_outputs(out, size):
    summary = (out / "summary.md").read_text()
    for label, _ in SHAKESPEARE.rows:
        assert f"| {label} |" in summary
    assert "Deviations from the paper" in summary
    from _summaries import check_standalone_summary

    check_standalone_summary(summary, quick=size not in (FULL, PAPER))
    assert "paired difference vs FedAvg" in summary and "MDE" in summary
    assert "FedAvg + FT (adapter) (joint training vs fine-tuning the same part)" in summary
    res = json.loads((out / "results.json").read_text())["results"]
    assert set(res) == {label for label, _ in SHAKESPEARE.rows}
    for label, method in SHAKESPEARE.rows:
        assert len(res[label]) == len(size.seeds)
        for m in res[label]:
            for k in ("test_acc", "test_acc_before_ft", "train_acc", "test_acc_p10",
                      "test_acc_p90"):
                assert 0.0 <= m[k] <= 1.0
            # per-client token counts (what the paired intervals use) give the pooled accuracy
            c, t = (np.asarray(m[f"per_client_test_{k}"], float) for k in ("correct", "total"))
            assert c.sum() / t.sum() == pytest.approx(m["test_acc"], abs=1e-12)
            per = np.asarray(m["per_client_test_acc"], float)
            assert per.shape == (size.max_clients,)
            # the pooled accuracy is the token-weighted mean of the per-client accuracies
            assert min(per) - 1e-9 <= m["test_acc"] <= max(per) + 1e-9
            # personal parameters of each split, from the transformer's sizes
            pc = m["split_counts"]["personal_params"]
            d, ff, a, L = size.d_model, size.d_ff, size.adapter_dim, size.num_layers
            part = (method.finetune_split.name if method.finetune_split is not None
                    else method.split_kind)  # FedAvg + FT (part): the part it fine-tunes
            expect = {"none": 0, "input": _block_params(d, ff), "output": _block_params(d, ff),
                      "adapter": L * 2 * (d * a + a + a * d + d)}[part]
            assert pc == expect
        if method.finetune_split is not None:  # FedAvg's stage 2, shared
            assert m["stage2_from"] == "FedAvg"
            continue
        for seed in size.seeds:
            curve = read_jsonl(out / f"seed{seed}" / method.name / "stage2.jsonl")
            rounds = [r["round"] for r in curve if "test_acc" in r]
            assert rounds[0] == 0 and rounds[-1] == size.rounds
    for png in ("learning_curves.png", "per_client_accuracy.png"):
        assert (out / png).stat().st_size > 1000


def test_tiny_table_runs_and_resumes(tmp_path):
    _data_dir()
    out = tmp_path / "table"
    path = reproduce_table(out, size=TINY, progress=False)
    assert path == out / "summary.md"
    _check_outputs(out, TINY)
    first = json.loads((out / "results.json").read_text())["results"]
    # every stage is cached: a second call recomputes nothing and gives the same numbers
    t0 = time.perf_counter()
    reproduce_table(out, size=TINY, progress=False)
    again = json.loads((out / "results.json").read_text())["results"]
    assert time.perf_counter() - t0 < 30
    for label in first:
        assert [m["test_acc"] for m in first[label]] == [m["test_acc"] for m in again[label]]


@pytest.mark.slow  # ~40 s: the tiny table twice, once in worker processes
def test_worker_processes_give_the_same_table(tmp_path):
    """Runs in two spawned worker processes reproduce the in-process numbers exactly (all
    randomness derives from (seed, round, client), never from the process)."""
    _data_dir()
    size = replace(TINY, seeds=(0,), rounds=1)
    reproduce_table(tmp_path / "one", size=size, progress=False)
    reproduce_table(tmp_path / "two", size=replace(size, workers=2), progress=False)
    one, two = (json.loads((tmp_path / d / "results.json").read_text())["results"]
                for d in ("one", "two"))
    for label, _ in SHAKESPEARE.rows:
        assert [m["test_acc"] for m in one[label]] == [m["test_acc"] for m in two[label]]
        assert [m["train_acc"] for m in one[label]] == [m["train_acc"] for m in two[label]]


def test_registered_and_settings():
    assert entry("reproduction", "shakespeare-table").build is reproduce_table
    pre, stage2, ft = stage_configs(FULL)
    pers = stage2(METHODS[1][1])
    for st in (pre, pers):
        assert st.server.optimizer.name == "adam" and st.server.schedule.name == "warmup-linear"
        assert st.server.schedule.options.warmup == round(0.1 * st.rounds)
        assert st.client.batch_size == 64 and st.client.epochs == 1
        assert st.client.clip_norm == 0.1
    assert ft.epochs == 5
    # the paper-size configuration stays available
    assert (PAPER.num_layers, PAPER.num_heads, PAPER.d_model, PAPER.d_ff,
            PAPER.vocab_size) == (4, 4, 256, 1024, 10_000)
    assert FULL.seeds == (0, 1, 2)


@pytest.mark.slow
def test_quick_table(tmp_path):
    _data_dir()
    out = tmp_path / "quick"
    reproduce_table(out, quick=True, progress=False)
    _check_outputs(out, QUICK)
