"""Code from messages (issue 21, item 6): a SuperNode takes its run config — the run's spec —
from the server's messages, so it never imports code the spec names (a
``package.module:callable`` model, ``plugins``) unless its own operator allowed it (node config
``allow-imports`` or ``PARTIALFL_NODE_ALLOW_IMPORTS``)."""

from __future__ import annotations

import pytest

from partialfl.flower.config import ConfigError, decode_spec, encode_spec
from partialfl.flower.node import ALLOW_IMPORTS_ENV, check_code, code_refs, node_options

NODE = {"partition-id": 0, "num-partitions": 1}


def _spec(model_name: str, plugins=()) -> dict:
    return {"model": {"name": model_name}, "data": {"path": "/data/a:b.npz"},
            "method": {"algorithm": "fedper"}, "plugins": list(plugins)}


def test_code_refs_finds_every_module_the_spec_names():
    assert code_refs(_spec("evil.mod:make")) == [("model.name", "evil.mod:make")]
    assert code_refs(_spec("emnist_cnn", ["my_pkg.algo", "other"])) == [
        ("plugins", "my_pkg.algo"), ("plugins", "other")]
    # registry names, presets, paths and fault specs are not code
    assert code_refs(_spec("emnist_cnn")) == []
    assert code_refs({}) == [] and code_refs({"model": "x:y"}) == []


def test_a_node_refuses_code_unless_its_own_config_allows_it():
    spec = _spec("os:system")
    with pytest.raises(ConfigError, match=r"SuperNode refuses spec model.name = 'os:system'.*"
                       r"allow-imports=true.*PARTIALFL_NODE_ALLOW_IMPORTS=1"):
        check_code(spec, node_options(NODE, environ={}))
    with pytest.raises(ConfigError, match=r"refuses spec plugins = 'evil'"):
        check_code(_spec("emnist_cnn", ["evil"]), node_options(NODE, environ={}))
    check_code(spec, node_options({**NODE, "allow-imports": True}, environ={}))
    check_code(spec, node_options(NODE, environ={ALLOW_IMPORTS_ENV: "1"}))
    check_code(_spec("emnist_cnn"), node_options(NODE, environ={}))  # names no code: fine
    with pytest.raises(ConfigError, match="node-config 'allow-imports'"):
        node_options({**NODE, "allow-imports": "maybe"}, environ={})
    with pytest.raises(ConfigError, match="node-config 'eval-min-clients'"):
        node_options({**NODE, "eval-min-clients": 0}, environ={})
    with pytest.raises(ConfigError, match="node-config 'data'"):
        node_options({**NODE, "data": 3}, environ={})


@pytest.mark.parametrize("where", ["model", "plugins"])
def test_a_message_naming_code_runs_nothing_on_any_supernode(loopback, tmp_path, monkeypatch,
                                                             where):
    """End to end (in process): the ServerApp's spec names a callable (or a plugin module)
    that would leave a marker file when imported or called. Every SuperNode refuses the run
    before building anything (the server gets errors and stops with a one-line reason); the
    code never runs. The server itself may import it (its user's own spec): allowed here."""
    from partialfl.build import ALLOW_CODE_ENV
    from partialfl.flower.server import run_server

    marker = tmp_path / "ran"
    (tmp_path / "partialfl_test_payload.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).write_text('x')\n"
        f"def make(**kw):\n    pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "    import torch\n    return torch.nn.Linear(784, 62)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(ALLOW_IMPORTS_ENV, raising=False)
    monkeypatch.setenv(ALLOW_CODE_ENV, "1")
    spec = ({"model": {"name": "partialfl_test_payload:make"}} if where == "model" else
            {"plugins": ["partialfl_test_payload"]})
    run = {"spec": {**spec, "personalize": {"rounds": 1}}, "node-wait-timeout": 0.5,
           "round-timeout": 0.5}
    if where == "model":  # the server imports nothing of a model: it holds no model
        (tmp_path / "imported").unlink(missing_ok=True)
    with pytest.raises(RuntimeError, match="no SuperNode answered the describe query .last "
                       f"refusal: ConfigError: SuperNode refuses spec {where}"):
        run_server(loopback(2), run)
    assert not marker.exists()


def test_the_spec_is_read_without_importing_it():
    """decode_spec only parses: it is what a node reads before refusing code."""
    from partialfl.spec import RunSpec

    spec = RunSpec.from_dict({"seed": 5})
    assert decode_spec(encode_spec(spec))["seed"] == 5
    assert decode_spec("", "seed=2") == {"seed": 2}


def test_partialfl_train_allows_imports_only_on_its_own_supernodes(tmp_path):
    from partialfl.flower.deployment import LocalFederation

    fed = LocalFederation(2, work_dir=tmp_path / "a")
    assert ALLOW_IMPORTS_ENV not in fed.env
    fed = LocalFederation(2, work_dir=tmp_path / "b", allow_imports=True)
    assert fed.env[ALLOW_IMPORTS_ENV] == "1"
