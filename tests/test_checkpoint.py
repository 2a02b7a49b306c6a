"""The checkpoint codec (issue 21 item 4): a kill at any instant leaves a resumable run equal
to the uninterrupted one; stale temp files and unreferenced generations are cleaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import SMALL

from partialfl import io as pio
from partialfl.algorithms import Scaffold
from partialfl.algorithms.asynchronous import FedBuff
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import run_rounds
from partialfl.runtime.asynchronous import ComputeTimeModel, Distribution, run_async
from partialfl.runtime.checkpoint import CLIENT, SERVER, Checkpoint, ResumeError


class _Killed(BaseException):
    """The simulated kill: not an Exception, so no cleanup handler of the code swallows it."""


class _Crash:
    """Counts the file operations (os.open under ``root``, os.fsync, os.fchmod, os.replace,
    os.unlink) and kills the process at operation ``at``: it and every later one raise, so
    not even a cleanup runs (as after a kill -9)."""

    def __init__(self, monkeypatch, root, at=None):
        self.n, self.at, self.root, self.dead = 0, at, str(root), False
        for name in ("open", "fsync", "fchmod", "replace", "unlink"):
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name), name == "open"))

    def _wrap(self, fn, only_root):
        def op(*a, **k):
            if only_root and not str(a[0]).startswith(self.root):
                return fn(*a, **k)
            if self.dead or self.n == self.at:
                self.dead = True
                raise _Killed
            self.n += 1
            return fn(*a, **k)

        return op


def _sync(p, ckpt=None, resume=False, rounds=2):
    kw = {} if ckpt is None else dict(checkpoint=ckpt, checkpoint_every=1, resume=resume)
    return run_rounds(p, Scaffold(3), rounds, clients_per_round=3, seed=1,
                      evaluate=lambda *a: {"n": float(a[1].round)}, **kw)


def _same(a, b, trees=("theta",)):
    for n in a.state.theta:
        np.testing.assert_array_equal(a.state.theta[n], b.state.theta[n])
    for n in a.client_state or {}:
        np.testing.assert_array_equal(a.client_state[n], b.client_state[n])
    strip = [{k: v for k, v in h.items() if k != "time"} for h in a.history]
    assert strip == [{k: v for k, v in h.items() if k != "time"} for h in b.history]


def _left(folder):
    return sorted(f.name for f in folder.iterdir())


def test_a_crash_between_any_two_file_operations_leaves_a_resumable_run(tmp_path,
                                                                        monkeypatch):
    """Crash the synchronous loop's checkpointing at every file operation in turn; each time
    the resumed run is the uninterrupted one (θ, client state, history), and afterwards the
    folder holds the pointer and one generation only: no temp file, no stale generation.
    (The old format wrote the client-side file first: a kill before the server file made
    resuming refuse, the stage was lost.)"""
    p = LeastSquaresProblem(SMALL, basis="standard")
    full = _sync(p)
    with monkeypatch.context() as m:
        count = _Crash(m, tmp_path)
        _sync(p, tmp_path / "dry" / "run.ckpt")
    total = count.n
    assert total >= 2 * 14  # 2 checkpoints, each 3 files written, renamed, synced
    for at in range(total):
        d = tmp_path / f"at{at}"
        with monkeypatch.context() as m, pytest.raises(_Killed):
            _Crash(m, d, at)
            _sync(p, d / "run.ckpt")
        res = _sync(p, d / "run.ckpt", resume=True)
        _same(res, full)
        g = Checkpoint(d / "run.ckpt").files()
        assert _left(d) == sorted(["run.ckpt", g[SERVER].name, g[CLIENT].name]), at


def test_a_crash_in_the_asynchronous_loop_leaves_a_resumable_run(tmp_path, monkeypatch):
    p = LeastSquaresProblem(SMALL, basis="standard")
    kw = dict(steps=5, concurrency=3, seed=2, eval_every=2,
              compute_time=ComputeTimeModel(Distribution("exponential", 1.0)))

    def run(ck=None, resume=False):
        ckw = {} if ck is None else dict(checkpoint=ck, checkpoint_every=2, resume=resume)
        return run_async(p, FedBuff(Scaffold(tau=2), buffer_size=2), **kw, **ckw)

    full = run()
    with monkeypatch.context() as m:
        count = _Crash(m, tmp_path)
        run(tmp_path / "dry" / "a.ckpt")
    for at in range(0, count.n, 3):
        d = tmp_path / f"at{at}"
        with monkeypatch.context() as m, pytest.raises(_Killed):
            _Crash(m, d, at)
            run(d / "a.ckpt")
        res = run(d / "a.ckpt", resume=True)
        _same(res, full)
        assert res.events == full.events
        assert not [f for f in _left(d) if f.endswith(".tmp")]


_WRITER = """
import sys
import numpy as np
from partialfl.runtime.checkpoint import Checkpoint
ck = Checkpoint(sys.argv[1], {"run": 1})
g = 0
while True:
    g += 1
    x = np.full(1_500_000, float(g))
    ck.save({"g": g, "x": x}, {"g": g, "y": x[:300_000]}, progress={"g": g})
    print(g, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_real_kill_9_during_a_checkpoint_write(tmp_path):
    """A process writing checkpoints in a loop is killed with SIGKILL while a temp file of
    its next generation exists (mid-write); the checkpoint loads, both parts of one
    generation, and opening it removes the leftovers."""
    path = tmp_path / "k.ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(5):  # the temp file seen may be renamed before the kill lands: again
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], env=env,
                                stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"1"  # one generation committed
            deadline = time.monotonic() + 60
            while not any(f.name.endswith(".tmp") for f in tmp_path.iterdir()):
                assert time.monotonic() < deadline and proc.poll() is None
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(10)
        if any(f.name.endswith(".tmp") for f in tmp_path.iterdir()):
            break
    assert any(f.name.endswith(".tmp") for f in tmp_path.iterdir())  # killed mid-write
    saved = Checkpoint(path, {"run": 1}).load()
    g = saved.server["g"]
    assert g >= 1 and saved.client["g"] == g and saved.progress == {"g": g}
    assert (saved.server["x"] == g).all() and (saved.client["y"] == g).all()
    assert _left(tmp_path) == sorted(["k.ckpt", f"k.g{g}.server.ckpt",
                                      f"k.g{g}.client-side.ckpt"])


def test_stale_files_are_cleaned_and_foreign_ones_kept(tmp_path):
    ck = Checkpoint(tmp_path / "run.ckpt")
    for name in (".run.ckpt.abc_12.tmp", ".run.g7.server.ckpt.x1y2z3.tmp", "run.g7.server.ckpt",
                 "run.g9.client-side.ckpt", "run.txt", ".other.ckpt.abc.tmp", "run.g1.ckpt"):
        (tmp_path / name).write_bytes(b"junk")
    assert ck.load() is None
    assert _left(tmp_path) == [".other.ckpt.abc.tmp", "run.g1.ckpt", "run.txt"]
    assert ck.save({"a": 1}, {"b": np.ones(2)}, extra={"report": [1, 2]}) == 1
    assert ck.save({"a": 2}, None) == 2  # no client part this time: no client-side file
    assert _left(tmp_path) == [".other.ckpt.abc.tmp", "run.ckpt", "run.g1.ckpt",
                               "run.g2.server.ckpt", "run.txt"]
    got = ck.load()
    assert got.server == {"a": 2} and got.client is None and got.generation == 2


def test_the_transport_bookkeeping_and_progress_travel_with_the_generation(tmp_path):
    ck = Checkpoint(tmp_path / "f.safetensors", {"cfg": "x"}, kind="flower")
    ck.save({"theta": np.arange(3.0)}, extra={"failures": [{"node": 2}], "step": 4},
            progress={"round": 4})
    got = Checkpoint(tmp_path / "f.safetensors", {"cfg": "x"}, kind="flower").load()
    assert got.extra == {"failures": [{"node": 2}], "step": 4} and got.progress == {"round": 4}
    with pytest.raises(ResumeError, match="cfg: 'x' in the checkpoint, 'y' now"):
        Checkpoint(tmp_path / "f.safetensors", {"cfg": "y"}, kind="flower").load()
    with pytest.raises(pio.FileFormatError, match="'flower' run, not a 'sync' one"):
        Checkpoint(tmp_path / "f.safetensors").load()


def test_a_damaged_or_foreign_generation_file_is_refused(tmp_path):
    ck = Checkpoint(tmp_path / "c.ckpt")
    ck.save({"a": np.ones(4)}, {"w": np.ones(4)})
    f = ck.files()[CLIENT]
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(pio.FileFormatError, match="does not match its SHA-256"):
        ck.load()
    ptr, meta = pio.load_tensors(tmp_path / "c.ckpt")
    meta["files"][SERVER]["name"] = "../../etc/hostname"
    pio.save_tensors(tmp_path / "c.ckpt", ptr, meta)
    with pytest.raises(pio.FileFormatError, match="foreign file"):
        ck.load()
