"""Command line and configuration: outputs, validation and error messages."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _summaries import check_standalone_summary

from partialfl.build import problem_of
from partialfl.cli import main
from partialfl.config import ConfigError, apply_overrides, from_dict
from partialfl.pipeline.closed_form import load_closed_form
from partialfl.spec import RunSpec, parse_lr


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("ls-tau", "ls-compare", "femnist-table", "async", "byzantine"):
        assert name in out


def test_unknown_reproduction_names_allowed(capsys):
    assert main(["reproduce", "figure-9"]) == 2
    err = capsys.readouterr().err
    assert "figure-9" in err and "ls-tau" in err


def test_reproduce_ls_tau_quick_writes_everything(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["reproduce", "ls-tau", "--quick", "--out", str(out), "--no-progress"]) == 0
    for f in ("summary.md", "ls_tau.png", "ffgg-tau1.jsonl", "ffgg-tau40.jsonl"):
        assert (out / f).stat().st_size > 0
    final = {}
    for tau in (1, 5, 40):
        lines = (out / f"ffgg-tau{tau}.jsonl").read_text().splitlines()
        final[tau] = json.loads(lines[-1])["rel_dist2"]
    assert max(final[5], final[40]) < final[1] / 100  # more local work, better
    text = (out / "summary.md").read_text()
    assert "| ffgg | 40 |" in text
    check_standalone_summary(text, quick=True)
    assert "| ‖θʳ−θ*‖²/‖θ⁰−θ*‖² |" in text  # the column says what the plot's axis says
    # the quick size's τ ≥ 10 solve d_w = 10 exactly: their curves coincide, and it says so
    assert "τ ∈ {10, 20, 30, 40}" in text or "τ ∈ {5, 10, 20, 30, 40}" in text
    # the paired comparison with τ = 1: one seed by default, so no interval, no verdict
    assert "orders of magnitude below τ = 1 [95% CI]" in text
    assert "| τ = 40 |" in text and "(one seed: no interval)" in text


def test_reproduce_ls_compare_quick(tmp_path):
    out = tmp_path / "c"
    assert main(["reproduce", "ls-compare", "--quick", "--seeds", "0", "1", "--out", str(out),
                 "--no-progress"]) == 0
    text = (out / "summary.md").read_text()
    for m in ("ffgg", "scaffold", "local-gd", "l2gd"):
        assert f"| {m} | 100 | 0 |" in text and f"| {m} | 100 | 1 |" in text  # τ, seed
    # two seeds: every baseline against FFGG with its t interval over the seeds (no verdict
    # at the quick size)
    assert "orders of magnitude below FFGG (same τ) [95% CI]" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| scaffold, τ = 100 |"))
    assert " [" in row.split(" | ")[2] and "– (quick run)" in row
    assert "over the 2 seeds" in text
    check_standalone_summary(text, quick=True)
    for f in ("ls_compare_rounds.png", "ls_compare_grads.png", "ls_compare_loss.png"):
        assert (out / f).stat().st_size > 0


def test_run_config_with_overrides(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nname = "least-squares"\nnum_clients = 4\nn = 30\n'
                   'd_theta = 5\nd_w = 2\n[method]\nalgorithm = "ffgg"\n'
                   '[personalize]\nrounds = 5\nclient = { name = "cg", tau = 2 }\n')
    import torch

    torch.set_num_threads(1)
    assert main(["run", str(cfg), "--set", "personalize.rounds=7", "--out", str(tmp_path),
                 "--no-progress", "--threads", "2"]) == 0
    recs = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert recs[-1]["round"] == 7
    assert torch.get_num_threads() == 2  # the run's threads, closed forms too
    torch.set_num_threads(1)


LS = {"name": "least-squares"}


@pytest.mark.parametrize("data,match", [
    ({"problem": {**LS, "nn": 3}}, "unknown key 'problem.nn' (did you mean 'n'?)"),
    ({"problem": LS, "personalize": {"client": {"name": "gd", "tua": 3}}},
     "unknown key 'personalize.client.tua' (did you mean 'tau'?); allowed keys in "
     "[personalize.client]"),
    ({"problem": LS, "method": {"algorithm": "scafold"}},
     "'scafold' is not allowed (did you mean 'scaffold'?)"),
    ({"problem": {**LS, "n": -4}}, "n must be a positive integer"),
    ({"problem": LS, "personalize": {"client": {"name": "gd", "tau": 0}}},
     "personalize.client"),
    ({"problem": LS, "personalize": {"client": {"name": "lbfgs"}}},
     "allowed: cg, exact, gd, sgd"),
    ({"problem": LS, "personalize": {"server": {"lr": -0.1}}}, "positive"),
    ({"problem": LS, "personalize": {"server": {"lr": "two/L"}}}, "c/L"),
    ({"problem": LS, "personalize": {"rounds": "many"}}, "expected an integer"),
    ({"problem": LS, "runs": {}}, "allowed keys"),
    ({"problem": {"name": "least-squares", "num_clients": 10 ** 6}}, "GiB"),
])
def test_config_errors_name_the_problem(data, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        problem_of(load_closed_form(data))


def test_too_many_sampled_clients(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nname = "least-squares"\nnum_clients = 4\nn = 30\n'
                   'd_theta = 5\nd_w = 2\n[personalize]\nrounds = 2\nclients_per_round = 9\n'
                   'client = { name = "cg", tau = 2 }\n')
    assert main(["run", str(cfg), "--out", str(tmp_path), "--no-progress"]) == 2
    assert "clients_per_round=9" in capsys.readouterr().err


def test_overrides_and_lr_parsing():
    d = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=\"x\"", "d.e=1e-3", "f=word"])
    assert d == {"a": {"b": 2, "c": "x"}, "d": {"e": 1e-3}, "f": "word"}
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["nokey"])
    assert parse_lr("1/L", 50.0) == 0.02 and parse_lr("0.5 / L", 10.0) == 0.05
    assert parse_lr(0.3, 1.0) == 0.3
    assert isinstance(from_dict(RunSpec, {}), RunSpec)


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "partialfl", "list"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "ls-tau" in r.stdout


def test_every_shipped_config_is_valid():
    from pathlib import Path

    from partialfl.config import load_toml

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.toml"))
    assert files, "no configs shipped"
    for f in files:
        cfg = load_closed_form({**load_toml(f), "name": f.stem})
        assert cfg.personalize.rounds > 0


# ----------------------------------------------------------------------- what a new user meets
def test_no_arguments_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: partialfl") and "reproduce" in out and "evaluate" in out


def test_version(capsys):
    from partialfl import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"partialfl {__version__}"


def test_reproduce_help_lists_every_name_and_says_what_quick_does(capsys):
    from partialfl.registry import names

    with pytest.raises(SystemExit) as e:
        main(["reproduce", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in names("reproduction"):
        assert f" {name} " in out
    assert "(what CI runs)" not in out
    assert "reduced size (fewer clients, rounds and seeds)" in out


def test_list_into_a_closed_pipe_has_no_traceback():
    # the reader is gone before partialfl writes (as with `partialfl list | head -0`)
    p = subprocess.Popen([sys.executable, "-m", "partialfl", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == ""


def test_list_head_two_lines_through_a_shell():
    r = subprocess.run(f"'{sys.executable}' -m partialfl list | head -2", shell=True,
                       capture_output=True, text=True, timeout=60)
    assert len(r.stdout.splitlines()) == 2 and r.stdout.startswith("async ")
    assert r.stderr == ""


def test_run_writes_plot_and_summary_like_a_reproduction(tmp_path, capsys):
    cfg = tmp_path / "small.toml"
    cfg.write_text('[problem]\nname = "least-squares"\nnum_clients = 4\nn = 30\nd_theta = 5\n'
                   'd_w = 2\n[method]\nalgorithm = "ffgg"\n[personalize]\nrounds = 20\n'
                   'eval_every = 10\nclient = { name = "cg", tau = 2 }\n')
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert (out / "small.png").stat().st_size > 1000
    text = (out / "summary.md").read_text()
    last = json.loads((out / "small.jsonl").read_text().splitlines()[-1])
    assert text.startswith("# small: ffgg on least-squares")
    assert f"| ffgg | 2 | 20 | {last['rel_dist2']:.3e} |" in text
    # the configuration as run is in the summary, and parses back to the same config
    import tomllib

    toml = text.split("```toml\n", 1)[1].split("```", 1)[0]
    assert load_closed_form(tomllib.loads(toml)) == load_closed_form(
        {**tomllib.loads(cfg.read_text()), "name": "small"})
    assert "small.png" in capsys.readouterr().out


def test_run_shows_progress_while_building_the_problem(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[problem]\nname = "least-squares"\nnum_clients = 3\nn = 30\nd_theta = 5\n'
                   'd_w = 2\n[personalize]\nrounds = 2\nclient = { name = "cg", tau = 2 }\n')
    r = subprocess.run([sys.executable, "-m", "partialfl", "run", str(cfg), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "building the problem (3 clients × 30 rows)" in r.stderr


def test_evaluate_names_what_to_pass_for_a_folder_without_runs(tmp_path, capsys):
    (tmp_path / "seed0").mkdir()
    assert main(["evaluate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no finished run" in err and "seed0" in err and "runs/femnist-table" in err
    (tmp_path / "seed0" / "config.json").write_text("{}")
    assert main(["evaluate", str(tmp_path / "seed0")]) == 2
    assert "has not finished" in capsys.readouterr().err


def test_evaluate_finds_every_run_of_a_table_folder(tmp_path):
    from partialfl.pipeline.runs import find_runs

    for run in ("seed0/fedavg", "seed0/ffgg-output", "seed1/fedavg", "stage1"):
        (tmp_path / run).mkdir(parents=True)
    for run in ("seed0/fedavg", "seed0/ffgg-output", "seed1/fedavg"):
        (tmp_path / run / "deploy.safetensors").write_bytes(b"")
    assert find_runs(tmp_path) == [tmp_path / "seed0" / "fedavg",
                                   tmp_path / "seed0" / "ffgg-output",
                                   tmp_path / "seed1" / "fedavg"]
    assert find_runs(tmp_path / "seed1" / "fedavg") == [tmp_path / "seed1" / "fedavg"]


def _fake_evaluation(accs, total=10.0):
    import numpy as np

    from partialfl.pipeline.evaluation import Evaluation

    accs = np.asarray(accs, float)
    return Evaluation(accuracy=float(accs.mean()), per_client=accs, p10=float(accs.min()),
                      p50=float(np.median(accs)), p90=float(accs.max()),
                      mean_client=float(accs.mean()), loss=0.5, total=total)


def test_evaluation_table_and_json_carry_client_ids():
    from partialfl.pipeline.runs import evaluation_table, to_json

    res = {f"seed0/{m}": {"test": _fake_evaluation(accs), "before": _fake_evaluation([0.1, 0.2]),
                          "train": _fake_evaluation([0.9, 1.0]), "num_clients": 2,
                          "split": "output", "client_ids": ["f0001_23", "f0042_07"]}
           for m, accs in (("fedavg", [0.5, 0.75]), ("ffgg-output", [0.25, 1.0]))}
    text = evaluation_table(res)
    assert "| seed0/fedavg | 2 | 15.00 | 62.50 | 50.00 / 62.50 / 75.00 | 62.50 |" in text
    assert "| client | seed0/fedavg | seed0/ffgg-output |" in text
    assert "| f0042_07 | 75.00 | 100.00 |" in text
    js = json.loads(to_json(res))
    assert js["seed0/ffgg-output"]["test"]["per_client"] == {"f0001_23": 0.25, "f0042_07": 1.0}
    assert js["seed0/fedavg"]["before"]["accuracy"] == pytest.approx(0.15)
    many = {f"run{i}": res["seed0/fedavg"] for i in range(5)}
    assert "`--json`" in evaluation_table(many) and "| client |" not in evaluation_table(many)
def test_folds_only_where_a_reproduction_has_k_fold(tmp_path, capsys):
    assert main(["reproduce", "ls-tau", "--quick", "--folds", "3", "--out",
                 str(tmp_path)]) == 2
    assert "--folds: reproduction 'ls-tau' has no k-fold evaluation" in capsys.readouterr().err
    assert main(["reproduce", "femnist-kfold", "--folds", "1", "--out", str(tmp_path)]) == 2
    assert "--folds must be >= 2, got 1" in capsys.readouterr().err
    assert "femnist-kfold" in {line.split()[0] for line in _listed(capsys)}


def _listed(capsys):
    main(["list"])
    return capsys.readouterr().out.splitlines()


def test_evaluate_runs_at_the_runs_thread_count_and_repeats_its_numbers(tmp_path, data_dir,
                                                                       capsys):
    """`partialfl evaluate RUN` fine-tunes the new clients again on the run's own torch
    thread count (spec ``threads``), whatever the process had: its new-client test loss is
    the run's, to the last bit."""
    from pathlib import Path

    import torch

    quick = Path(__file__).resolve().parents[1] / "configs" / "train" / "quickstart.toml"
    sets = ["data.num_clients=5", "data.holdout=1", "pretrain.rounds=1", "personalize.rounds=1",
            "pretrain.clients_per_round=2", "personalize.clients_per_round=2",
            "finetune.epochs=1", f"data.path={data_dir}"]
    run = tmp_path / "r"
    assert main(["train", str(quick), "--out", str(run), "--no-progress",
                 *[a for s in sets for a in ("--set", s)]]) == 0
    torch.set_num_threads(2)
    capsys.readouterr()
    assert main(["evaluate", str(run), "--json", "-"]) == 0
    assert torch.get_num_threads() == 1
    got = json.loads(capsys.readouterr().out)["r"]["test"]
    want = json.loads((run / "new_clients.json").read_text())
    assert got["loss"] == want["test_loss"] and got["accuracy"] == want["test_acc"]
