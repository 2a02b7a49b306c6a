"""The Flower app's run config (no flwr needed): Flower's own keys and the spec it carries,
validation, partitions, the generated pyproject."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from _flower_sims import LS_SPEC, ls_run, ls_spec

from partialfl.flower.config import (
    FIELDS,
    ConfigError,
    Fault,
    decode_spec,
    encode_spec,
    parse_fault_injection,
    parse_run_config,
    partition_clients,
)
from partialfl.flower.project import app_pyproject
from partialfl.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_round_trip():
    cfg = parse_run_config({})
    assert cfg.run == RunSpec().effective()  # '' = the spec's defaults
    assert parse_run_config(cfg.to_run_config()) == cfg
    assert cfg.replace(round_timeout=3).round_timeout == 3.0
    assert {f.key for f in FIELDS} == set(cfg.to_run_config())


def test_flower_keeps_only_its_own_keys():
    """Issue 26: no key of the run config mirrors the spec (the spec is carried whole)."""
    spec_keys = {"algorithm", "problem", "num-rounds", "clients-per-round", "seed", "mode",
                 "server-lr", "server-opt", "aggregator", "attack", "local-steps", "model",
                 "split", "ls-n", "train-spec", "eval-every", "max-failure-fraction"}
    assert not spec_keys & {f.key for f in FIELDS}


def test_the_spec_travels_in_every_form_and_canonically():
    spec = RunSpec.from_dict(ls_spec(4, 2))
    toml = "seed = 3\n[problem]\nname = 'least-squares'\nnum_clients = 8\nn = 200\n" \
           "d_theta = 10\nd_w = 5\nseed = 3\n[method]\nalgorithm = 'ffgg'\nw_init = 'zero'\n" \
           "[personalize]\nrounds = 4\nclients_per_round = 2\nclient = {name = 'cg', tau = 5}"
    import json

    forms = [spec, spec.to_dict(), json.dumps(spec.to_dict()), encode_spec(spec), toml]
    cfgs = [parse_run_config({"spec": f}) for f in forms]
    assert all(c.run == spec.effective() for c in cfgs)
    assert len({c.spec for c in cfgs}) == 1  # one canonical text: server and nodes agree
    assert decode_spec(cfgs[0].spec) == spec.to_dict() or RunSpec.from_dict(
        decode_spec(cfgs[0].spec)) == spec
    # `set` overrides apply like --set, then the canonical spec carries them
    cfg = parse_run_config({"spec": toml, "set": "personalize.rounds=7; seed=1"})
    assert (cfg.rounds, cfg.seed, cfg.set) == (7, 1, "")
    assert (cfg.clients_per_round, cfg.closed_form, cfg.stage) == (2, True, "personalize")


@pytest.mark.parametrize(
    "override, match",
    [
        ({"algorithm": "ffgg"}, r"unknown run-config key\(s\) 'algorithm'.*allowed keys: spec, "
                                r"set, stage"),
        ({"spec": "{not json"}, r"'spec': neither TOML, a JSON object nor b64:JSON"),
        ({"spec": "b64:@@@"}, r"'spec': neither TOML"),
        ({"spec": {"method": {"algorithm": "fedprox2"}}},
         r"'spec': method.algorithm: 'fedprox2' is not allowed.*allowed: apfl, ditto"),
        ({"spec": {"personalize": {"rounds": -1}}}, r"'spec': .*rounds must be a non-negative"),
        ({"set": "personalize.rounds"}, r"'set': override 'personalize.rounds' is not of the "
                                        r"form key=value"),
        ({"stage": "finetune"}, r"'stage': unknown value 'finetune'; allowed: pretrain, "
                                r"personalize"),
        ({"spec": LS_SPEC, "stage": "pretrain"}, r"a closed-form spec has one stage"),
        ({"spec": LS_SPEC, "init-from": "x.npz"}, r"'init-from' applies to stage personalize "
                                                  r"of a model run"),
        ({"round-timeout": 0}, r"'round-timeout': got 0.0; expected a number > 0"),
        ({"min-nodes": "3"}, r"'min-nodes': got '3' \(str\); expected an integer >= 1"),
        ({"secagg": 1}, r"'secagg': got 1 \(int\); expected bool"),
        ({"secagg-threshold": 4}, r"'secagg-threshold': 4 must be less than secagg-shares \(3\)"),
        ({"fault-injection": "explode:partition=0"}, r"unknown fault 'explode'"),
        ({"fault-injection": "crash:round=1"}, r"needs partition=INT"),
        ({"checkpoint-every": 2}, r"need 'out-dir'"),
        ({"spec": {"validation": {"fraction": 0.1}, "personalize": {
            "eval_every": 1, "stop": {"window": 2}}}}, r"spec personalize.stop: the plateau rule"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_run_config(override)
    assert "\n" not in str(e.value)


def test_errors_are_partialfl_config_errors():
    from partialfl.config import ConfigError as CoreConfigError

    with pytest.raises(CoreConfigError):
        parse_run_config({"stage": "batch"})


def test_ints_given_for_floats_are_accepted():
    cfg = parse_run_config({"round-timeout": 5, "secagg-clip": 1})
    assert cfg.round_timeout == 5.0 and isinstance(cfg.round_timeout, float)
    assert cfg.secagg_clip == 1.0


def test_the_stage_reads_the_spec():
    spec = {"seed": 4, "pretrain_seed": 9, "pretrain": {"rounds": 5, "clients_per_round": 3,
                                                        "eval_every": 2},
            "personalize": {"rounds": 7}, "stages": ["personalize", "finetune"],
            "asynchronous": {"rule": {"name": "fedbuff", "buffer": 3}, "concurrency": 2}}
    pre = parse_run_config({"spec": spec, "stage": "pretrain"})
    assert (pre.rounds, pre.clients_per_round, pre.seed) == (0, 3, 9)  # not in stages: 0
    cfg = parse_run_config({"spec": spec})
    assert (cfg.rounds, cfg.clients_per_round, cfg.seed, cfg.eval_every) == (7, None, 4, 0)
    assert (cfg.asynchronous.concurrency, cfg.buffer_size) == (2, 3)
    assert parse_run_config({}).asynchronous is None and parse_run_config({}).buffer_size == 1


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


def test_server_and_node_build_the_in_process_objects():
    """The ServerApp and a SuperNode build the spec's problem and algorithm through
    partialfl.build: the objects `partialfl run` builds (here with the 'c/L' stepsize)."""
    from partialfl.algorithms import FFGG
    from partialfl.algorithms.fedavg import FedAvg
    from partialfl.build import build
    from partialfl.flower.stage import node_parts, server_parts

    for over, cls in (({}, FFGG), ({"method": {"algorithm": "fedavg"}, "personalize": {
            "client": {"name": "gd", "tau": 5}}}, FedAvg)):
        run = ls_run(3, spec={**over, "personalize": {**over.get("personalize", {}),
                                                      "server": {"lr": "0.5/L"}}})
        cfg = parse_run_config(run)
        ref = build(cfg.run)
        problem, alg = server_parts(cfg, 8)
        node_problem, node_alg, theta0 = node_parts(cfg)
        for a in (alg, node_alg):
            assert type(a) is cls is type(ref.algorithm)
            assert a.server_opt.lr == pytest.approx(0.5 / problem.L)
        assert problem is node_problem is ref.problem  # one cached problem
        np.testing.assert_array_equal(theta0["theta"], problem.init_theta()["theta"])
    with pytest.raises(ConfigError, match="the SuperNodes hold 6 clients, the spec's problem "
                       "has 8"):
        server_parts(cfg, 6)


def test_generated_pyproject_declares_every_key():
    doc = tomllib.loads(app_pyproject({"round-timeout": 7.0}))
    app = doc["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "partialfl.flower.server:app",
                                 "clientapp": "partialfl.flower.client:app"}
    assert list(app["config"]) == [f.key for f in FIELDS]
    assert parse_run_config(app["config"]).round_timeout == 7.0


def test_example_pyproject_is_valid_and_complete():
    """examples/flower/pyproject.toml declares exactly the keys partialfl understands and
    carries the quickstart config as its spec (it is generated: python -m
    partialfl.flower.project examples/flower/pyproject.toml configs/train/quickstart.toml)."""
    from partialfl.flower.project import example_pyproject
    from partialfl.pipeline.train import load_run_spec

    quickstart = ROOT / "configs" / "train" / "quickstart.toml"
    text = (ROOT / "examples" / "flower" / "pyproject.toml").read_text()
    assert text == example_pyproject(quickstart), "regenerate examples/flower/pyproject.toml"
    conf = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
    assert sorted(conf) == sorted(f.key for f in FIELDS)
    cfg = parse_run_config(conf)
    assert cfg.run == load_run_spec(quickstart, [f"name={cfg.run.name}"]).effective()
    assert "# Quickstart" in conf["spec"]  # the config as it is, comments included


def test_flower_report_prints_a_summary_not_theta():
    pytest.importorskip("flwr", reason="needs the flower extra")
    from partialfl.flower.server import FlowerRunReport

    theta = {"conv.weight": np.full((32, 1, 5, 5), 0.123456), "fc.bias": np.zeros(62)}
    rep = FlowerRunReport(config={}, theta=theta, label="ffgg-output on femnist/emnist_cnn",
                          history=[{"round": 2, "eval_acc": 0.61234567, "local_grads": 40}],
                          server_steps=2, seconds=12.3)
    text = repr(rep)
    assert "0.123456" not in text and "array" not in text and len(text) < 400
    assert "ffgg-output on femnist" in text and "2 server steps" in text
    assert "862 values" in text and "'eval_acc': 0.6123" in text


def test_local_federation_progress_echoes_the_server_round_lines(capfd, tmp_path):
    import sys

    from partialfl.flower.env import run_echoing

    code = "print('INFO : partialfl: {\"round\": 1}'); print('noise'); raise SystemExit(3)"
    proc = run_echoing([sys.executable, "-c", code], None, tmp_path, 60, "stage1")
    assert proc.returncode == 3 and "noise" in proc.stdout and "partialfl:" in proc.stdout
    err = capfd.readouterr().err
    assert '[stage1] {"round": 1}' in err and "noise" not in err
