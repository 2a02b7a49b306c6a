"""Flower fault handling (issue 13): a lost SuperNode is skipped and counted below
``max-failure-fraction`` and aborts the run with a reason above it; the ServerApp checkpoints
(safetensors + JSON, never pickle) and an interrupted run resumes to the same θ."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from partialfl.flower.config import ConfigError, parse_run_config  # noqa: E402
from partialfl.flower.server import FlowerRunReport, RunAborted, ServerStopped  # noqa: E402


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


def test_resume_refuses_another_configuration_and_damaged_files(flower_runs, tmp_path):
    from partialfl.flower import checkpoint

    run, _, _ = flower_runs["resumed"]
    other = parse_run_config({**run, "seed": 4})
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
    with pytest.raises(ConfigError, match="mode 'sync' only"):
        parse_run_config({"resume": True, "out-dir": "x", "mode": "async"})
    with pytest.raises(ConfigError, match="a server stop takes round"):
        parse_run_config({"fault-injection": "stop:partition=1,round=2"})
    with pytest.raises(ConfigError, match="max-failure-fraction"):
        parse_run_config({"max-failure-fraction": 1.5})
