"""Issue 26's "add a component" check: a toy algorithm (one option) and a toy aggregation
rule, registered by a module in the test folder without editing ``src/``, run by name
through ``partialfl run`` on least squares (synchronous, asynchronous and on Flower's
simulation engine) and ``partialfl train`` on a model, each equal to the Python-API run of the
same objects."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data
from toy_plugin import DropLargest, Toy

from partialfl.cli import main
from partialfl.config import toml_text
from partialfl.metrics import closed_form_metrics
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds
from partialfl.runtime.asynchronous import ComputeTimeModel, Distribution, run_async
from partialfl.server import SGD

LS = LeastSquaresSpec(num_clients=6, n=40, d_theta=5, d_w=3, seed=2)
ARCH_DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _doc_block(lang: str) -> str:
    """The worked example's ``lang`` code block in docs/architecture.md (the doc shows what
    these tests run)."""
    text = ARCH_DOC.read_text().split("### Worked example", 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", text, flags=re.S).group(1)


TOML = _doc_block("toml")


def test_the_docs_worked_example_is_this_plugin_and_this_problem():
    """docs/architecture.md shows tests/toy_plugin.py verbatim, and its spec is the problem
    the Python-API runs below use."""
    assert _doc_block("python") == (Path(__file__).parent / "toy_plugin.py").read_text()
    import tomllib

    problem = tomllib.loads(TOML)["problem"]
    assert {k: problem[k] for k in ("num_clients", "n", "d_theta", "d_w", "seed")} == {
        "num_clients": LS.num_clients, "n": LS.n, "d_theta": LS.d_theta, "d_w": LS.d_w,
        "seed": LS.seed}


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _python_api(asynchronous: bool):
    p = LeastSquaresProblem(LS, basis="standard")
    alg = Toy(4, 0.01, SGD(0.02), DropLargest(1))
    if asynchronous:
        return run_async(p, alg, steps=6, concurrency=2, seed=1, evaluate=closed_form_metrics,
                         eval_every=3, compute_time=ComputeTimeModel(
                             Distribution("exponential", 1.0))).history
    return run_rounds(p, alg, 6, clients_per_round=4, seed=1, evaluate=closed_form_metrics,
                      eval_every=3).history


@pytest.mark.parametrize("asynchronous", [False, True])
def test_run_by_name_equals_the_python_api(tmp_path, asynchronous):
    cfg = tmp_path / "toy.toml"
    text = TOML
    if asynchronous:
        text = text.replace("[aggregation]", "[asynchronous]\nrule = { name = \"fedasync\", "
                            "staleness = \"constant\" }\nconcurrency = 2\n[aggregation]")
    cfg.write_text(text)
    assert main(["run", str(cfg), "--allow-code", "--no-progress", "--out",
                 str(tmp_path / "o")]) == 0
    got = _lines(tmp_path / "o" / "toy.jsonl")
    ref = _python_api(asynchronous)
    assert [r["round"] for r in got] == [r["round"] for r in ref]
    for a, b in zip(got, ref):
        assert a["rel_dist2"] == b["rel_dist2"] and a["grad_evals"] == b["grad_evals"]
    assert got[-1]["rel_dist2"] < got[0]["rel_dist2"]


def test_without_allow_code_the_plugin_is_refused(tmp_path, capsys):
    cfg = tmp_path / "toy.toml"
    cfg.write_text(TOML)
    assert main(["run", str(cfg), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "--allow-code" in capsys.readouterr().err


def test_train_by_name_equals_the_python_api(tmp_path, monkeypatch):
    """``partialfl train`` with the toy and the toy rule on a CNN equals
    :func:`partialfl.pipeline.train.train` with the same spec tables."""
    from partialfl.pipeline.train import train

    data = toy_data(6)
    folder = tmp_path / "clients"
    folder.mkdir()
    for m in range(data.num_clients):
        np.savez(folder / f"c{m}.npz", train_x=data.train_x[m].numpy(),
                 train_y=data.train_y[m].numpy(), test_x=data.test_x[m].numpy(),
                 test_y=data.test_y[m].numpy())
    (tmp_path / "toymodels.py").write_text(
        "from _nn_toy import toy_model\n\ndef net(num_classes=5):\n    return toy_model(0)\n")
    tables = {"method": {"algorithm": "toy", "split": "output", "steps": 2, "lr": 0.05},
              "aggregation": {"name": "drop-largest"},
              "pretrain": {"rounds": 2, "clients_per_round": 4},
              "personalize": {"rounds": 2, "clients_per_round": 4,
                              "server": {"lr": 0.1}},
              "finetune": {"epochs": 1, "lr": 0.05}, "logging": {"progress": False}}
    cfg = tmp_path / "train.toml"
    cfg.write_text(toml_text({"plugins": ["toy_plugin"], "model": {"name": "toymodels:net"},
                              "data": {"source": "folder", "path": str(folder),
                                       "options": {"num_classes": 5}}, **tables}))
    monkeypatch.syspath_prepend(str(tmp_path))
    with one_thread():
        assert main(["train", str(cfg), "--allow-code", "--no-progress", "--out",
                     str(tmp_path / "cli")]) == 0
        from toymodels import net

        ref = train(lambda seed: net(), data, tmp_path / "api", plugins=["toy_plugin"],
                    **tables)
    got = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert got["test_acc"] == ref["test_acc"]
    assert got["per_client_test_acc"] == ref["per_client_test_acc"]
    assert torch.isfinite(torch.tensor(got["test_acc"]))


@pytest.mark.slow
def test_run_by_name_on_the_flower_simulation_engine(tmp_path, monkeypatch):
    """The same spec with ``--engine flower-sim``: the ServerApp and the ClientApps load the
    plugin (the nodes are this machine's, allowed by ``--allow-code``) and build the toy and
    the toy rule by name; θ's metrics equal the Python-API run to float rounding."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = tmp_path / "toy.toml"
    cfg.write_text(TOML)
    assert main(["run", str(cfg), "--allow-code", "--no-progress", "--engine", "flower-sim",
                 "--out", str(tmp_path / "o")]) == 0
    got = _lines(tmp_path / "o" / "toy.jsonl")
    ref = _python_api(False)
    assert [r["round"] for r in got] == [r["round"] for r in ref]
    for a, b in zip(got, ref):
        assert a["rel_dist2"] == pytest.approx(b["rel_dist2"], rel=1e-6, abs=1e-12)
    assert got[-1]["rel_dist2"] < got[0]["rel_dist2"]
