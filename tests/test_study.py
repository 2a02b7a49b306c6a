"""A researcher's study (issue 23): `train --seeds/--sweep` in worker processes, `compare`,
`evaluate` of train runs, `--overwrite`, the plan first, heartbeat lines, symlinks refused."""

from __future__ import annotations

import json
import os

import pytest
from _user_project import client_folder, tiny_toml

from partialfl.cli import main


def _study(tmp_path, user_module, out, *extra):
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    return main(["train", str(cfg), "--out", str(out), "--no-progress", "--seeds", "0", "1",
                 "--sweep", "method.split=output,input", *extra])


def test_sweep_grid_is_the_product_of_values_and_seeds():
    from partialfl.pipeline.study import folder_name, parse_sweep, study_runs

    sweep = parse_sweep(["a.b=1,2", "c=[1,2],x"])
    assert sweep == {"a.b": ["1", "2"], "c": ["[1,2]", "x"]}
    runs = study_runs([0, 3], sweep)
    assert len(runs) == 2 * 2 * 2
    assert runs[0] == {"folder": "a.b=1,c=_1_2_,seed=0", "seed": 0,
                       "set": {"a.b": "1", "c": "[1,2]"}}
    assert folder_name({"k": "../x"}, 1) == "k=.._x,seed=1"  # a value never makes a path
    for bad in (["a"], ["a="], ["seed=1,2"], ["a=1", "a=2"]):
        with pytest.raises(ValueError, match="sweep"):
            parse_sweep(bad)


@pytest.mark.slow  # ~10 s on a quiet machine: three studies of four runs
def test_study_runs_are_the_same_whatever_the_jobs(tmp_path, user_module, capsys):
    """Four runs in two worker processes equal the same runs one after the other; the study
    folder's index lists them and `compare` tables them with paired intervals."""
    assert _study(tmp_path, user_module, tmp_path / "s1", "--jobs", "1") == 0
    assert _study(tmp_path, user_module, tmp_path / "s2", "--jobs", "2") == 0
    index = json.loads((tmp_path / "s2" / "study.json").read_text())
    folders = [r["folder"] for r in index["runs"]]
    assert folders == ["method.split=output,seed=0", "method.split=output,seed=1",
                       "method.split=input,seed=0", "method.split=input,seed=1"]
    for f in folders:
        a = json.loads((tmp_path / "s1" / f / "metrics.json").read_text())
        b = json.loads((tmp_path / "s2" / f / "metrics.json").read_text())
        assert a["per_client_test_correct"] == b["per_client_test_correct"], f
        assert a["seed"] == int(f[-1])
        spec = json.loads((tmp_path / "s2" / f / "spec.json").read_text())
        assert spec["method"]["split"]["name"] == f.split("=")[1].split(",")[0]
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "s2")]) == 0
    text = (tmp_path / "s2" / "compare.md").read_text()
    assert "| ffgg-output | 0 1 |" in text and "paired difference vs ffgg-output" in text
    assert "| ffgg-input |" in text and "4 clients per seed, 2 seeds" in text
    assert (tmp_path / "s2" / "compare.png").stat().st_size > 0
    # the same numbers as partialfl.stats on the runs' counts
    from partialfl.stats import accuracy_interval

    runs = [json.loads((tmp_path / "s2" / f / "metrics.json").read_text()) for f in folders[2:]]
    iv = accuracy_interval([r["per_client_test_correct"] for r in runs],
                           [r["per_client_test_total"] for r in runs])
    assert f"{100 * iv.estimate:.2f} [{100 * iv.low:.2f}, {100 * iv.high:.2f}]" in text
    # run again: a finished study is refused; an interrupted one runs only what is missing
    capsys.readouterr()
    assert _study(tmp_path, user_module, tmp_path / "s1", "--jobs", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "s1" in err and "--overwrite" in err
    (tmp_path / "s1" / folders[1] / "report.md").unlink()
    assert _study(tmp_path, user_module, tmp_path / "s1", "--jobs", "1") == 0
    err = capsys.readouterr().err
    assert "3 of 4 runs finished already" in err and f"[{folders[1]}] done" in err
    assert f"[{folders[0]}]" not in err
    # runs of other clients cannot be paired: one line, exit 2
    other = client_folder(tmp_path / "other", clients=6, seed=1)
    cfg = tiny_toml(tmp_path / "o.toml", user_module, other)
    assert main(["train", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "s2" / folders[0]), str(tmp_path / "o"),
                 "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot pair" in err, err


def test_study_dry_run_lists_the_runs_and_bad_values_write_nothing(tmp_path, user_module,
                                                                   capsys):
    out = tmp_path / "s"
    assert _study(tmp_path, user_module, out, "--dry-run") == 0
    text = capsys.readouterr().out
    assert text.startswith("run        tiny") and "study      4 runs" in text
    assert f"{out / 'method.split=input,seed=1'}" in text and not out.exists()
    assert _study(tmp_path, user_module, out, "--sweep", "method.algorithm=ffgg,nosuch") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuch" in err and not out.exists()


def test_rerun_refuses_a_finished_run_and_overwrite_reruns(tmp_path, user_module, capsys):
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    out = tmp_path / "o"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    def results():
        m = json.loads((out / "metrics.json").read_text())
        return {k: v for k, v in m.items() if not k.endswith("seconds")}

    first = results()
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "--overwrite" in err
    (out / "metrics.json").write_text("{}")  # shows whether the run was redone
    assert main(["train", str(cfg), "--out", str(out), "--no-progress", "--overwrite"]) == 0
    assert results() == first
    # an unfinished run (no report yet) resumes without --overwrite
    (out / "report.md").unlink()
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert (out / "report.md").exists()


def test_plan_is_printed_before_training_and_heartbeat_without_bars(tmp_path, user_module,
                                                                    capsys, monkeypatch):
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    assert main(["train", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "[tiny] stage1: round 1 done" in err and "[tiny] stage2: round 1 done" in err
    import partialfl.pipeline.stages as stages

    def boom(*a, **k):
        raise ValueError("training failed")

    monkeypatch.setattr(stages, "run_pipeline", boom)
    assert main(["train", str(cfg), "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
    out = capsys.readouterr().out
    assert "run        tiny" in out and "algorithm  ffgg" in out  # printed before the failure


def test_per_round_training_loss_and_throughput_logged(tmp_path, user_module):
    """`stage*_train.jsonl`: one record per round with the cohort's mean reported
    `train_loss`, examples/s and rounds/s; TensorBoard holds the same values."""
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data, "tensorboard = true\n")
    out = tmp_path / "o"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    for f in (out / "stage1" / "stage1_train.jsonl", out / "stage2_train.jsonl"):
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        assert [r["round"] for r in recs] == [1, 2]
        for r in recs:
            assert r["clients"] == 3 and 0 < r["train_loss"] < 10
            assert r["examples_per_s"] == pytest.approx(r["examples"] / r["seconds"])
            assert r["rounds_per_s"] == pytest.approx(1 / r["seconds"])
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    got = {(e.step, round(e.value, 5)) for e in ev.Scalars("stage2/train_loss")}
    assert got == {(r["round"], round(r["train_loss"], 5)) for r in recs}


def test_train_record_is_the_mean_over_kept_clients():
    import numpy as np

    from partialfl.runtime.logging import train_record
    from partialfl.types import ClientUpdates

    class P:
        def num_examples(self, cohort):
            return np.asarray(cohort, float) * 10

    sent = ClientUpdates({}, np.ones(3), np.array([3, 1, 2]), 1,
                         metrics={"train_loss": np.array([1.0, 2.0, np.nan])})
    rec = train_record(5, sent, np.array([1, 3]), P(), 0.5)
    assert rec["train_loss"] == 1.5 and rec["examples"] == 40 and rec["clients"] == 2
    assert rec["examples_per_s"] == 80 and rec["rounds_per_s"] == 2 and rec["round"] == 5
    assert "train_loss" not in train_record(1, None, None, P(), 1.0)


def test_evaluate_a_train_run_and_new_data(tmp_path, user_module, capsys):
    """`evaluate` on a train run gives its new_clients.json; `--data` evaluates other
    clients; a study folder evaluates every run."""
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    out = tmp_path / "o"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    new = json.loads((out / "new_clients.json").read_text())
    capsys.readouterr()
    assert main(["evaluate", str(out), "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)["o"]
    assert got["test"]["accuracy"] == new["test_acc"]
    assert list(got["test"]["per_client"]) == new["client_ids"]
    more = client_folder(tmp_path / "more", clients=3, seed=7)
    assert main(["evaluate", str(out), "--data", str(more), "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)["o"]
    assert list(got["test"]["per_client"]) == ["user0", "user1", "user2"]


def test_evaluate_refuses_a_symlinked_deploy_file(tmp_path, user_module, capsys):
    """Issue 21: a symlinked deploy.safetensors (or run folder) in the evaluated folder would
    score a run outside it: refused with one line naming it."""
    data = client_folder(tmp_path / "clients")
    cfg = tiny_toml(tmp_path / "t.toml", user_module, data)
    real = tmp_path / "elsewhere"
    assert main(["train", str(cfg), "--out", str(real), "--no-progress"]) == 0
    table = tmp_path / "table"
    run = table / "seed0" / "m"
    run.mkdir(parents=True)
    for f in ("config.json", "spec.json"):
        (run / f).write_text((real / f).read_text())
    os.symlink(real / "deploy.safetensors", run / "deploy.safetensors")
    (table / "seed1").mkdir()
    os.symlink(real, table / "seed1" / "linked")
    from partialfl.io import UnsafeFileError
    from partialfl.pipeline.runs import find_runs

    for target in (table, run):  # find_runs itself refuses (the old one listed them)
        with pytest.raises(UnsafeFileError, match="symbolic link"):
            find_runs(target)
    capsys.readouterr()
    for target in (table, run):
        assert main(["evaluate", str(target), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "symbolic link" in err, err
    (run / "deploy.safetensors").unlink()
    (run / "deploy.safetensors").write_bytes((real / "deploy.safetensors").read_bytes())
    assert main(["evaluate", str(table), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "seed1/linked" in err and "symbolic link" in err


def test_the_comparison_plot_marks_a_group_with_a_diverged_run(tmp_path):
    """compare.md warned of a diverged run but compare.png drew it like any other group."""
    from partialfl.pipeline.compare import _plot
    from partialfl.stats import accuracy_interval

    iv = accuracy_interval([[8, 9, 7]], [[10, 10, 10]], seed=0)
    drawn = _plot(tmp_path / "c.png", {"Training clients": {"ffgg": iv, "fedavg": iv}},
                  {"fedavg"})
    assert drawn == ["ffgg", "fedavg (diverged)"]
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert _plot(tmp_path / "d.png", {"Training clients": {"ffgg": iv}}) == ["ffgg"]
