"""Code from messages (issue 21, item 6): a SuperNode takes its run config from the server's
messages, so it never imports a ``package.module:callable`` named there unless its own
operator allowed it (node config ``allow-imports`` or ``PARTIALFL_NODE_ALLOW_IMPORTS``)."""

from __future__ import annotations

import base64
import json

import pytest

from partialfl.flower.config import ConfigError, parse_run_config
from partialfl.flower.node import ALLOW_IMPORTS_ENV, check_code, code_refs, node_options

NODE = {"partition-id": 0, "num-partitions": 1}


def _spec_config(model_name: str) -> dict:
    spec = {"model": {"name": model_name}, "data": {"path": "/data/a:b.npz"},
            "method": {"split": "preset:foo"}}
    text = base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()
    return {"problem": "train", "train-spec": "b64:" + text}


def test_code_refs_finds_every_callable_the_config_names():
    assert code_refs(parse_run_config({"model": "os:system", "problem": "femnist",
                                       "local-lr": 0.1})) == [("model", "os:system")]
    assert code_refs(parse_run_config(_spec_config("evil.mod:make"))) == [
        ("train-spec.model.name", "evil.mod:make")]
    # registry names, 'preset:NAME', paths and fault specs are not code
    assert code_refs(parse_run_config(_spec_config("emnist_cnn"))) == []
    assert code_refs(parse_run_config({"fault-injection": "crash:partition=1,round=2"})) == []


def test_a_node_refuses_code_unless_its_own_config_allows_it():
    cfg = parse_run_config({"model": "os:system", "problem": "femnist", "local-lr": 0.1})
    with pytest.raises(ConfigError, match=r"SuperNode refuses run-config model = 'os:system'.*"
                       r"allow-imports=true.*PARTIALFL_NODE_ALLOW_IMPORTS=1"):
        check_code(cfg, node_options(NODE, environ={}))
    check_code(cfg, node_options({**NODE, "allow-imports": True}, environ={}))
    check_code(cfg, node_options(NODE, environ={ALLOW_IMPORTS_ENV: "1"}))
    check_code(parse_run_config({}), node_options(NODE, environ={}))  # names no code: fine
    with pytest.raises(ConfigError, match="node-config 'allow-imports'"):
        node_options({**NODE, "allow-imports": "maybe"}, environ={})
    with pytest.raises(ConfigError, match="node-config 'eval-min-clients'"):
        node_options({**NODE, "eval-min-clients": 0}, environ={})


def test_a_message_naming_code_runs_nothing_on_any_supernode(loopback, tmp_path, monkeypatch):
    """End to end (in process): the ServerApp's run config names a callable that would leave
    a marker file when called. Every SuperNode refuses the run before building anything (the
    server gets errors and stops with a one-line reason); the callable never runs. With the
    data present, the old code imported and called it while building the model."""
    from partialfl.flower.server import run_server

    marker = tmp_path / "ran"
    (tmp_path / "partialfl_test_payload.py").write_text(
        "import pathlib\n"
        f"def make(**kw):\n    pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "    import torch\n    return torch.nn.Linear(784, 62)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(ALLOW_IMPORTS_ENV, raising=False)
    run = {"problem": "femnist", "model": "partialfl_test_payload:make", "local-lr": 0.1,
           "num-rounds": 1, "node-wait-timeout": 0.5, "round-timeout": 0.5}
    with pytest.raises(RuntimeError, match="no SuperNode answered the describe query .last "
                       "refusal: ConfigError: SuperNode refuses run-config model"):
        run_server(loopback(2), run)
    assert not marker.exists()


def test_partialfl_train_allows_imports_only_on_its_own_supernodes(tmp_path):
    from partialfl.flower.project import LocalFederation

    fed = LocalFederation(2, work_dir=tmp_path / "a")
    assert ALLOW_IMPORTS_ENV not in fed.env
    fed = LocalFederation(2, work_dir=tmp_path / "b", allow_imports=True)
    assert fed.env[ALLOW_IMPORTS_ENV] == "1"
