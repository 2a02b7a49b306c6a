"""Adversarial round 30b (issue 21 areas 1, 3, 4, 6, 7, 8, tried again from scratch by someone
who did not write the fixes): the defect found; it failed on the code it was written against
(adv30b at 5ab5485) because of the defect it names, and passes since the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

# -- area 1: forkserver started from a thread, then a pool from the main thread --------------
_FS_THREAD = textwrap.dedent('''
    import os, sys, threading, time
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.runtime.pool import WorkerPool
    from partialfl.server import SGD


    class Gil(FFGG):
        def client_update(self, state, problem, cohort, ctx, client_state=None):
            open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
            3 ** (10 ** 8)  # one C call holding the GIL for about a minute
            return super().client_update(state, problem, cohort, ctx, client_state)


    if __name__ == "__main__":
        p = LeastSquaresProblem(LeastSquaresSpec(num_clients=2, n=20, d_theta=3, d_w=2,
                                                 seed=0))
        def warm():  # a pool in a thread starts the forkserver (no guard: not main thread)
            wp = WorkerPool(p, FFGG(make_solver("cg", tau=3), SGD(lr=1 / p.L)), 1,
                            start_method="forkserver")
            wp.wait_ready()
            wp.close()
        t = threading.Thread(target=warm)
        t.start()
        t.join()
        alg = Gil(make_solver("cg", tau=3), SGD(lr=1 / p.L))
        run_rounds(p, alg, 1, clients_per_round=2, seed=0,
                   backend=ProcessBackend(2, "forkserver"))  # from the MAIN thread
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_main_thread_pool_workers_die_with_parent_after_a_thread_started_the_forkserver(
        tmp_path):
    """A WorkerPool started (and closed) in a thread starts the forkserver without its guard
    (``guard_forkserver(on=False)``); then ``ProcessBackend(2, "forkserver")`` runs a round
    from the MAIN thread, both clients inside ``3 ** (10 ** 8)``; the parent is SIGKILLed.
    Seen: both workers (and the forkserver) still alive 3 s later, computing for about a
    minute. With the forkserver started from the main thread (same script without the
    thread), both die at once (round 28's guard). Expected: the same — a main-thread pool
    whose running forkserver lacks the guard restarts it (or refuses)."""
    script, pids = tmp_path / "fs_thread.py", tmp_path / "pids"
    script.write_text(_FS_THREAD)
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [SRC, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, str(script), str(pids)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [int(f.name) for f in pids.iterdir()]
            time.sleep(0.1)
        assert len(workers) == 2, "the clients never started"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(3.0)
        left = [w for w in workers if _alive(w)]
    finally:
        for w in [int(f.name) for f in pids.iterdir()]:
            with __import__("contextlib").suppress(OSError):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert left == [], f"workers {left} outlived their SIGKILLed parent"
