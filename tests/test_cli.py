"""Command line and configuration: outputs, validation and error messages."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from partialfl.cli import main
from partialfl.config import ConfigError, apply_overrides, from_dict
from partialfl.experiments.closed_form import ClosedFormConfig, load_closed_form, parse_lr


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
    assert "| ffgg | 40 |" in (out / "summary.md").read_text()


def test_reproduce_ls_compare_quick(tmp_path):
    out = tmp_path / "c"
    assert main(["reproduce", "ls-compare", "--quick", "--out", str(out), "--no-progress"]) == 0
    text = (out / "summary.md").read_text()
    for m in ("ffgg", "scaffold", "local-gd", "l2gd"):
        assert f"| {m} | 100 |" in text
    for f in ("ls_compare_rounds.png", "ls_compare_grads.png", "ls_compare_loss.png"):
        assert (out / f).stat().st_size > 0


def test_run_config_with_overrides(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nnum_clients = 4\nn = 30\nd_theta = 5\nd_w = 2\n'
                   '[algorithm]\nname = "ffgg"\nsolver = "cg"\ntau = 2\n[run]\nrounds = 5\n')
    assert main(["run", str(cfg), "--set", "run.rounds=7", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    recs = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert recs[-1]["round"] == 7


@pytest.mark.parametrize("data,match", [
    ({"problem": {"nn": 3}}, "unknown key 'problem.nn' (did you mean 'n'?)"),
    ({"algorithm": {"tua": 3}}, "unknown key 'algorithm.tua' (did you mean 'tau'?); allowed "
                                "keys in [algorithm]"),
    ({"algorithm": {"name": "scafold"}}, "'scafold' is not allowed (did you mean 'scaffold'?)"),
    ({"problem": {"n": -4}}, "n must be a positive integer"),
    ({"algorithm": {"tau": 0}}, "algorithm.tau"),
    ({"algorithm": {"name": "fedprox"}}, "allowed: ffgg, local-gd, scaffold, l2gd"),
    ({"algorithm": {"solver": "lbfgs"}}, "allowed: gd, cg, exact"),
    ({"server": {"lr": -0.1}}, "positive"),
    ({"server": {"lr": "two/L"}}, "c/L"),
    ({"run": {"rounds": "many"}}, "expected an integer"),
    ({"runs": {}}, "allowed keys"),
])
def test_config_errors_name_the_problem(data, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        cfg = load_closed_form(data)
        from partialfl.experiments.closed_form import build_problem, problem_config_for

        build_problem(problem_config_for(cfg))


def test_too_many_sampled_clients(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nnum_clients = 4\nn = 30\nd_theta = 5\nd_w = 2\n'
                   '[run]\nrounds = 2\nclients_per_round = 9\n')
    assert main(["run", str(cfg), "--out", str(tmp_path), "--no-progress"]) == 2
    assert "clients_per_round=9" in capsys.readouterr().err


def test_overrides_and_lr_parsing():
    d = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=\"x\"", "d.e=1e-3", "f=word"])
    assert d == {"a": {"b": 2, "c": "x"}, "d": {"e": 1e-3}, "f": "word"}
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["nokey"])
    assert parse_lr("1/L", 50.0) == 0.02 and parse_lr("0.5 / L", 10.0) == 0.05
    assert parse_lr(0.3, 1.0) == 0.3
    assert isinstance(from_dict(ClosedFormConfig, {}), ClosedFormConfig)


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
        assert cfg.run.rounds > 0
