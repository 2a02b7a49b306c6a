"""`partialfl train --engine flower-sim|flower`: a train spec on the Flower app."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partialfl.pipeline.train import load_run_spec as load_train_spec

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "train" / "quickstart.toml"
TINY = ["data.num_clients=5", "data.holdout=1", "pretrain.rounds=2", "personalize.rounds=2",
        "pretrain.clients_per_round=3", "personalize.clients_per_round=3", "finetune.epochs=1",
        "logging.progress=false"]


def _spec(data_dir, extra=()):
    return load_train_spec(QUICKSTART, [*TINY, f"data.path={data_dir}", *extra])


def test_run_config_carries_the_spec_and_derives_the_stage_keys(data_dir):
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.models import train_spec
    from partialfl.flower.train import spec_run_config

    spec = _spec(data_dir)
    for stage, rounds, seed in (("pretrain", 2, spec.stage1_seed),
                                ("personalize", 2, spec.seed)):
        cfg = parse_run_config(spec_run_config(spec, stage, "x.npz"))
        assert (cfg.problem, cfg.train_stage, cfg.num_rounds, cfg.seed) == (
            "train", stage, rounds, seed)
        assert cfg.clients_per_round == 3
        back = train_spec(cfg)
        assert back.pipeline_config() == spec.pipeline_config()
        assert Path(back.data.path).is_absolute()


def test_train_spec_needs_problem_train():
    from partialfl.flower.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match="train-spec"):
        parse_run_config({"train-spec": "{}", "local-lr": 0.1, "problem": "femnist"})
    with pytest.raises(ConfigError, match="train-spec"):
        parse_run_config({"problem": "train"})


def test_node_builds_the_pipelines_stage(data_dir):
    """A SuperNode's problem and algorithm for the spec give the in-process client update."""
    import torch

    from partialfl.algorithms.base import RoundContext
    from partialfl.build import build
    from partialfl.flower.builders import build_algorithm, build_problem
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.train import spec_run_config
    from partialfl.pipeline.stages import stage1_setup

    spec = _spec(data_dir)
    cfg = parse_run_config(spec_run_config(spec, "pretrain"))
    problem, alg = build_problem(cfg), build_algorithm(cfg, None, num_clients=4)
    run = build(spec)
    ref_problem, ref_alg = stage1_setup(run.pipeline, run.task)
    theta = ref_problem.init_theta()
    for a, b in zip(theta.values(), problem.init_theta().values()):
        assert torch.equal(a, b)
    cohort = np.array([0, 2])
    ctx = RoundContext(spec.stage1_seed, 0)
    u1 = alg.client_update(alg.init(problem, theta), problem, cohort, ctx).updates
    u2 = ref_alg.client_update(ref_alg.init(ref_problem, theta), ref_problem, cohort,
                               ctx).updates
    assert sorted(u1.vectors) == sorted(theta) and len(u1.vectors) > 0
    for n in u1.vectors:
        assert torch.equal(u1.vectors[n], u2.vectors[n]), n
    assert float(sum(v.abs().sum() for v in u1.vectors.values())) > 0


@pytest.mark.slow
@pytest.mark.data
def test_quickstart_in_flower_simulation_gives_the_in_process_theta(tmp_path, data_dir):
    """configs/train/quickstart.toml at a tiny size: θ after pre-training and after
    personalization in Flower's simulation engine equals the in-process run's (1e-6)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs 'flwr[simulation]'")
    from partialfl.flower.train import run_flower_train
    from partialfl.pipeline.train import run_train

    spec = _spec(data_dir)
    _, local = run_train(spec, tmp_path / "local", progress=False)
    msg = run_flower_train(spec, tmp_path / "sim", engine="flower-sim", timeout=600)
    assert "flower-sim" in msg
    from partialfl import io as pio

    t1 = pio.load_tensors(tmp_path / "local" / "stage1" / "theta.safetensors", "θ1")[0]
    t2 = pio.load_tensors(tmp_path / "local" / "theta_stage2.safetensors", "θ2")[0]
    with np.load(tmp_path / "sim" / "stage1" / "theta.npz") as z:
        assert sorted(z.files) == sorted(t1)
        for n in t1:
            np.testing.assert_allclose(z[n], t1[n].numpy(), rtol=0, atol=1e-6)
    with np.load(tmp_path / "sim" / "flower" / "theta.npz") as z:
        assert sorted(z.files) == sorted(t2)
        for n in t2:
            np.testing.assert_allclose(z[n], t2[n].numpy(), rtol=0, atol=1e-6)
    sim = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    assert abs(sim["test_acc"] - local["test_acc"]) < 1e-9 + 2 / 300
    assert (tmp_path / "sim" / "report.md").exists()


def test_engine_dry_run_prints_the_plan_and_the_run_config(data_dir, tmp_path, capsys):
    from partialfl.cli import main

    out = tmp_path / "never"
    sets = [a for o in TINY for a in ("--set", o)]
    assert main(["train", str(QUICKSTART), "--engine", "flower-sim", "--dry-run", "--out",
                 str(out), "--set", f"data.path={data_dir}", *sets]) == 0
    text = capsys.readouterr().out
    assert "engine     flower-sim (2 SuperNodes)" in text and '"problem": "train"' in text
    assert '"num-rounds": 2' in text and not out.exists()
    assert main(["train", str(QUICKSTART), "--engine", "flower-sim", "--out", str(out),
                 "--set", "method.algorithm=nope"]) == 2
    assert not out.exists()


def _flwr_binaries() -> list[str]:
    import shutil
    import sys

    bindir = Path(sys.executable).parent
    return [b for b in ("flwr", "flower-superlink", "flower-supernode")
            if not (bindir / b).exists() and shutil.which(b) is None]


@pytest.mark.slow  # a few minutes: real SuperLink and SuperNode processes, two `flwr run`s
@pytest.mark.data
def test_train_on_a_running_deployment_gives_the_in_process_theta(tmp_path, data_dir):
    """`partialfl train --engine flower --superlink HOST:PORT` against a SuperLink and two
    SuperNodes started beforehand (insecure, loopback, free ports): it starts no process of
    its own, the run completes, writes its metrics, and θ after pre-training and
    personalization (2 + 2 rounds) equals the in-process run's (1e-6)."""
    missing = _flwr_binaries()
    if missing:
        pytest.skip(f"Flower's command-line tools are not installed: {', '.join(missing)}")
    from partialfl import io as pio
    from partialfl.cli import main
    from partialfl.flower.project import LocalFederation
    from partialfl.pipeline.train import run_train

    spec = _spec(data_dir)
    _, local = run_train(spec, tmp_path / "local", progress=False)
    out = tmp_path / "deployed"
    sets = [a for o in [*TINY, f"data.path={data_dir}"] for a in ("--set", o)]
    deployment = LocalFederation(2)  # flower-superlink + 2 flower-supernode processes
    try:
        deployment.start()
        started = len(deployment.procs)
        rc = main(["train", str(QUICKSTART), "--engine", "flower", "--superlink",
                   f"127.0.0.1:{deployment.port}", "--out", str(out), "--no-progress", *sets])
        assert len(deployment.procs) == started == 3  # the run started nothing
        assert rc == 0, deployment.log_tail("superlink")
    finally:
        deployment.close()
    assert deployment.alive_groups() == []
    for sim_file, local_file in ((out / "stage1" / "theta.npz",
                                  tmp_path / "local" / "stage1" / "theta.safetensors"),
                                 (out / "flower" / "theta.npz",
                                  tmp_path / "local" / "theta_stage2.safetensors")):
        ref = pio.load_tensors(local_file, "θ")[0]
        with np.load(sim_file) as z:
            assert sorted(z.files) == sorted(ref)
            for n in ref:
                assert np.isfinite(z[n]).all(), n
                np.testing.assert_allclose(z[n], ref[n].numpy(), rtol=0, atol=1e-6)
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(metrics["test_acc"]) and 0 <= metrics["test_acc"] <= 1
    assert abs(metrics["test_acc"] - local["test_acc"]) < 1e-9 + 2 / 300
    rounds = [json.loads(line)["round"] for line in
              (out / "stage2.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2]
    assert (out / "report.md").exists()


@pytest.mark.parametrize("args, message", [
    (["--superlink", "127.0.0.1:9093"], "--superlink / --root-certificates need --engine flower"),
    (["--engine", "flower-sim", "--superlink", "127.0.0.1:9093"],
     "apply to engine 'flower' (a deployment), not 'flower-sim'"),
    (["--engine", "flower", "--superlink", "localhost"], "'localhost' is not HOST:PORT"),
    (["--engine", "flower", "--root-certificates", "ca.pem"], "needs --superlink HOST:PORT"),
    (["--engine", "flower", "--supernodes", "0"], "--supernodes must be >= 1, got 0"),
])
def test_deployment_options_are_checked_before_anything_runs(data_dir, tmp_path, capsys,
                                                             args, message):
    from partialfl.cli import main

    out = tmp_path / "never"
    assert main(["train", str(QUICKSTART), "--out", str(out), "--set",
                 f"data.path={data_dir}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_an_unreachable_superlink_is_a_one_line_error_and_writes_nothing(tmp_path):
    from partialfl.flower.project import SuperLinkConnection, free_port

    port = free_port()  # nothing listens there
    conn = SuperLinkConnection(f"127.0.0.1:{port}", 2, work_dir=tmp_path / "w",
                               startup_timeout=0.3)
    with pytest.raises(ConnectionError, match=f"no SuperLink answers at 127.0.0.1:{port}"):
        conn.start()
    assert conn.procs == [] and not (tmp_path / "w" / "flwr-home" / "config.toml").exists()


def test_flower_engines_without_flower_are_one_line_errors(data_dir, tmp_path, capsys,
                                                           monkeypatch):
    """Issue 21: `--engine flower-sim` without flwr (or without its simulation engine, Ray)
    is one line and exit 2 — before any Flower process is started or anything is written."""
    import subprocess
    import sys

    from partialfl import cli

    def no_process(*args, **kw):
        raise AssertionError(f"a process was started: {args[0] if args else kw}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of it fails, as if missing
    out = tmp_path / "run"
    argv = ["train", str(QUICKSTART), "--set", f"data.path={data_dir}", "--out", str(out)]
    rc = cli.main([*argv, "--engine", "flower-sim"])  # flwr present, Ray missing
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "simulation engine (Ray)" in err
    monkeypatch.setitem(sys.modules, "flwr", None)
    for engine in ("flower-sim", "flower"):
        rc = cli.main([*argv, "--engine", engine])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith("partialfl: error: the Flower engines need Flower: pip install")
    assert not out.exists()
