"""The Flower app's run config (no flwr needed): validation, builders, partitions, pyproject."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from partialfl.flower.builders import build_algorithm, build_problem
from partialfl.flower.config import (
    FIELDS,
    ConfigError,
    Fault,
    FlowerConfig,
    parse_fault_injection,
    parse_run_config,
    partition_clients,
)
from partialfl.flower.project import app_pyproject
from partialfl.local.sgd import SGDConfig

SMALL = {"ls-clients": 6, "ls-n": 40, "ls-d-theta": 4, "ls-d-w": 3}
ROOT = Path(__file__).resolve().parents[1]


def test_defaults_round_trip():
    cfg = parse_run_config({})
    assert cfg.to_run_config() == {f.key: f.default for f in FIELDS}
    assert FlowerConfig() == cfg  # the dataclass defaults are the table's
    assert parse_run_config(cfg.to_run_config()) == cfg
    assert cfg.replace(num_rounds=3).num_rounds == 3


@pytest.mark.parametrize(
    "override, match",
    [
        ({"algoritm": "ffgg"}, r"unknown run-config key\(s\) 'algoritm'; allowed keys: algorithm"),
        ({"algorithm": "fedprox"}, r"'algorithm': unknown value 'fedprox'; allowed: ffgg, br-ffgg"),
        ({"num-rounds": -1}, r"'num-rounds': got -1; expected an integer >= 0"),
        ({"num-rounds": "3"}, r"'num-rounds': got '3' \(str\); expected an integer >= 0"),
        ({"server-lr": "fast"}, r"'server-lr': got 'fast'; server.lr: 'fast' is neither a "
                                r"number, 'auto' nor of the form 'c/L'"),
        ({"schedule": "cosine"}, r"'schedule': got 'cosine'; server.schedule: 'cosine' is not "
                                 r"allowed; allowed: constant, warmup-linear, exponential"),
        ({"model": "vgg"}, r"'model': got 'vgg'; model.name: 'vgg' is not allowed; allowed: "
                           r"emnist_cnn"),
        ({"ls-n": 0}, r"'ls-n': got 0; problem.n: n must be a positive integer"),
        ({"server-lr": True}, r"'server-lr': got True"),
        ({"mode": "batch"}, r"'mode': unknown value 'batch'; allowed: sync, async"),
        ({"schedule": "exponential"}, r"'halve-every' must be >= 1"),
        ({"ls-n": 2, "ls-d-w": 3}, r"'ls-n' \(2\) < 'ls-d-w' \(3\)"),
        ({"w-init": "pretrained"}, r"'w-init': unknown value 'pretrained' for least squares"),
        ({"algorithm": "br-ffgg"}, r"BR-FFGG needs a robust aggregator"),
        ({"attack": "alie"}, r"'attack': 'alie' needs byzantine-fraction > 0"),
        ({"problem": "femnist"}, r"'local-lr': problem 'femnist' needs an explicit local"),
        ({"byzantine-fraction": 0.5}, r"'byzantine-fraction': got 0.5; expected a number in"),
        ({"fault-injection": "explode:partition=0"}, r"unknown fault 'explode'"),
        ({"fault-injection": "crash:round=1"}, r"needs partition=INT"),
        ({"clients-per-round": 7, **SMALL}, r"'clients-per-round': 7 > ls-clients \(6\)"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(override, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config(override)


def test_errors_are_partialfl_config_errors():
    from partialfl.config import ConfigError as CoreConfigError

    with pytest.raises(CoreConfigError):
        parse_run_config({"mode": "batch"})


def test_ints_given_for_floats_are_accepted():
    cfg = parse_run_config({"round-timeout": 5, "server-lr": 1})
    assert cfg.round_timeout == 5.0 and isinstance(cfg.round_timeout, float)
    assert cfg.server_lr == 1.0


def test_fault_injection_parsing():
    faults = parse_fault_injection("crash:partition=1,round=2; slow:partition=0,seconds=1.5")
    assert faults == (Fault("crash", 1, 2, 0.0), Fault("slow", 0, -1, 1.5))
    assert faults[0].applies(1, 2) and not faults[0].applies(1, 3)
    assert faults[1].applies(0, 7) and not faults[1].applies(1, 7)


def test_partitions_cover_every_client_once():
    parts = [partition_clients(10, 3, p) for p in range(3)]
    assert np.array_equal(np.concatenate(parts), np.arange(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    with pytest.raises(ConfigError, match="'partition-id' must be in"):
        partition_clients(10, 3, 3)
    with pytest.raises(ConfigError, match="exceeds the number of clients"):
        partition_clients(2, 3, 0)


def test_builders_give_the_simulator_objects():
    from partialfl.aggregation import Bucketing, CoordinateMedian
    from partialfl.algorithms import FFGG, LocalGD
    from partialfl.algorithms.byzantine import ByzantineRobust

    cfg = parse_run_config(SMALL)
    problem = build_problem(cfg)
    alg = build_algorithm(cfg, problem)
    assert isinstance(alg, FFGG)
    assert alg.server_opt.lr == pytest.approx(1.0 / problem.L)  # 'auto' = 1/L (Theorem 1)
    assert alg.solver.tau == cfg.local_steps and alg.solver.init == "zero"
    half = build_algorithm(cfg.replace(server_lr="0.5/L"), problem)
    assert half.server_opt.lr == pytest.approx(0.5 / problem.L)
    fedavg_cfg = cfg.replace(algorithm="fedavg")
    fedavg = build_algorithm(fedavg_cfg, build_problem(fedavg_cfg))
    assert isinstance(fedavg, LocalGD) and fedavg.server_opt.lr == 1.0
    assert build_problem(fedavg_cfg).basis == "standard"  # shared w needs a common basis
    assert problem.basis == "eigen"
    br = build_algorithm(cfg.replace(algorithm="br-ffgg", aggregator="cm", bucket_size=2,
                                     byzantine_fraction=0.34, attack="sign-flip"), problem)
    assert isinstance(br, ByzantineRobust) and isinstance(br.base, FFGG)
    assert isinstance(br.aggregator, Bucketing) and isinstance(br.aggregator.inner,
                                                               CoordinateMedian)
    assert len(br.byzantine.clients) == 2  # ⌊0.34 · 6⌋
    with pytest.raises(ConfigError, match="robust FFGG is algorithm 'br-ffgg'"):
        build_algorithm(cfg.replace(aggregator="cm"), problem)
    with pytest.raises(ConfigError, match="'aggregator': unknown aggregator 'median-of-means'"):
        build_algorithm(cfg.replace(algorithm="br-ffgg", aggregator="median-of-means"), problem)
    with pytest.raises(ConfigError, match="'local-ffgg' .* model problems"):
        build_algorithm(cfg.replace(algorithm="local-ffgg"), problem)


def test_the_apps_defaults_are_the_specs():
    """Keys that mirror a run-specification field take its default and validation, so a
    bare Flower run builds the objects a bare `partialfl run` / `train` config builds."""
    from partialfl.flower.builders import closed_form_config
    from partialfl.flower.models import pipeline_configs
    from partialfl.spec import (
        AlgorithmConfig,
        MethodConfig,
        ModelSpec,
        ProblemConfig,
        ServerConfig,
    )

    mirrored = [f for f in FIELDS if f.spec]
    assert len(mirrored) >= 15
    cfg = parse_run_config({})
    cf = closed_form_config(cfg)
    assert cf.problem == ProblemConfig()
    assert cf.algorithm.solver == AlgorithmConfig().solver
    server = ServerConfig()
    assert (cfg.server_opt, cfg.server_lr, cfg.server_momentum, cfg.schedule,
            cfg.warmup_rounds, cfg.halve_every, cfg.server_clip or None) == (
        server.optimizer, server.lr, server.momentum, server.schedule, server.warmup,
        server.halve_every, server.clip_norm)
    method, stage = pipeline_configs(cfg.replace(problem="femnist", local_lr=0.1))
    assert (method.split, method.weighting) == (MethodConfig().split, MethodConfig().weighting)
    client = SGDConfig()
    assert (stage.client.epochs, stage.client.batch_size) == (client.epochs, client.batch_size)
    assert cfg.model == ModelSpec().name
    # the types come from the spec too: an int field refuses a string, a float one an int-y bool
    with pytest.raises(ConfigError, match="'ls-n': got '5'"):
        parse_run_config({"ls-n": "5"})
    assert parse_run_config({"server-clip": 2}).server_clip == 2.0


def test_generated_pyproject_declares_every_key():
    doc = tomllib.loads(app_pyproject({"num-rounds": 7}))
    app = doc["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "partialfl.flower.server:app",
                                 "clientapp": "partialfl.flower.client:app"}
    assert list(app["config"]) == [f.key for f in FIELDS]
    assert app["config"]["num-rounds"] == 7
    assert parse_run_config(app["config"]).num_rounds == 7


def test_example_pyproject_is_valid_and_complete():
    """examples/flower/pyproject.toml declares exactly the keys partialfl understands (it is
    generated: python -m partialfl.flower.project examples/flower/pyproject.toml)."""
    from partialfl.flower.project import example_pyproject

    text = (ROOT / "examples" / "flower" / "pyproject.toml").read_text()
    assert text == example_pyproject(), "regenerate examples/flower/pyproject.toml"
    doc = tomllib.loads(text)
    conf = doc["tool"]["flwr"]["app"]["config"]
    assert sorted(conf) == sorted(f.key for f in FIELDS)
    cfg = parse_run_config(conf)
    assert cfg.problem == "femnist"


def test_python_femnist_defaults_are_the_example_apps():
    """run_simulation({"problem": "femnist"}) trains as `flwr run examples/flower` does; the
    bare run-config defaults would fail (no local stepsize) and train every client."""
    pytest.importorskip("flwr", reason="needs the flower extra")
    from partialfl.flower.simulation import FEMNIST_DEFAULTS, with_app_defaults

    with pytest.raises(ConfigError, match="local-lr"):
        parse_run_config({"problem": "femnist"})
    cfg = parse_run_config(with_app_defaults({"problem": "femnist"}))
    app = tomllib.loads((ROOT / "examples" / "flower" / "pyproject.toml").read_text())
    app = parse_run_config(app["tool"]["flwr"]["app"]["config"])
    for key in ("local-lr", "server-lr", "clients-per-round", "num-rounds", "eval-every",
                "split", "algorithm", "round-timeout"):
        attr = key.replace("-", "_")
        assert getattr(cfg, attr) == getattr(app, attr), key
    assert cfg.clients_per_round == 10 and cfg.local_lr == 0.01
    assert "min-nodes" not in FEMNIST_DEFAULTS and "out-dir" not in FEMNIST_DEFAULTS
    # what the caller sets wins; other problems keep the plain defaults
    assert parse_run_config(with_app_defaults({"problem": "femnist", "local-lr": 0.1})
                            ).local_lr == 0.1
    assert with_app_defaults(SMALL) == SMALL


def test_flower_report_prints_a_summary_not_theta():
    pytest.importorskip("flwr", reason="needs the flower extra")
    from partialfl.flower.server import FlowerRunReport

    theta = {"conv.weight": np.full((32, 1, 5, 5), 0.123456), "fc.bias": np.zeros(62)}
    rep = FlowerRunReport(config={"algorithm": "ffgg", "problem": "femnist"}, theta=theta,
                          history=[{"round": 2, "eval_acc": 0.61234567, "local_grads": 40}],
                          server_steps=2, seconds=12.3)
    text = repr(rep)
    assert "0.123456" not in text and "array" not in text and len(text) < 400
    assert "ffgg on femnist" in text and "2 server steps" in text and "862 values" in text
    assert "'eval_acc': 0.6123" in text


def test_local_federation_progress_echoes_the_server_round_lines(capfd, tmp_path):
    import sys

    from partialfl.flower.project import _run_echoing

    code = "print('INFO : partialfl: {\"round\": 1}'); print('noise'); raise SystemExit(3)"
    proc = _run_echoing([sys.executable, "-c", code], None, tmp_path, 60, "stage1")
    assert proc.returncode == 3 and "noise" in proc.stdout and "partialfl:" in proc.stdout
    err = capfd.readouterr().err
    assert '[stage1] {"round": 1}' in err and "noise" not in err
