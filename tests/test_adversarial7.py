"""Adversarial round 7 (issue 21): regression tests for what the seventh independent round
found."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from _flower_sims import ASYNC_2, ls_run  # noqa: E402
from test_faults_flower import _inflate  # noqa: E402

from partialfl.config import deep_merge  # noqa: E402


# -- a crafted asynchronous Flower checkpoint ----------------------------------------------
def _snap(m):
    """The asynchronous server's bookkeeping in a server file's skeleton."""
    return m["state"]["dict"]["server"]["dict"]["server"]["dict"]


def _jobs(m):
    return m["state"]["dict"]["server"]["dict"]["jobs"]["list"]


def _theta(fields):
    return fields["theta"]["dict"]["theta"]["tensor"]


def _set(get, key, value):
    return lambda m, t: get(m).__setitem__(key, value)


def _tensor(get, value):
    return lambda m, t: t.__setitem__(get(m), value)


def _job(m):
    return _jobs(m)[0]["tuple"][0]["tuple"]


ASYNC_CRAFTED = {
    "theta-nan": _tensor(lambda m: _theta(_snap(m)["state"]["fields"]), np.full(10, np.nan)),
    "theta-shape": _tensor(lambda m: _theta(_snap(m)["state"]["fields"]), np.zeros(3)),
    "theta-float32": _tensor(lambda m: _theta(_snap(m)["state"]["fields"]),
                             np.zeros(10, np.float32)),
    "busy-length": _tensor(lambda m: _snap(m)["busy"]["tensor"], np.zeros(7, bool)),
    "arrivals-huge": _set(_snap, "arrivals", 10**6),
    "arrivals-negative": _set(_snap, "arrivals", -5),
    "next-job-text": _set(_snap, "next_job", "x"),
    "time-nan": _set(_snap, "time", "nan"),
    "events-int": _set(_snap, "events", 5),
    "history-of-ints": _set(_snap, "history", {"list": [3]}),
    "round-negative": lambda m, t: _snap(m)["state"]["fields"].__setitem__("round", -3),
    "state-not-a-state": _set(_snap, "state", {"dict": {}}),
    "snapshot-key-missing": lambda m, t: _snap(m).pop("busy"),
    "jobs-int": lambda m, t: m["state"]["dict"]["server"]["dict"].__setitem__("jobs", 3),
    "job-arity": lambda m, t: _jobs(m)[0]["tuple"].__setitem__(0, {"tuple": [3, 0]}),
    "job-client-out-of-range": lambda m, t: _job(m).__setitem__(1, 99),
    "job-client-negative": lambda m, t: _job(m).__setitem__(1, -1),
    "job-slot-out-of-range": lambda m, t: _job(m).__setitem__(2, 7),
    "job-theta-nan": _tensor(lambda m: _theta(_jobs(m)[0]["tuple"][1]["fields"]),
                             np.full(10, np.nan)),
    "job-theta-shape": _tensor(lambda m: _theta(_jobs(m)[0]["tuple"][1]["fields"]),
                               np.zeros(3)),
}


@pytest.fixture(scope="module")
def async_template(tmp_path_factory):
    """An asynchronous run (two tasks in flight) stopped after server step 3 with its
    checkpoint: ``(run config without the stop, folder)``."""
    from _flower_loopback import LoopbackGrid
    from flwr.supercore.task_identity import TaskIdentity

    from partialfl.flower.server import ServerStopped, run_server

    out = tmp_path_factory.mktemp("async7") / "tmpl"
    run = ls_run(**ASYNC_2, checkpoint_every=1, out_dir=str(out))
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
            mp.setattr(TaskIdentity, name, value)
        with pytest.raises(ServerStopped):
            run_server(LoopbackGrid(2), {**run, "fault-injection": "stop:round=2"})
    return run, out


def _craft_async(folder: Path, edit) -> None:
    """Edit the server file of the asynchronous checkpoint in ``folder`` (its hash
    recorded in the pointer, so the edit reaches the checks behind it)."""
    from partialfl import io as pio
    from partialfl.flower.server import ASYNC_CHECKPOINT

    path = folder / ASYNC_CHECKPOINT
    _, ptr = pio.load_tensors(path)
    spath = folder / ptr["files"]["server"]["name"]
    tensors, meta = pio.load_tensors(spath)
    edit(meta, tensors)
    pio.save_tensors(spath, tensors, meta)
    ptr["files"]["server"]["sha256"] = _inflate(spath)
    pio.save_tensors(path, {}, ptr)


@pytest.mark.parametrize("variant", sorted(ASYNC_CRAFTED))
def test_crafted_async_checkpoint_is_one_line_refusal(variant, async_template, loopback,
                                                      tmp_path):
    """The asynchronous ServerApp's checkpoint was loaded unchecked (only its report was):
    θ = NaN resumed and trained on (a "resumed" run with θ NaN), θ of another shape or
    dtype aborted the run blaming the SuperNodes ("partitions lost: [0]"), arrivals = 10⁶
    ended the run at once as finished, a job's client -1 trained client 7, a sent θ of NaN
    was counted as the client's failure, and a dozen other edits ended the ServerApp in
    IndexError/TypeError/AttributeError/KeyError tracebacks. Now each is a CheckpointError
    (a ConfigError: one line, exit 2) naming the problem, as in synchronous mode."""
    from partialfl.flower.checkpoint import CheckpointError
    from partialfl.flower.server import run_server

    run, tmpl = async_template
    folder = tmp_path / "ck"
    shutil.copytree(tmpl, folder)
    _craft_async(folder, ASYNC_CRAFTED[variant])
    with pytest.raises(CheckpointError) as e:
        run_server(loopback(2), {**run, "out-dir": str(folder), "resume": True})
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)


def test_untouched_async_checkpoints_still_resume_fedbuff_and_adam(loopback, tmp_path):
    """The checks refuse nothing a real run writes: FedBuff (its buffer in the server
    state) and Adam (an optimizer state) resume to the uninterrupted θ."""
    from partialfl.flower.server import ServerStopped, run_server

    # FedBuff's rounds count applied updates (12 = 6 server steps of K = 2), as in process
    for i, extra in enumerate(({"rounds": 12,
                                "spec": {"asynchronous": {"rule": {"name": "fedbuff",
                                                                   "buffer": 2}}}},
                               {"spec": {"personalize": {"server": {"optimizer": "adam",
                                                                    "lr": 0.05}}}})):
        cfg = deep_merge(ASYNC_2, extra)
        full = run_server(loopback(2), ls_run(**cfg, out_dir=str(tmp_path / f"full{i}")))
        run = ls_run(**cfg, checkpoint_every=1, out_dir=str(tmp_path / f"r{i}"))
        with pytest.raises(ServerStopped):
            run_server(loopback(2), {**run, "fault-injection": "stop:round=2"})
        rep = run_server(loopback(2), {**run, "resume": True})
        assert rep.resumed_from == 3 and rep.server_steps == full.server_steps == 6
        np.testing.assert_array_equal(rep.theta["theta"], full.theta["theta"])


# -- a synchronous Flower checkpoint with counters out of range -----------------------------
def _sync_crafted():
    from test_faults_flower import _body, _extra, _fields

    return {
        "round-past-the-stage": lambda m, t: _fields(m).__setitem__("round", 10**6),
        "skipped-rounds-negative": lambda m, t: _extra(m).__setitem__("skipped_rounds", -5),
        "requested-negative": lambda m, t: _extra(m).__setitem__("requested", -5),
        "eval-withheld-negative": lambda m, t: _extra(m).__setitem__("eval_withheld", -3),
        "failure-out-of-range": lambda m, t: _extra(m).__setitem__("failures", {"list": [
            {"dict": {"round": -7, "kind": "error", "partition": -1,
                      "clients": {"list": [-4]}, "reason": "two\nlines"}}]}),
        "history-of-garbage": lambda m, t: _body(m).__setitem__(
            "history", {"list": [{"dict": {"round": "x", "eval_loss": "y"}}]}),
        "history-out-of-order": lambda m, t: _body(m)["history"]["list"].reverse(),
    }


@pytest.mark.parametrize("variant", sorted(_sync_crafted()))
def test_sync_checkpoint_counters_out_of_range_are_refused(variant, loopback, tmp_path):
    """Counters and records of a received synchronous checkpoint were checked for type
    only: round 10⁶ of a 4-round stage "resumed" as finished with 10⁶ server steps,
    skipped_rounds = -5 reported 9 server steps of 4, requested = -5 shrank the denominator
    of max-failure-fraction, and a history of garbage records (or reversed) replaced the
    run's own in result.json. Now each is one CheckpointError line."""
    from test_faults_flower import craft

    from partialfl.flower.checkpoint import CheckpointError
    from partialfl.flower.server import ServerStopped, run_server

    run = ls_run(4, checkpoint_every=1, out_dir=str(tmp_path))
    with pytest.raises(ServerStopped):
        run_server(loopback(2), {**run, "fault-injection": "stop:round=1"})
    craft(tmp_path, server=_sync_crafted()[variant])
    with pytest.raises(CheckpointError) as e:
        run_server(loopback(2), {**run, "resume": True})
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)


# -- FIFOs planted under a data file's name in a received data folder -----------------------
_fifo = pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")


@pytest.mark.timeout(30)
@_fifo
@pytest.mark.parametrize("planted", ["labels.txt", "acc_exp01_user01.txt"])
def test_a_fifo_in_a_hapt_folder_does_not_hang_the_loader(planted, tmp_path):
    """A received UCI HAPT ``RawData`` folder whose ``labels.txt`` (or an acc/gyro file) is
    a FIFO: ``load_hapt`` blocked for good in ``read_text`` waiting for a writer. Now the
    files are read through :func:`partialfl.io.open_regular`: one FileFormatError line."""
    import os

    from partialfl import io as pio
    from partialfl.data.har import load_hapt

    for name in ("acc_exp01_user01.txt", "gyro_exp01_user01.txt"):
        (tmp_path / name).write_text("0 0 0\n")
    (tmp_path / "labels.txt").write_text("1 1 1 0 1\n")
    (tmp_path / planted).unlink()
    os.mkfifo(tmp_path / planted)
    with pytest.raises(pio.FileFormatError, match="not a regular file"):
        load_hapt(tmp_path)


@pytest.mark.timeout(30)
@_fifo
def test_a_fifo_named_like_a_client_file_does_not_hang_the_folder_source(tmp_path):
    """The ``folder`` data source (one ``CLIENT.npz`` per client) of a received folder
    holding a FIFO named ``evil.npz``: ``np.load`` blocked for good. Now: a
    DataFormatError naming the file."""
    import os
    import types

    from _user_project import client_folder

    from partialfl.data.federated import DataFormatError
    from partialfl.data.sources import ArrayOptions, DataContext, folder

    root = client_folder(tmp_path / "clients", clients=3)
    os.mkfifo(root / "evil.npz")
    spec = types.SimpleNamespace(path=str(root), test_fraction=0.25, seed=0, holdout=0,
                                 num_clients=None)
    with pytest.raises(DataFormatError, match="evil.npz.*not a regular file"):
        folder(ArrayOptions(), DataContext(spec))


@pytest.mark.timeout(30)
@_fifo
def test_a_fifo_named_like_a_play_does_not_hang_the_complete_shakespeare(tmp_path):
    """The complete-Shakespeare corpus read from a plays folder holding a FIFO named
    ``x.md`` blocked for good. Now one FileFormatError line."""
    import os

    from partialfl import io as pio
    from partialfl.data.shakespeare_complete import complete_roles

    os.mkfifo(tmp_path / "x.md")
    with pytest.raises(pio.FileFormatError, match="not a regular file"):
        complete_roles(tmp_path)


@pytest.mark.timeout(30)
@_fifo
def test_a_fifo_as_init_from_does_not_hang_the_server_app(tmp_path):
    """Run-config key ``init-from`` naming a FIFO (a received stage-1 folder's
    ``theta.npz``): the ServerApp blocked for good in ``np.load``. Now one ConfigError
    line naming the key."""
    import os
    import types

    from partialfl.flower.config import ConfigError
    from partialfl.flower.stage import _stage1_params

    os.mkfifo(tmp_path / "theta.npz")
    entry = types.SimpleNamespace(trait=lambda name: False)
    cfg = types.SimpleNamespace(init_from=str(tmp_path / "theta.npz"), run=types.SimpleNamespace(
        method=types.SimpleNamespace(entry=entry), stage1_seed=0, seed=0))
    with pytest.raises(ConfigError, match="'init-from'.*not a regular file"):
        _stage1_params(cfg, None)


# -- one-client parameter binding ----------------------------------------------------------
def test_call_with_restores_every_slot_when_the_forward_deletes_a_buffer_and_raises():
    """A forward that deletes one of its buffers and then raises: ``call_with``'s restore
    loop raised KeyError on the deleted slot — masking the forward's own error — and
    stopped there, leaving this client's ``lin.weight`` and ``lin.bias`` bound in the
    module for the next call. Now every slot gets its own tensor back, and the forward's
    error is the one raised (as with ``torch.func.functional_call``)."""
    import torch

    from partialfl.problems.model.kernels import call_with, member_slots

    class DropsBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.register_buffer("b", torch.ones(2))

        def forward(self, x):
            del self.b
            raise RuntimeError("forward failed")

    m = DropsBuffer()
    before = {n: t for n, t in [*m.named_parameters(), *m.named_buffers()]}
    client = {n: torch.randn_like(t) for n, t in before.items()}
    with pytest.raises(RuntimeError, match="forward failed"):
        call_with(m, member_slots(m), client, torch.randn(4, 3))
    after = {n: t for n, t in [*m.named_parameters(), *m.named_buffers()]}
    assert set(after) == set(before) and all(after[n] is before[n] for n in before)


def test_a_component_given_as_none_round_trips_like_an_omitted_one():
    """Found by the config fuzz suite this round: ``{"attack": {"attack": None}}``
    validated to an attack block whose ``attack`` was None, which ``to_dict`` then wrote
    as omitted, so the spec read back differed from the one written (the default
    ``none`` component). Now a None for a component with a default is that default."""
    from partialfl.spec import RunSpec

    spec = RunSpec.from_dict({"attack": {"attack": None}})
    assert RunSpec.from_dict(spec.to_dict()) == spec == RunSpec.from_dict({"attack": {}})
