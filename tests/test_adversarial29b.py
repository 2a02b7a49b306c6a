"""Adversarial round 29b (issue 21 areas 1, 3, 4, 6, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found; each failed on the code it was written
against (adv29b at 75d5bc3) because of the defect it names, and passes since the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# -- area 1: a process pool started in a thread that has since ended ------------------------
_THREAD_POOL = textwrap.dedent('''
    import sys, threading, time
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.server import SGD

    if __name__ == "__main__":
        p = LeastSquaresProblem(LeastSquaresSpec(num_clients=2, n=20, d_theta=3, d_w=2,
                                                 seed=0))
        alg = FFGG(make_solver("cg", tau=3), SGD(lr=1 / p.L))
        with ProcessBackend(2, sys.argv[1]) as pb:
            t = threading.Thread(target=run_rounds, args=(p, alg, 1),
                                 kwargs=dict(clients_per_round=2, seed=0, backend=pb))
            t.start()
            t.join()
            time.sleep(1.5)  # the workers' own watchers run once a second
            r = run_rounds(p, alg, 1, clients_per_round=2, seed=0, backend=pb)
        print("LOST", r.faults.lost, r.faults.worker_deaths)
''')


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_pool_started_in_an_ended_thread_never_loses_the_next_runs_clients(tmp_path,
                                                                             method):
    """``ProcessBackend(2, method)``: one round run in a thread (which then ends), then one
    round from the main thread on the same backend. Seen: ``skipping client 0 in round 0: its
    worker process killed by SIGKILL`` for both clients (forkserver: ``died (exit code
    255)``), ``worker_deaths == 2``. Expected: no client lost — a worker that died idle is
    replaced before a task is handed to it (or the pool lives as long as the backend)."""
    script = tmp_path / "thread_pool.py"
    script.write_text(_THREAD_POOL)
    out = subprocess.run([sys.executable, str(script), method], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(s for s in out.stdout.splitlines() if s.startswith("LOST"))
    assert line == "LOST 0 0", out.stderr[-2000:]


# -- area 1/8: every client returns garbage on the processes backend ------------------------
_GARBAGE_PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.registry import option, register


    class Garbage(FFGG):
        """Every client returns a string instead of its ClientResult."""

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            return "garbage"


    @dataclass(frozen=True)
    class GarbageOptions:
        tau: int = option(3, "CG iterations (unused)")


    @register("algorithm", "garbage29b", options=GarbageOptions, split="personal",
              sends="gradient")
    def _garbage(opts, ctx):
        from partialfl.build import make_solver
        return Garbage(make_solver("cg", tau=opts.tau), ctx.server_opt, ctx.aggregator)
''')
_GARBAGE_SPEC = textwrap.dedent('''
    seed = 0
    plugins = ["garbage29b"]
    [problem]
    name = "least-squares"
    num_clients = 8
    n = 200
    d_theta = 5
    d_w = 3
    seed = 0
    [method]
    algorithm = "garbage29b"
    w_init = "zero"
    [personalize]
    rounds = 2
    clients_per_round = 4
    eval_every = 1
    client = { name = "cg", tau = 3 }
    server = { optimizer = "sgd", lr = "1/L" }
''')


def test_every_client_returning_garbage_in_workers_is_one_line_exit_2(tmp_path):
    """A plugin algorithm (``--allow-code``) whose ``client_update`` returns ``"garbage"``,
    ``partialfl run SPEC --allow-code --set backend=processes``. Seen: exit 1, ``Traceback``
    of ``partialfl.runtime.cohort_pool.ClientsFailed`` then ``partialfl.runtime.pool.
    WorkerError: client 1 in round 0 failed in a worker: MalformedResult: …``. With
    ``backend=sequential`` (also threads, vmap): exit 2 and ``partialfl: error: the client
    computation returned str, not a ClientResult``. Expected: the same one line and exit 2
    on every backend (a MalformedResult, a ValueError, crossing from the workers is the
    client's own error, as a raised ValueError already is)."""
    (tmp_path / "garbage29b.py").write_text(_GARBAGE_PLUGIN)
    (tmp_path / "spec.toml").write_text(_GARBAGE_SPEC)
    out = subprocess.run([sys.executable, "-m", "partialfl", "run", "spec.toml",
                          "--allow-code", "--set", "backend=processes", "--no-progress",
                          "--out", str(tmp_path / "out")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    assert out.returncode == 2, out.stderr[-1500:]
    assert out.stderr.strip().splitlines()[-1] == ("partialfl: error: the client computation "
                                                   "returned str, not a ClientResult")
