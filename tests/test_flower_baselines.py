"""FedProx and APFL on Flower (issue 26: each baseline runnable from TOML, CLI and Flower).

FedProx is stateless: a SuperNode builds the spec's FedProx exactly as the pipeline does (the
same client update) and `partialfl train --engine flower-sim` gives the in-process θ after
each stage (1e-6). APFL keeps v_m and α_m on each client between rounds and a SuperNode keeps
no client state, so it — like every algorithm with client state — is refused with one line
before Flower starts (and by a ClientApp), naming why and what to use instead."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from _flower_sims import ls_run
from test_flower_train import QUICKSTART, TINY, assert_same_run

from partialfl.pipeline.train import load_run_spec

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

FEDPROX = ["method.algorithm=fedprox", "method.split=none", "method.mu=0.1"]
APFL = ["method.algorithm=apfl", "method.split=none", "method.alpha=0.25"]


def _sets(*groups) -> list[str]:
    return [a for g in groups for o in g for a in ("--set", o)]


def test_a_supernode_builds_the_pipelines_fedprox(data_dir):
    """A SuperNode's stage-2 FedProx (from the spec alone) gives the in-process client update
    bit for bit, and the proximal term acts (μ = 0.1 differs from FedAvg's μ = 0)."""
    import torch

    from partialfl.algorithms.base import RoundContext
    from partialfl.build import build
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.stage import node_parts
    from partialfl.flower.train import stage_run_config
    from partialfl.pipeline.stages import stage2_setup

    spec = load_run_spec(QUICKSTART, [*TINY, f"data.path={data_dir}", *FEDPROX])
    problem, alg, theta = node_parts(parse_run_config(stage_run_config(spec, "personalize")))
    run = build(spec)
    theta1 = {n: p.detach().clone() for n, p in
              run.task.model_fn(spec.stage1_seed).named_parameters()}
    _, ref_problem, ref_alg, ref_theta = stage2_setup(spec.effective(), run.task, theta1)
    assert type(alg).__name__ == type(ref_alg).__name__ == "FedProx" and alg.mu == 0.1
    cohort, ctx = np.array([0, 2]), RoundContext(spec.seed, 1)
    u1 = alg.client_update(alg.init(problem, theta), problem, cohort, ctx).updates
    u2 = ref_alg.client_update(ref_alg.init(ref_problem, ref_theta), ref_problem, cohort,
                               ctx).updates
    assert sorted(u1.vectors) == sorted(ref_theta) and len(u1.vectors) > 0
    for n in u1.vectors:
        assert torch.equal(u1.vectors[n], u2.vectors[n]), n
    alg.mu = 0.0  # FedAvg: the update changes
    u0 = alg.client_update(alg.init(problem, theta), problem, cohort, ctx).updates
    assert any(not torch.equal(u0.vectors[n], u1.vectors[n]) for n in u1.vectors)


@pytest.mark.slow  # ~1 min: two `flwr run`s on the simulation engine, then stage 3
def test_fedprox_train_on_flower_sim_is_the_in_process_run(data_dir, tmp_path):
    """`partialfl train --engine flower-sim` with FedProx: θ after stage 1 (FedAvg) and
    stage 2 (FedProx, μ = 0.1) equal `partialfl train`'s to 1e-6, with the same files and
    metrics."""
    import json

    pytest.importorskip("ray", reason="Flower's simulation engine needs 'flwr[simulation]'")
    from partialfl.cli import main

    argv = ["train", str(QUICKSTART), *_sets(TINY, FEDPROX, [f"data.path={data_dir}"])]
    assert main([*argv, "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--engine", "flower-sim", "--out", str(tmp_path / "sim")]) == 0
    local = json.loads((tmp_path / "local" / "metrics.json").read_text())
    assert_same_run(tmp_path / "sim", tmp_path / "local", local)
    rec = json.loads((tmp_path / "sim" / "flower" / "result.json").read_text())
    assert rec["config"]["spec"]["method"]["algorithm"] == "fedprox"
    assert rec["config"]["spec"]["method"]["mu"] == 0.1


def _no_process(monkeypatch):
    def refuse(*args, **kw):
        raise AssertionError(f"a process was started: {args[0] if args else kw}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_apfl_is_refused_on_flower_in_one_line(data_dir, tmp_path, capsys, monkeypatch):
    """APFL from TOML runs in process (tests/test_fedprox_apfl.py); on Flower it is refused
    before anything starts: exit 2, one line naming its client state and what to do."""
    from partialfl.cli import main

    _no_process(monkeypatch)
    out = tmp_path / "never"
    rc = main(["train", str(QUICKSTART), *_sets(TINY, APFL, [f"data.path={data_dir}"]),
               "--engine", "flower-sim", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "apfl keeps per-client state between rounds (APFL's v_m and α_m" in err
    assert "a Flower SuperNode keeps none: run it in process (no --engine)" in err
    assert not out.exists()


def test_a_stateful_closed_form_is_refused_by_the_cli_and_by_the_clientapps(
        loopback, tmp_path, capsys, monkeypatch):
    """Scaffold (c_m per client) on least squares: `partialfl run --engine flower-sim`
    refuses it before Flower starts; a ServerApp started anyway gets every ClientApp's
    refusal, in one line."""
    from partialfl.cli import main
    from partialfl.flower.server import run_server

    run = ls_run(2, node_wait_timeout=0.5,  # (the server waits this long for other nodes)
                 spec={"method": {"algorithm": "scaffold"},
                       "personalize": {"client": {"name": "gd", "tau": 3}}})
    with pytest.raises(RuntimeError) as e:
        run_server(loopback(2), run)
    assert "\n" not in str(e.value)
    assert "'scaffold' keeps per-client state between rounds" in str(e.value)
    cfg = tmp_path / "scaffold.toml"
    cfg.write_text('[problem]\nname = "least-squares"\nnum_clients = 8\n[method]\n'
                   'algorithm = "scaffold"\n[personalize]\nrounds = 2\n'
                   'client = { name = "gd", tau = 3 }\n')
    _no_process(monkeypatch)
    rc = main(["run", str(cfg), "--engine", "flower-sim", "--out", str(tmp_path / "o"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "scaffold keeps per-client state" in err
    assert not Path(tmp_path / "o").exists()
