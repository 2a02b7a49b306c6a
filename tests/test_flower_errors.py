"""The Flower example's walls (issue 23 item 9): processes partialfl starts get absolute
paths, a SuperNode's own error (its data not found) is what the user sees — at once and in
one line — and stage 1 is labelled FedAvg."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from partialfl.flower.env import FlowerRunError, absolute_paths, flower_env
from partialfl.flower.report import failure_cause, node_reason

#: what `flwr run --stream` printed when both SuperNodes of `partialfl train --engine flower`
#: could not find a relative PARTIALFL_DATA_DIR (main 8f8be0e, abridged)
MISSING = ("spec: data.path: data file ../shared/data/femnist_leaf_subset.npz does not exist; "
           "pass --data-dir or set PARTIALFL_DATA_DIR to the folder holding "
           "'femnist_leaf_subset.npz'")
WRAPPED = f"<class 'partialfl.flower.config.ConfigError'>:<'{MISSING}'>"
FLWR_OUTPUT = f"""Successfully started run 198582235877962012
\x1b[93mWARNING \x1b[0m:   SuperNode 26593 did not describe itself ({WRAPPED}); it is left out
\x1b[91mERROR \x1b[0m:     ServerApp raised an exception
Traceback (most recent call last):
  File "/x/partialfl/flower/federation.py", line 190, in describe
    raise RuntimeError(f"no SuperNode answered the describe query{{why}}")
RuntimeError: no SuperNode answered the describe query (last refusal: {WRAPPED})
\x1b[91mERROR \x1b[0m:     Exit Code: 201
"""
NODE_LOG = """  File "/x/partialfl/flower/stage.py", line 28, in _core
    raise ConfigError(f"spec: {e}") from None
partialfl.flower.config.ConfigError: spec: data.path: data file /nope/x.npz does not exist
\x1b[91mERROR \x1b[0m:     Exit Code: 800
"""


def test_failure_cause_is_the_servers_last_error_with_the_nodes_reason_unwrapped():
    cause = failure_cause(FLWR_OUTPUT, NODE_LOG)
    assert cause == ("RuntimeError: no SuperNode answered the describe query (last refusal: "
                     f"ConfigError: {MISSING})")
    # the ServerApp said nothing (e.g. it never started): the nodes' logs have the cause
    assert failure_cause("Successfully started run 1\n", NODE_LOG) == (
        "ConfigError: spec: data.path: data file /nope/x.npz does not exist")
    assert failure_cause("all fine\n", "") is None
    assert node_reason("<class 'a.b.ValueError'>:<'bad'>") == "ValueError: bad"


def test_processes_get_absolute_data_and_module_paths(tmp_path, monkeypatch):
    """A relative PARTIALFL_DATA_DIR reached the SuperNodes as is and was looked up from
    their own folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARTIALFL_DATA_DIR", "../shared/data")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["src", "", "/abs/lib"]))
    env = flower_env()
    assert env["PARTIALFL_DATA_DIR"] == str(tmp_path.parent / "shared" / "data")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "src"), str(tmp_path),
                                                   "/abs/lib"]
    # unset: the default data folder this process finds (./shared/data here), absolute
    monkeypatch.delenv("PARTIALFL_DATA_DIR")
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert flower_env()["PARTIALFL_DATA_DIR"] == str(tmp_path / "shared" / "data")
    assert absolute_paths({"PARTIALFL_DATA_DIR": "d"}, "/base")["PARTIALFL_DATA_DIR"] == \
        "/base/d"


def test_a_relative_data_path_reaches_the_nodes_absolute(tmp_path, monkeypatch):
    from partialfl.flower.train import absolute_data_path
    from partialfl.spec import RunSpec

    monkeypatch.chdir(tmp_path)
    spec = RunSpec.from_dict({"data": {"source": "folder", "path": "clients"}})
    assert absolute_data_path(spec).data.path == str(tmp_path / "clients")
    assert absolute_data_path(absolute_data_path(spec)) == absolute_data_path(spec)


@pytest.mark.timeout(60)
def test_every_node_failing_to_start_stops_the_server_at_once_with_its_error(loopback,
                                                                           tmp_path):
    """It waited node-wait-timeout (120 s by default), then ended without a result."""
    pytest.importorskip("flwr")
    from partialfl.flower.server import run_server

    missing = tmp_path / "no-such-folder"
    run = {"spec": {"data": {"source": "folder", "path": str(missing)},
                    "personalize": {"rounds": 1}},
           "node-wait-timeout": 30.0, "round-timeout": 30.0, "min-nodes": 2}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"last refusal: ConfigError: .*{missing}"):
        run_server(loopback(2), run)
    assert time.monotonic() - t0 < 10


def test_the_cli_prints_a_failed_flower_runs_cause_in_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("flwr")
    import partialfl.flower.train as ftrain
    from partialfl.cli import main

    def fail(*a, **k):
        raise FlowerRunError("the Flower run failed: ConfigError: data file /x missing\n"
                             "long output ...")

    monkeypatch.setattr(ftrain, "run_flower_train", fail)
    cfg = Path(__file__).resolve().parents[1] / "configs" / "train" / "quickstart.toml"
    assert main(["train", str(cfg), "--engine", "flower", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err == "partialfl: error: the Flower run failed: ConfigError: data file /x missing\n"


def test_stage_one_is_labelled_fedavg():
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.server import describe_run

    spec = {"model": {"name": "emnist_cnn"}, "data": {"source": "femnist"},
            "method": {"algorithm": "ffgg"}}
    cfg = parse_run_config({"spec": spec, "stage": "pretrain"})
    assert describe_run(cfg).startswith("FedAvg pre-training on femnist/emnist_cnn")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_live_nodes_that_cannot_find_their_data_fail_the_run_with_that_error(tmp_path):
    """Real processes: a SuperLink and 2 SuperNodes whose data folder does not exist."""
    pytest.importorskip("flwr")
    from partialfl.flower.deployment import LocalFederation

    missing = tmp_path / "no-such-folder"
    spec = {"data": {"source": "folder", "path": str(missing)}, "personalize": {"rounds": 1}}
    with LocalFederation(2, work_dir=tmp_path / "fed") as fed, \
            pytest.raises(FlowerRunError) as e:
        fed.run({"spec": spec}, timeout=240)
    first = str(e.value).splitlines()[0]
    assert first.startswith("the Flower run failed: RuntimeError: no SuperNode answered")
    assert f"ConfigError: spec: data.path: client folder '{missing}' does not exist" in first


def test_nodes_disagreeing_on_the_problem_are_named_each(loopback):
    """Nodes that disagree on the kind of problem (one says torch) stopped the ServerApp with
    a message that named no node; now it lists each node's partition, clients and kind
    (once ``node-wait-timeout`` passed with no federation complete: one might still be)."""
    from _flower_sims import ls_run

    from partialfl.flower.config import ConfigError
    from partialfl.flower.server import run_server

    def tamper(partition, kind, content):
        if kind == "query.describe" and partition == 1:
            content["info"]["torch"] = 1

    with pytest.raises(ConfigError, match=r"node 1000: partition 0 of 2, 8 clients, "
                                          r"closed-form; node 1001: partition 1 of 2, 8 "
                                          r"clients, a model"):
        run_server(loopback(2, tamper=tamper), ls_run(1, node_wait_timeout=1))



def test_a_superlink_restart_restarts_every_supernode_after_it_signs_off(tmp_path,
                                                                         monkeypatch):
    """CI saw a SuperNode that held a message of the run the dead SuperLink served stay
    blocked on it for minutes, so the resumed run found no node for its partition: a
    SuperLink restart restarts every SuperNode, each first with SIGTERM (a SuperNode then
    deactivates itself; a SIGKILLed one keeps its key 'online' and cannot sign on again)."""
    import subprocess
    import sys

    from partialfl.flower.deployment import LocalFederation

    fed = LocalFederation(2, work_dir=tmp_path / "fed")
    node = ("import signal, sys, time, pathlib\n"
            "def bye(*_):\n"
            "    pathlib.Path(sys.argv[1]).write_text('signed off'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('up', flush=True)\n"
            "time.sleep(120)\n")

    def fake_node(i: int) -> subprocess.Popen:
        return fed._start(f"supernode-{i}", [sys.executable, "-c", node,
                                             str(tmp_path / f"bye-{i}-{len(fed.procs)}")])

    monkeypatch.setattr(fed, "_start_superlink",
                        lambda: fed._start("superlink", [sys.executable, "-c",
                                                         "import time; time.sleep(120)"]))
    monkeypatch.setattr(fed, "start_node", fake_node)
    try:
        fed._start_superlink()
        first = [fed.start_node(i) for i in range(2)]
        fed.started = True
        deadline = time.monotonic() + 30  # the nodes installed their SIGTERM handler
        while time.monotonic() < deadline and any(
                "up" not in fed.log_tail(f"supernode-{i}") for i in range(2)):
            time.sleep(0.05)
        assert not fed.revive()  # everything alive: nothing restarted
        fed.kill("superlink")
        assert fed.revive() and fed.restarts == 1
        assert all(p.poll() is not None for p in first)  # the old nodes are gone ...
        assert sorted(f.name for f in tmp_path.glob("bye-*")) == ["bye-0-1", "bye-1-2"]
        assert all(fed.alive(f"supernode-{i}") for i in range(2))  # ... and new ones run
        assert fed.named["supernode-0"] is not first[0]
    finally:
        fed.close()
    assert fed.alive_groups() == []


def test_a_nodes_error_text_cannot_add_lines_to_the_servers_log(loopback, caplog):
    """A node's error text went into the ServerApp's log as it came: its line breaks forged
    log lines of their own (``WARNING partialfl: ...``) and its terminal escapes reached the
    operator's terminal. Each is now written as its escape, on the failure's one line."""
    pytest.importorskip("flwr")
    from _flower_sims import ls_run
    from flwr.app import Error, Message

    from partialfl.flower.client import app
    from partialfl.flower.report import short
    from partialfl.flower.server import run_server
    from partialfl.flower.text import printable

    forged = "bad\nWARNING partialfl: round 1: all is well\r\x1b[2J\u2028done"

    def hostile(msg, ctx):
        if ctx.node_config["partition-id"] == 1 and msg.metadata.message_type == "train":
            return Message(Error(0, forged), reply_to=msg)
        return app(msg, ctx)

    with caplog.at_level(logging.WARNING, logger="partialfl"):
        rep = run_server(loopback(2, client_app=hostile), ls_run(1))
    assert rep.failures and rep.failures[0].partition == 1
    logged = [r.getMessage() for r in caplog.records if "bad" in r.getMessage()]
    assert logged, "the node's failure was not logged"
    for text in logged + [f.reason for f in rep.failures]:
        assert not any(c in text for c in "\n\r\x1b\u2028"), repr(text)
        assert "bad\\nWARNING partialfl" in text and "\\x1b[2J" in text
    assert printable("a\tb\x00") == "a\\tb\\x00" and short("x\n" * 400).count("\n") == 0


def test_a_wire_format_error_is_one_bounded_line_whatever_it_quotes():
    """Round 44a: a refused reply's error quoted the node's record names in full (any
    length) and was logged so; every :class:`WireFormatError` now bounds its text."""
    pytest.importorskip("flwr")
    from partialfl.flower.codec import WireFormatError
    from partialfl.flower.text import MAX_REASON

    e = WireFormatError("reply records ['" + "A\n" * 100_000 + "'] are not expected")
    assert len(str(e)) <= MAX_REASON and "\n" not in str(e)
    assert str(e).startswith("reply records ['A\\nA") and str(e).endswith("not expected")
    assert str(WireFormatError("short")) == "short"
