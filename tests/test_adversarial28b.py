"""Adversarial round 28b (issue 21 areas 1, 3, 8, tried again from scratch): the defects
found.

Each test failed on the code it was written against (main at cabae21) because of the defect
it names, and passes since the fix. (A process a client forks itself outlives a killed
parent: a client's own processes are its own to end — ``client_update`` is pure and starts
nothing that outlives it; not tested here.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

# -- area 1: workers (or their children) outliving a parent killed with SIGKILL -------------
_CLIENT = '''
import os, time
from partialfl.algorithms.ffgg import FFGG


class Hostile(FFGG):
    """Every client writes its pid to a file, then either holds the GIL in one long C call
    (``gil``) or forks a child that computes on (``fork``)."""

    def __init__(self, *a, folder, mode, **k):
        super().__init__(*a, **k)
        self.folder, self.mode = folder, mode

    def _mark(self):
        with open(os.path.join(self.folder, f"{os.getpid()}.pid"), "w") as f:
            f.write(self.mode)

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        self._mark()
        if self.mode == "gil":
            3 ** (10 ** 8)  # one C call (big-int power) holding the GIL for about a minute
        else:
            if os.fork() == 0:
                self._mark()
                time.sleep(60)
                os._exit(0)
            time.sleep(60)
        return super().client_update(state, problem, cohort, ctx, client_state)
'''

_PARENT = '''
import sys
from hostile import Hostile
from partialfl.build import make_solver
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.server import SGD

if __name__ == "__main__":
    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=2, n=20, d_theta=3, d_w=2, seed=0))
    alg = Hostile(make_solver("cg", tau=3), SGD(lr=1 / p.L), folder=sys.argv[2],
                  mode=sys.argv[3])
    with ProcessBackend(2, sys.argv[1]) as pb:
        run_rounds(p, alg, 1, clients_per_round=2, seed=0, backend=pb)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _left_after_parent_kill(tmp_path, method: str, mode: str, want: int) -> list[int]:
    """Start the hostile run, wait for ``want`` pid files, SIGKILL the parent, and return the
    pids still running 5 s later (each then killed)."""
    (tmp_path / "hostile.py").write_text(_CLIENT)
    (tmp_path / "parent.py").write_text(_PARENT)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), method, str(pids),
                               mode], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 25
        while len(seen) < want and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = [int(f.stem) for f in pids.glob("*.pid")]
        assert len(seen) == want, "the clients never started"
        time.sleep(0.5)  # inside the long call
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in seen if _alive(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pid in seen:
            if pid > 1 and _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_forkserver_worker_in_a_long_c_call_dies_with_a_killed_parent(tmp_path):
    """``ProcessBackend(2, "forkserver")``, both clients inside one C call that holds the GIL
    (``3 ** (10 ** 8)``, about a minute; any long numpy/pure-C call that does not release
    the GIL acts the same), parent killed with SIGKILL: both workers keep computing until the
    call returns (measured: still alive 8 s after the kill; with ``fork`` and ``spawn`` they
    are gone at once). Root cause: ``runtime/worker.py`` ``_die_with_parent`` ends the
    worker from a Python thread (``mp.parent_process().join()`` then ``os._exit``), which
    cannot run while the client's C call holds the GIL, and ``PR_SET_PDEATHSIG`` names the
    forkserver (which outlives the parent while its children run). Expected: every worker
    gone within a few seconds of the parent's death, whatever its client is doing (e.g. a
    death signal the kernel delivers, not a thread that needs the GIL)."""
    left = _left_after_parent_kill(tmp_path, "forkserver", "gil", want=2)
    assert left == [], f"worker processes {left} still compute after the parent died"


# -- area 3: Krum passes one input through where every other δ-rule refuses -----------------
@pytest.mark.parametrize("options, k", [({"delta": 0.2}, 1), ({"delta": 0.2, "bucketing": 2}, 2),
                                        ({"bucketing": 3}, 3)])
def test_krum_refuses_a_cohort_it_cannot_protect_like_the_other_rules(options, k):
    """``make_aggregator("krum", delta=0.2, bucketing=2)`` called on a cohort of k = 2
    updates, one of them 1e30: ``tolerated(agg, 2)`` raises ``UnprotectedError`` ("bucketing
    s = 2 makes k = 2 inputs 1 bucket means: krum: … f = ⌊δk⌋ = 0"), but calling the rule
    returns 5e29 in every coordinate, with no refusal and no warning (``krum`` alone at
    k = 1 returns the 1e30 row; CAF, MDA, Meamed, multi-Krum, SMEA, TM and MoNNA refuse
    k = 1). Root cause: ``aggregation/distance.py`` ``Krum.__call__`` returns ``X[0]`` when
    ``k == 1`` and, with its default ``m = 1``, never calls ``self.tolerated(k)``, the
    check that refuses ⌊δk⌋ = 0. Expected: ``UnprotectedError`` (a warning with
    ``allow_unprotected=True``), as ``tolerated`` says."""
    from partialfl.aggregation import UnprotectedError, tolerated
    from partialfl.build import make_aggregator

    agg = make_aggregator("krum", **options)
    with pytest.raises(UnprotectedError):
        tolerated(agg, k)  # the rule itself says: not protected at this k
    X = np.ones((k, 3))
    X[0] = 1e30
    with pytest.raises(UnprotectedError):
        agg(X)


# -- area 8: `partialfl train` with the registered algorithm l2gd ---------------------------
_L2GD = ('name = "t"\nstages = ["personalize"]\nbackend = "{backend}"\n'
         '[model]\nname = "leaf_cnn"\noptions = {{ hidden = 8 }}\n'
         '[data]\nsource = "femnist"\nnum_clients = 2\nholdout = 0\n'
         '[method]\nalgorithm = "l2gd"\n'
         '[personalize]\nrounds = 1\nclients_per_round = 2\neval_every = 1\n'
         'client = {{ name = "gd", tau = 2, lr = 0.01 }}\n'
         '[logging]\ntensorboard = false\nprogress = false\n')


@pytest.mark.parametrize("backend", ["sequential", "processes"])
def test_train_with_l2gd_finishes_or_refuses_in_one_line(tmp_path, data_dir, backend):
    """``partialfl train`` of a 2-client FEMNIST spec, ``method.algorithm = "l2gd"`` (listed
    by ``partialfl list algorithm``), full participation (``clients_per_round = 2`` of 2) and
    the client it demands (``client = {name = "gd", tau = 2}``; any other is refused in one
    line): training starts, every client fails with ``ValueError: L2GD needs full
    participation (clients_per_round = all)``, stderr gets "skipping client 0 in round 0: it
    failed …" per client and then the error (exit 2, three lines; with stage 1 before it, a
    whole stage is trained first); with ``backend = "processes"`` it ends in a traceback
    (``WorkerError``, exit 1). Root cause: ``algorithms/l2gd.py`` ``client_update`` demands
    the whole cohort in one call (``len(cohort) == problem.num_clients``), but the model
    pipeline's backends call it one client at a time; nothing refuses the combination before
    training. Expected: the run trains, or a one-line refusal (exit 2) before any round."""
    env = {**os.environ, "PARTIALFL_DATA_DIR": str(data_dir)}
    spec = tmp_path / "l2gd.toml"
    spec.write_text(_L2GD.format(backend=backend))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "partialfl", "train", str(spec), "--out",
                        str(out), "--no-progress"], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode == 0:
        assert (out / "metrics.json").is_file()
        return
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert not (out / "stage2.jsonl").exists()  # refused before training
