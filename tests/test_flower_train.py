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


def assert_same_run(flower_dir: Path, local_dir: Path, local_metrics: dict) -> None:
    """A Flower run's folder against the in-process run's: θ after each stage (1e-6), the
    same files (plus the ServerApp's own), the same stage-3 metrics."""
    from partialfl import io as pio

    for name in ("stage1/theta.safetensors", "theta_stage2.safetensors"):
        ref = pio.load_tensors(local_dir / name, name)[0]
        got = pio.load_tensors(flower_dir / name, name)[0]
        assert sorted(got) == sorted(ref)
        for n in ref:
            assert np.isfinite(got[n].numpy()).all(), n
            np.testing.assert_allclose(got[n].numpy(), ref[n].numpy(), rtol=0, atol=1e-6)
    # the per-round training logs (loss, throughput) are the in-process loop's; a Flower run's
    # per-round records are the ServerApp's, in flower/ (metrics.jsonl)
    files = {p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*")
             if not p.name.endswith(".ckpt") and ".ckpt" not in p.as_posix()
             and not p.name.endswith("_train.jsonl")}
    have = {p.relative_to(flower_dir).as_posix() for p in flower_dir.rglob("*")}
    assert files <= have, sorted(files - have)
    got = json.loads((flower_dir / "metrics.json").read_text())
    assert abs(got["test_acc"] - local_metrics["test_acc"]) < 1e-9 + 2 / 300
    rounds = [json.loads(line)["round"] for line in
              (flower_dir / "stage2.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2]


def test_run_config_carries_the_spec_and_the_stage(data_dir):
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.train import stage_run_config

    spec = _spec(data_dir)
    for stage, rounds, seed in (("pretrain", 2, spec.stage1_seed),
                                ("personalize", 2, spec.seed)):
        cfg = parse_run_config(stage_run_config(spec, stage, "x.npz" if stage ==
                                                "personalize" else None))
        assert (cfg.stage, cfg.rounds, cfg.seed, cfg.clients_per_round) == (stage, rounds,
                                                                             seed, 3)
        assert cfg.run.method == spec.method and cfg.run.personalize == spec.personalize
        assert Path(cfg.run.data.path).is_absolute()


def test_node_builds_the_pipelines_stage(data_dir):
    """A SuperNode's problem and algorithm for the spec give the in-process client update."""
    import torch

    from partialfl.algorithms.base import RoundContext
    from partialfl.build import build
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.stage import node_parts, server_parts
    from partialfl.flower.train import stage_run_config
    from partialfl.pipeline.stages import stage1_setup

    spec = _spec(data_dir)
    cfg = parse_run_config(stage_run_config(spec, "pretrain"))
    problem, alg, theta = node_parts(cfg)
    _, server_alg = server_parts(cfg, problem.num_clients)
    run = build(spec)
    ref_problem, ref_alg = stage1_setup(spec.effective(), run.task)
    for a, b in zip(ref_problem.init_theta().values(), theta.values()):
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
    assert type(server_alg) is type(ref_alg)


def test_engine_dry_run_prints_the_plan_and_the_run_config(data_dir, tmp_path, capsys):
    from partialfl.cli import main

    out = tmp_path / "never"
    sets = [a for o in TINY for a in ("--set", o)]
    assert main(["train", str(QUICKSTART), "--engine", "flower-sim", "--dry-run", "--out",
                 str(out), "--set", f"data.path={data_dir}", *sets]) == 0
    text = capsys.readouterr().out
    assert "engine     flower-sim (2 SuperNodes)" in text and '"stage": "personalize"' in text
    assert '"init-from": "STAGE1.npz"' in text and not out.exists()
    assert main(["train", str(QUICKSTART), "--engine", "flower-sim", "--out", str(out),
                 "--set", "method.algorithm=nope"]) == 2
    assert not out.exists()


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
    from partialfl.flower.deployment import SuperLinkConnection, free_port

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
