"""Flower fault handling (issue 13): a lost SuperNode is skipped and counted below
``max-failure-fraction`` and aborts the run with a reason above it; the ServerApp checkpoints
(safetensors + JSON, never pickle) and an interrupted run resumes to the same θ; a crafted
checkpoint is refused with one line (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from _flower_sims import ls_run  # noqa: E402

from partialfl.config import deep_merge  # noqa: E402
from partialfl.flower.config import ConfigError, parse_run_config  # noqa: E402
from partialfl.flower.server import (  # noqa: E402
    ASYNC_CHECKPOINT,
    FlowerRunReport,
    RunAborted,
    ServerStopped,
    async_checkpoint,
)


def test_lost_supernode_is_skipped_counted_and_recorded(flower_runs):
    run, report, _ = flower_runs["lost"]
    assert isinstance(report, FlowerRunReport) and not report.aborted
    assert report.server_steps == 3 and report.failed_client_updates == 8
    assert report.requested_client_updates == 24 and report.lost_partitions == [1]
    res = json.loads((Path(run["out-dir"]) / "result.json").read_text())
    assert res["summary"]["lost_partitions"] == [1]
    assert res["summary"]["failure_counts"] == {"error": 2}
    assert np.isfinite(report.theta["theta"]).all()


def test_too_many_failures_abort_with_a_reason(flower_runs):
    run, err, _ = flower_runs["abort"]
    assert isinstance(err, RunAborted)
    assert "8 of 24 requested client updates failed (33% > max-failure-fraction 0.3)" in str(err)
    res = json.loads((Path(run["out-dir"]) / "result.json").read_text())
    assert res["summary"]["aborted"] is True and "max-failure-fraction" in \
        res["summary"]["stopped_early"]
    assert res["summary"]["lost_partitions"] == [1]


def test_interrupted_run_resumes_to_the_same_theta(flower_runs):
    _, full, _ = flower_runs["full"]
    run, err, _ = flower_runs["interrupted"]
    assert isinstance(err, ServerStopped)
    _, resumed, _ = flower_runs["resumed"]
    assert isinstance(resumed, FlowerRunReport) and resumed.resumed_from == 2
    assert resumed.server_steps == full.server_steps == 4
    np.testing.assert_array_equal(resumed.theta["theta"], full.theta["theta"])
    files = sorted(p.name for p in Path(run["out-dir"]).iterdir())
    assert "checkpoint.json" in files and "checkpoint-4.safetensors" in files
    assert not [f for f in files if f.endswith((".pkl", ".pt", ".pickle"))]
    assert [h["round"] for h in resumed.history] == [h["round"] for h in full.history]


def test_interrupted_async_run_resumes_to_the_same_theta(flower_runs):
    """Asynchronous mode with one task in flight is sequential, hence deterministic given the
    seed: the run stopped after server step 3 (checkpoint every step) and resumed is the
    uninterrupted one — same θ, same number of steps, the same records."""
    _, full, _ = flower_runs["async-full"]
    run, err, _ = flower_runs["async-interrupted"]
    assert isinstance(err, ServerStopped) and "server step 3" in str(err)
    _, resumed, _ = flower_runs["async-resumed"]
    assert isinstance(full, FlowerRunReport) and isinstance(resumed, FlowerRunReport)
    assert resumed.resumed_from == 3 and full.resumed_from == -1
    assert resumed.server_steps == full.server_steps == 6
    assert np.isfinite(resumed.theta["theta"]).all()
    np.testing.assert_allclose(resumed.theta["theta"], full.theta["theta"], rtol=0, atol=1e-6)
    assert [h["step"] for h in resumed.history] == [h["step"] for h in full.history] == \
        list(range(7))
    assert resumed.requested_client_updates == full.requested_client_updates
    files = sorted(p.name for p in Path(run["out-dir"]).iterdir())
    assert ASYNC_CHECKPOINT in files and "result.json" in files
    assert not [f for f in files if f.endswith((".pkl", ".pt", ".pickle"))]


def test_async_resume_sends_the_task_in_flight_again_and_applies_no_task_twice(flower_runs):
    """Two tasks in flight: which reply arrives first depends on the SuperNodes' timing, so
    θ is not compared with another run. What does not depend on timing: at the checkpoint of
    step 3 one task (dispatched before) is in flight; the resumed run sends it again and
    applies it after step 3, applies no task twice, and ends after the same number of steps
    with its records continuing from the checkpoint's step."""
    run, err, _ = flower_runs["async2-interrupted"]
    assert isinstance(err, ServerStopped)
    _, resumed, _ = flower_runs["async2-resumed"]
    assert isinstance(resumed, FlowerRunReport) and resumed.resumed_from == 3
    assert resumed.server_steps == 6 and np.isfinite(resumed.theta["theta"]).all()
    assert [h["step"] for h in resumed.history] == list(range(7))
    snap, _, in_flight = async_checkpoint(parse_run_config(run)).load()  # the final one
    assert snap["arrivals"] == 6 and len(in_flight) == 1  # the other slot's task
    jobs = [int(row[0]) for row in snap["rows"]]
    assert len(jobs) == len(set(jobs)) == 6  # no task applied twice
    # jobs 0..3 were dispatched before the stop (2 at the start, 1 after each of the first
    # 2 arrivals; the 3rd arrival's checkpoint came before its relaunch): the one of them
    # not applied by step 3 was in flight, sent again, and applied after the resume
    assert sorted(jobs[:3] + [j for j in jobs[3:] if j < 4]) == [0, 1, 2, 3]
    assert len([j for j in jobs[3:] if j < 4]) == 1


def test_async_resume_refuses_another_configuration_and_a_missing_checkpoint(flower_runs):
    from partialfl.runtime.sync import ResumeError

    run, _, _ = flower_runs["async-resumed"]
    with pytest.raises(ResumeError, match="seed"):
        async_checkpoint(parse_run_config(_reseeded(run))).load()
    _, err, _ = flower_runs["async-missing"]
    assert isinstance(err, ConfigError) and "no checkpoint at" in str(err)


def _reseeded(run: dict) -> dict:
    return {**run, "spec": deep_merge(run["spec"], {"seed": 4})}


def test_resume_refuses_another_configuration_and_damaged_files(flower_runs, tmp_path):
    from partialfl.flower import checkpoint

    run, _, _ = flower_runs["resumed"]
    other = parse_run_config(_reseeded(run))
    with pytest.raises(ConfigError, match="seed: checkpoint 3 vs now 4"):
        checkpoint.load(other)
    # a damaged tensor file is refused by its hash
    src = Path(run["out-dir"])
    dst = tmp_path / "copy"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = parse_run_config({**run, "out-dir": str(dst)})
    state, nxt, _ = checkpoint.load(cfg)
    assert nxt == 4 and state.round == 4
    tensors = next(dst.glob("checkpoint-*.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ConfigError, match="does not match its SHA-256"):
        checkpoint.load(cfg)
    (dst / "checkpoint.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        checkpoint.load(cfg)
    with pytest.raises(ConfigError, match="no checkpoint at"):
        checkpoint.load(parse_run_config({**run, "out-dir": str(tmp_path / "none")}))


def test_checkpoint_keys_are_validated():
    with pytest.raises(ConfigError, match="need 'out-dir'"):
        parse_run_config({"checkpoint-every": 2})
    # both modes checkpoint and resume (async: every k server steps)
    assert parse_run_config({"resume": True, "out-dir": "x", "spec": {
        "asynchronous": {"rule": "fedasync"}}}).resume
    with pytest.raises(ConfigError, match="a server stop takes round"):
        parse_run_config({"fault-injection": "stop:partition=1,round=2"})
    with pytest.raises(ConfigError, match="max_failure_fraction must be in"):
        parse_run_config({"spec": {"max_failure_fraction": 1.5}})


# -- crafted checkpoint.json: one line, never a traceback (issue 21) ------------------------
def _rewrite_tensors(d: Path, meta: dict, arrays: dict) -> None:
    import hashlib

    from safetensors.numpy import save

    blob = save(arrays)
    (d / meta["tensors"]).write_bytes(blob)
    meta["sha256"] = hashlib.sha256(blob).hexdigest()


DEEP = '{"dict": {"a": ' * 3000 + '{"value": 1}' + "}}" * 3000  # JSON nested 6000 deep


CRAFTED = {
    "config-not-a-dict": lambda d, m: m.__setitem__("config", []),
    "no-tensors-entry": lambda d, m: m.pop("tensors"),
    "tensors-not-a-name": lambda d, m: m.__setitem__("tensors", 5),
    "tensors-outside": lambda d, m: m.__setitem__("tensors", "../checkpoint.json"),
    "missing-array": lambda d, m: m["state"]["theta"]["dict"].__setitem__(
        "theta", {"array": "nope"}),
    "state-not-a-tree": lambda d, m: m.__setitem__("state", {"theta": 1}),
    "deep-state": lambda d, m: m["state"].__setitem__("extra", "DEEP"),
    "failures-malformed": lambda d, m: m["report"].__setitem__("failures", [{"x": 1}]),
    "report-empty": lambda d, m: m.__setitem__("report", {}),
    "round-not-int": lambda d, m: m.__setitem__("state_round", "x"),
    "next-round-bool": lambda d, m: m.__setitem__("next_round", True),
    "faults-not-ints": lambda d, m: m["report"].__setitem__("faults", {"clients_failed": "x"}),
    "theta-wrong-shape": lambda d, m: _rewrite_tensors(d, m, {"theta/theta": np.zeros(3)}),
    "theta-nan": lambda d, m: _rewrite_tensors(d, m, {"theta/theta": np.full(10, np.nan)}),
}


@pytest.mark.parametrize("variant", sorted(CRAFTED))
def test_crafted_checkpoint_json_is_one_line_refusal(variant, loopback, tmp_path):
    """Resuming from a crafted ``checkpoint.json`` raises CheckpointError (a ConfigError:
    one line, exit 2 on the command line) naming the problem — never KeyError, TypeError,
    RecursionError, nor a resumed run with a θ of another shape or NaN."""
    from partialfl.flower import checkpoint
    from partialfl.flower.server import run_server

    run = ls_run(2, checkpoint_every=1, out_dir=str(tmp_path))
    run_server(loopback(2), run)
    path = tmp_path / "checkpoint.json"
    meta = json.loads(path.read_text())
    CRAFTED[variant](tmp_path, meta)
    path.write_text(json.dumps(meta).replace('"DEEP"', DEEP))
    with pytest.raises(checkpoint.CheckpointError) as e:
        run_server(loopback(2), {**run, "resume": True})
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
