"""Flower fault handling (issue 13): a lost SuperNode is skipped and counted below
``max-failure-fraction`` and aborts the run with a reason above it; the ServerApp checkpoints
(the runtime's codec: safetensors + JSON, never pickle, one pointer switched atomically) and an
interrupted run resumes to the same θ, also after a kill between its files; a crafted
checkpoint is refused with one line (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from _flower_sims import ls_run  # noqa: E402

from partialfl.config import deep_merge  # noqa: E402
from partialfl.flower.checkpoint import SYNC_CHECKPOINT  # noqa: E402
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
    ckpt = [f for f in files if f.startswith("checkpoint")]
    assert len(ckpt) == 2 and SYNC_CHECKPOINT in ckpt, files  # the pointer, one generation
    assert _checkpoint(parse_run_config(run)).codec.load().progress == {"round": 4}
    assert not [f for f in files if f.endswith((".pkl", ".pt", ".pickle", ".tmp"))]
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
    from partialfl.flower.checkpoint import CheckpointError

    run, _, _ = flower_runs["async-resumed"]
    with pytest.raises(CheckpointError, match="seed"):  # one line, as in synchronous mode
        async_checkpoint(parse_run_config(_reseeded(run))).load()
    _, err, _ = flower_runs["async-missing"]
    assert isinstance(err, ConfigError) and "no checkpoint at" in str(err)


ADAM_SPEC = {"personalize": {"server": {"optimizer": "adam", "lr": 0.05}}}


def _reseeded(run: dict) -> dict:
    return {**run, "spec": deep_merge(run["spec"], {"seed": 4})}


def _checkpoint(cfg):
    """The ServerApp's checkpoint of run config ``cfg`` (a fresh state and report)."""
    from partialfl.build import build
    from partialfl.flower.checkpoint import FlowerCheckpoint

    built = build(cfg.run)
    fresh = built.algorithm.init(built.problem, built.problem.init_theta())
    return FlowerCheckpoint(cfg, FlowerRunReport({}, fresh.theta), fresh)


def test_resume_refuses_another_configuration_and_damaged_files(flower_runs, tmp_path):
    run, _, _ = flower_runs["resumed"]
    other = parse_run_config(_reseeded(run))
    with pytest.raises(ConfigError, match="refusing to resume: .*seed: 3 in the checkpoint, 4 now"):
        _checkpoint(other).load()
    # a damaged generation file is refused by its hash
    src = Path(run["out-dir"])
    dst = tmp_path / "copy"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = parse_run_config({**run, "out-dir": str(dst)})
    ck = _checkpoint(cfg)
    state, _, history, _, _ = ck.load()
    assert state.round == 4 and ck.report.resumed_from == 4 and len(history) == 5
    (server,) = dst.glob("checkpoint.g*.server.safetensors")
    server.write_bytes(server.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ConfigError, match="does not match its SHA-256"):
        _checkpoint(cfg).load()
    (dst / SYNC_CHECKPOINT).write_text("{not a pointer")
    with pytest.raises(ConfigError, match="truncated or not a safetensors file"):
        _checkpoint(cfg).load()
    with pytest.raises(ConfigError, match="no checkpoint at"):
        _checkpoint(parse_run_config({**run, "out-dir": str(tmp_path / "none")})).load()


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


# -- crafted checkpoint files: one line, never a traceback (issue 21) -----------------------
def craft(folder: Path, pointer=None, server=None) -> None:
    """Rewrite the checkpoint in ``folder``: ``server(meta, tensors)`` edits the server file
    (its metadata: the state skeleton, ``meta["state"]``; its tensors), whose new SHA-256 the
    pointer then records, so the edit reaches the checks behind the hash; then
    ``pointer(meta)`` edits the pointer's metadata."""
    from partialfl import io as pio

    path = folder / SYNC_CHECKPOINT
    _, ptr = pio.load_tensors(path)
    if server is not None:
        spath = folder / ptr["files"]["server"]["name"]
        tensors, meta = pio.load_tensors(spath)
        server(meta, tensors)
        pio.save_tensors(spath, tensors, meta)
        ptr["files"]["server"]["sha256"] = _inflate(spath)
    if pointer is not None:
        pointer(ptr)
    pio.save_tensors(path, {}, ptr)


def _body(meta: dict) -> dict:
    """The server part's skeleton in a server file's metadata: ``{name: skeleton}``."""
    return meta["state"]["dict"]["server"]["dict"]


def _fields(meta: dict) -> dict:
    """The server state's fields (θ, opt_state, round, extra) in a server file's skeleton."""
    return _body(meta)["state"]["fields"]


def _extra(meta: dict) -> dict:
    """The saved report (the transport's ``extra``) in a server file's skeleton."""
    return meta["state"]["dict"]["extra"]["dict"]


def _put(key, value):
    """Set the pointer's ``key`` to ``value``."""
    return lambda m: m.__setitem__(key, value)


DEEP = "DEEP"  # in a skeleton: replaced by JSON nested 6000 deep (json.dumps cannot write it)


def _inflate(path: Path) -> str:
    """Replace the string :data:`DEEP` in the safetensors metadata of ``path`` by JSON
    nested 6000 deep; returns the file's SHA-256."""
    import hashlib
    import struct

    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    deep = ('{"dict": {"a": ' * 3000 + "null" + "}}" * 3000).replace('"', '\\"')
    header = data[8:8 + n].rstrip().replace(b'\\"DEEP\\"', deep.encode())
    header += b" " * (-len(header) % 8)
    data = struct.pack("<Q", len(header)) + header + data[8 + n:]
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()

CRAFTED = {
    "pointer-fingerprint-not-a-dict": {"pointer": _put("fingerprint", [1])},
    "pointer-files-not-a-dict": {"pointer": _put("files", 5)},
    "pointer-no-server-file": {"pointer": _put("files", {})},
    "pointer-file-outside": {"pointer": lambda m: m["files"]["server"].__setitem__(
        "name", "../checkpoint.safetensors")},
    "pointer-sha-not-a-string": {"pointer": lambda m: m["files"]["server"].__setitem__(
        "sha256", 5)},
    "pointer-kind-async": {"pointer": _put("kind", "async")},
    "pointer-other-generation": {"pointer": _put("generation", 99)},
    "pointer-progress-a-list": {"pointer": _put("progress", [])},
    "server-not-a-run-state": {"server": lambda m, t: _body(m).pop("history")},
    "state-not-a-server-state": {"server": lambda m, t: _body(m).__setitem__(
        "state", {"dict": {}})},
    "state-unknown-class": {"server": lambda m, t: _body(m)["state"].__setitem__(
        "dataclass", "Popen")},
    "missing-tensor": {"server": lambda m, t: _fields(m)["theta"]["dict"].__setitem__(
        "theta", {"tensor": "t99", "device": None})},
    "deep-state": {"server": lambda m, t: _fields(m).__setitem__("extra", DEEP)},
    "failures-malformed": {"server": lambda m, t: _extra(m).__setitem__(
        "failures", {"list": [{"dict": {"x": 1}}]})},
    "report-empty": {"server": lambda m, t: m["state"]["dict"].__setitem__(
        "extra", {"dict": {}})},
    "round-not-int": {"server": lambda m, t: _fields(m).__setitem__("round", "x")},
    "grad-evals-bool": {"server": lambda m, t: _body(m).__setitem__("grad_evals", True)},
    "faults-not-ints": {"server": lambda m, t: _body(m).__setitem__(
        "faults", {"dict": {"clients_failed": "x"}})},
    "history-not-a-list": {"server": lambda m, t: _body(m).__setitem__("history", 3)},
    "client-state-present": {"server": lambda m, t: m["state"]["dict"].__setitem__(
        "client", {"dict": {"w": 1}})},
    "theta-wrong-shape": {"server": lambda m, t: t.__setitem__(
        _fields(m)["theta"]["dict"]["theta"]["tensor"], np.zeros(3))},
    "theta-nan": {"server": lambda m, t: t.__setitem__(
        _fields(m)["theta"]["dict"]["theta"]["tensor"], np.full(10, np.nan))},
}


@pytest.mark.parametrize("variant", sorted(CRAFTED))
def test_crafted_checkpoint_is_one_line_refusal(variant, loopback, tmp_path):
    """Resuming from a crafted checkpoint (its pointer, or its server file with the hash
    matching) raises CheckpointError (a ConfigError: one line, exit 2 on the command line)
    naming the problem — never KeyError, TypeError, RecursionError, nor a resumed run with a
    θ of another shape or NaN."""
    from partialfl.flower.checkpoint import CheckpointError
    from partialfl.flower.server import run_server

    run = ls_run(2, checkpoint_every=1, out_dir=str(tmp_path))
    run_server(loopback(2), run)
    craft(tmp_path, **CRAFTED[variant])
    with pytest.raises(CheckpointError) as e:
        run_server(loopback(2), {**run, "resume": True})
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)


# -- a kill between the checkpoint's files (issue 26 item 4) --------------------------------
def _run_and_resume(loopback, run: dict, crash) -> FlowerRunReport | None:
    """Run ``run`` until ``crash`` kills it (None: no kill came), then resume it; the resumed
    report, or None when the kill came before the first checkpoint was committed (resuming
    is then refused with one line: there is nothing to resume)."""
    from test_checkpoint import _Killed

    from partialfl.flower.checkpoint import CheckpointError
    from partialfl.flower.server import run_server

    try:
        with crash():
            run_server(loopback(2), run)
    except _Killed:
        pass
    try:
        return run_server(loopback(2), {**run, "resume": True})
    except CheckpointError as e:
        assert "no checkpoint at" in str(e)
        return None


def _only_one_generation(out: Path) -> None:
    files = sorted(p.name for p in out.iterdir()
                   if p.name.startswith(("checkpoint", ".checkpoint")))
    assert len(files) == 2 and SYNC_CHECKPOINT in files, files  # no temp file, no stale one


def test_a_kill_after_the_tensors_before_the_pointer_resumes(loopback, tmp_path, monkeypatch):
    """The ServerApp killed after writing round 2's checkpoint tensors (its generation's
    server file) but before switching the pointer: the pointer still names round 1's
    complete generation, the run resumes from it to the uninterrupted θ, and the orphaned
    generation is removed."""
    import contextlib

    from test_checkpoint import _Killed

    from partialfl import io as pio
    from partialfl.flower.server import run_server
    from partialfl.runtime import checkpoint as codec

    run = ls_run(3, 4, spec=ADAM_SPEC, checkpoint_every=1, out_dir=str(tmp_path / "run"))
    full = run_server(loopback(2), {**run, "out-dir": str(tmp_path / "full")})
    written: list[str] = []
    save = pio.save_tensors

    def killing_save(path, tensors, metadata=None):
        if Path(path).name == SYNC_CHECKPOINT and metadata["generation"] == 2:
            written.extend(sorted(p.name for p in Path(path).parent.glob("checkpoint.g*")))
            raise _Killed  # the generation's file is written and synced; the pointer is not
        return save(path, tensors, metadata)

    @contextlib.contextmanager
    def crash():
        with monkeypatch.context() as m:
            m.setattr(codec.pio, "save_tensors", killing_save)
            yield

    resumed = _run_and_resume(loopback, run, crash)
    assert written == ["checkpoint.g1.server.safetensors", "checkpoint.g2.server.safetensors"]
    assert resumed is not None and resumed.resumed_from == 1 and resumed.server_steps == 3
    np.testing.assert_array_equal(resumed.theta["theta"], full.theta["theta"])
    _only_one_generation(tmp_path / "run")


def test_a_kill_at_any_file_operation_of_the_checkpointing_resumes(loopback, tmp_path,
                                                                   monkeypatch):
    """Kill the ServerApp at every file operation (open, fsync, chmod, rename, unlink) of a
    checkpointed run in turn: each time the resumed run reaches the uninterrupted θ (or,
    killed before the first commit, resuming is refused with one line), and the out-dir
    holds the pointer and one generation only — no temp file of the killed write, no stale
    generation. (The old two-file checkpoint left the temp files of killed writes behind.)"""
    import contextlib

    from test_checkpoint import _Crash

    from partialfl.flower.server import run_server

    run = ls_run(2, 4, checkpoint_every=1)
    full = run_server(loopback(2), {**run, "checkpoint-every": 0})

    @contextlib.contextmanager
    def counting():
        with monkeypatch.context() as m:
            yield _Crash(m, tmp_path / "dry")

    with counting() as count:
        run_server(loopback(2), {**run, "out-dir": str(tmp_path / "dry")})
    total = count.n
    assert total >= 2 * 12  # two checkpoints (and the result files)
    resumed = 0
    for at in range(total):
        out = tmp_path / f"at{at}"

        @contextlib.contextmanager
        def crash(out=out, at=at):
            with monkeypatch.context() as m:
                _Crash(m, out, at)
                yield

        rep = _run_and_resume(loopback, {**run, "out-dir": str(out)}, crash)
        if rep is None:
            continue
        resumed += 1
        assert rep.server_steps == 2, at
        np.testing.assert_array_equal(rep.theta["theta"], full.theta["theta"])
        _only_one_generation(out)
    assert resumed >= total - 12
