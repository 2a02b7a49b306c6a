"""The ``processes`` backend: the cohort over worker processes, same θ bit for bit."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from _nn_toy import max_diff, one_thread, toy_data
from conftest import SMALL
from test_nn_algorithms import ALGOS, _problem

from partialfl.aggregation import CoordinateMedian
from partialfl.algorithms import Scaffold
from partialfl.algorithms.byzantine import ByzantineRobust
from partialfl.algorithms.model import model_ffgg
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.build import make_backend
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import SequentialBackend, run_rounds
from partialfl.runtime.cohort_pool import ClientsFailed, ProcessBackend
from partialfl.runtime.faults import DropClients
from partialfl.server import SGD


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _both(make_problem, make_alg, rounds=2, k=4, evaluate=True):
    out = []
    for backend in (SequentialBackend(), ProcessBackend(workers=2)):
        pb = make_problem()
        out.append(run_rounds(pb, make_alg(), rounds, clients_per_round=k, seed=3,
                              backend=backend, evaluate=round_evaluator() if evaluate else None,
                              eval_every=rounds))
        if isinstance(backend, ProcessBackend):
            backend.close()
    return out


@pytest.mark.parametrize("name", ["fedavg", "ffgg", "local-ffgg", "fedalt", "fedsim"])
def test_processes_equal_sequential_bit_for_bit(name):
    make, kind = ALGOS[name]
    data = toy_data()
    seq, par = _both(lambda: _problem(kind, False, data), make)
    assert max_diff(seq.state.theta, par.state.theta) == 0
    assert seq.history[-1]["test_acc"] == par.history[-1]["test_acc"]
    assert [h["grad_evals"] for h in seq.history] == [h["grad_evals"] for h in par.history]
    if seq.client_state is not None:
        assert max_diff(seq.client_state, par.client_state) == 0


def test_robust_aggregator_gets_per_client_rows():
    cfg = SGDConfig(lr=0.2, batch_size=4)
    data = toy_data()
    seq, par = _both(lambda: _problem("output", False, data),
                     lambda: ByzantineRobust(model_ffgg(cfg, server_opt=SGD(0.5)),
                                             CoordinateMedian()))
    assert max_diff(seq.state.theta, par.state.theta) == 0


def test_numpy_problems_and_client_state():
    seq, par = _both(lambda: LeastSquaresProblem(SMALL, basis="standard"),
                     lambda: Scaffold(3), rounds=4, k=3, evaluate=False)
    for n in seq.state.theta:
        assert np.array_equal(seq.state.theta[n], par.state.theta[n])
    for n in seq.client_state:
        assert np.array_equal(seq.client_state[n], par.client_state[n])


def test_selectable_by_name_and_pool_reuse():
    b = make_backend("processes")
    assert isinstance(b, ProcessBackend) and b.workers >= 1
    with pytest.raises(ValueError, match="workers"):
        ProcessBackend(workers=0)
    pb = _problem("output", False, toy_data())
    alg = model_ffgg(SGDConfig(lr=0.2, batch_size=4))
    with ProcessBackend(workers=2) as be:
        run_rounds(pb, alg, 2, clients_per_round=3, backend=be)
        pool = be._pool
        run_rounds(pb, alg, 1, clients_per_round=3, backend=be)
        assert be._pool is pool  # same problem and algorithm: workers reused
        pids = [p.pid for p in pool.procs]
    assert all(not _alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Failing:
    """FFGG whose client 2 raises (or kills its process)."""

    def __init__(self, how):
        self.base, self.how = model_ffgg(SGDConfig(lr=0.2, batch_size=4)), how

    def __getattr__(self, n):
        return getattr(self.base, n)

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        if 2 in cohort:
            if self.how == "die":
                os._exit(7)
            raise FloatingPointError("client 2 diverged")
        return self.base.client_update(state, problem, cohort, ctx, client_state)


@pytest.mark.parametrize("how", ["raise", "die"])
def test_worker_failures_are_reported_per_client(how):
    """A failing client is reported with the other clients' results; its worker (replaced
    if it died) and the pool live on."""
    pb = _problem("output", False, toy_data())
    alg = _Failing(how)
    from partialfl.algorithms.base import RoundContext

    match = "client 2 diverged" if how == "raise" else "died \\(exit code 7\\)"
    with ProcessBackend(workers=2) as be:
        state = alg.init(pb, pb.init_theta())
        with pytest.raises(ClientsFailed, match=match) as e:
            be.run(alg, state, pb, np.array([0, 2, 4]), RoundContext(0, 0))
        assert set(e.value.failures) == {1}
        assert [r is None for r in e.value.results] == [False, True, False]
        assert not be._pool.closed and be._pool.live() == 2
        ok = be.run(alg, state, pb, np.array([0, 4]), RoundContext(0, 0))
    assert ok.updates.cohort.tolist() == [0, 4]


def test_pipeline_with_processes_and_a_store_matches_sequential(tmp_path):
    from dataclasses import replace

    from test_pipeline import _cfg, _task

    from partialfl.data.store import open_store, write_store
    from partialfl.pipeline.stages import run_pipeline

    data = toy_data(8)
    store = open_store(write_store(tmp_path / "store", data))
    cfg = _cfg("fedalt", "output")
    a = run_pipeline(cfg, _task(data), tmp_path / "seq", progress=False)
    b = run_pipeline(replace(cfg, backend="processes"), _task(store), tmp_path / "par",
                     progress=False)
    assert a.metrics["test_acc"] == b.metrics["test_acc"]
    assert a.metrics["per_client_test_acc"] == b.metrics["per_client_test_acc"]


def test_closed_form_config_runs_on_processes(tmp_path):
    from partialfl.pipeline.closed_form import load_closed_form, run_closed_form

    base = {"name": "t", "problem": {"name": "least-squares", "num_clients": 6, "n": 40,
                                     "d_theta": 6, "d_w": 3},
            "method": {"algorithm": "ffgg"},
            "personalize": {"rounds": 3, "clients_per_round": 3,
                            "client": {"name": "cg", "tau": 3}}}
    out = {}
    for b in ("sequential", "processes"):
        cfg = load_closed_form({**base, "backend": b})
        out[b] = run_closed_form(cfg, tmp_path / b, progress=False).state.theta
    for n in out["sequential"]:
        assert np.array_equal(out["sequential"][n], out["processes"][n])


def test_spawned_workers_equal_sequential_bit_for_bit():
    """The start method used where torch sees a GPU (fork is unsafe there): the problem and
    the algorithm travel pickled, and θ is still the sequential one bit for bit."""
    make, kind = ALGOS["ffgg"]
    data = toy_data()
    seq = run_rounds(_problem(kind, False, data), make(), 2, clients_per_round=4, seed=3,
                     backend=SequentialBackend())
    with ProcessBackend(workers=2, start_method="spawn") as be:
        par = run_rounds(_problem(kind, False, data), make(), 2, clients_per_round=4, seed=3,
                         backend=be)
    assert max_diff(seq.state.theta, par.state.theta) == 0


def test_start_method_is_validated_and_defaults_to_fork_on_a_cpu_torch():
    import torch

    from partialfl.runtime.cohort_pool import default_start_method

    with pytest.raises(ValueError, match="unknown start method 'thread'"):
        ProcessBackend(start_method="thread")
    if not torch.cuda.is_available():
        assert default_start_method() == "fork"


# ------------------------------------------------------------------ failing clients (issue 21)
class _FailAt(AlgorithmWrapper):
    """``base`` whose (round, client) pairs in ``at`` fail: ``raise``, ``exit`` (os._exit) or
    ``sigkill`` (the worker sends itself a real SIGKILL)."""

    def __init__(self, base, at):
        super().__init__(base)
        self.at = at

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        for m in cohort:
            how = self.at.get((ctx.round, int(m)))
            if how == "raise":
                raise FloatingPointError(f"client {int(m)} diverged")
            if how == "exit":
                os._exit(7)
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "hang":
                time.sleep(120)
        return self.base.client_update(state, problem, cohort, ctx, client_state)


def _ls_ffgg(p):
    from partialfl.algorithms import FFGG
    from partialfl.local import GradientDescent

    return FFGG(GradientDescent(3), SGD(0.5 / p.L))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "exit", "sigkill"])
def test_a_failing_client_is_skipped_and_the_run_finishes(how):
    """A client that raises, exits or is killed in a worker is skipped and counted, the run
    goes on (it hung forever: the pool was closed, then reused), and θ equals the run with
    exactly that client's update dropped."""
    p = LeastSquaresProblem(SMALL, basis="standard")
    at = {(1, 2): how, (3, 4): how}
    with ProcessBackend(workers=2) as be:
        res = run_rounds(p, _FailAt(_ls_ffgg(p), at), 5, seed=3, backend=be)
        assert be._pool is not None and not be._pool.closed  # the healthy workers live on
    ref = run_rounds(p, DropClients(_ls_ffgg(p), at), 5, seed=3, backend=SequentialBackend())
    assert np.array_equal(res.state.theta["theta"], ref.state.theta["theta"])
    lost = res.faults.failed if how == "raise" else res.faults.worker_deaths
    assert lost == 2 and res.faults.lost == 2
    assert res.history[-1]["clients_failed" if how == "raise" else "worker_deaths"] == 2


@pytest.mark.timeout(60)
def test_a_hung_client_is_killed_after_the_task_timeout():
    p = LeastSquaresProblem(SMALL, basis="standard")
    at = {(1, 2): "hang"}
    with ProcessBackend(workers=2, task_timeout=1.0) as be:
        res = run_rounds(p, _FailAt(_ls_ffgg(p), at), 3, seed=3, backend=be)
    ref = run_rounds(p, DropClients(_ls_ffgg(p), at), 3, seed=3, backend=SequentialBackend())
    assert np.array_equal(res.state.theta["theta"], ref.state.theta["theta"])
    assert res.faults.worker_deaths == 1 and "longer than 1.0 s" in res.faults.first_error_text


@pytest.mark.timeout(60)
def test_a_closed_pool_is_never_reused():
    from partialfl.algorithms.base import RoundContext
    from partialfl.runtime.pool import Task, WorkerError

    p = LeastSquaresProblem(SMALL, basis="standard")
    alg = _ls_ffgg(p)
    state = alg.init(p, p.init_theta(np.random.default_rng(0)))
    with ProcessBackend(workers=1) as be:
        first = be.run(alg, state, p, np.array([0, 1]), RoundContext(0, 0))
        pool = be._pool
        pool.close()
        with pytest.raises(WorkerError, match="closed"):
            pool.send(0, Task(0, 0, state, RoundContext(0, 0)))
        again = be.run(alg, state, p, np.array([0, 1]), RoundContext(0, 0))
        assert be._pool is not pool and not be._pool.closed
    assert np.array_equal(first.updates.vectors["theta"], again.updates.vectors["theta"])


_ORPHAN = """
import os, sys
sys.path.insert(0, sys.argv[1])
from conftest import SMALL
from partialfl.algorithms import FFGG
from partialfl.local import GradientDescent
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime.pool import WorkerPool
p = LeastSquaresProblem(SMALL)
pool = WorkerPool(p, FFGG(GradientDescent(1)), 2, start_method="fork")
pool.wait_ready()
print(*[q.pid for q in pool.procs], flush=True)
os._exit(0)  # the parent dies without closing the pool
"""


@pytest.mark.timeout(60)
def test_workers_quit_when_their_parent_is_gone():
    import subprocess
    import sys

    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _ORPHAN, tests], env=env, check=True,
                         capture_output=True, text=True, timeout=50).stdout
    pids = [int(x) for x in out.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_exists(pid) for pid in pids)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _StartTime:
    """A client that reports when it started (CLOCK_MONOTONIC: one clock for all processes)."""

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        from partialfl.algorithms.base import ClientResult
        from partialfl.types import ClientUpdates

        t = np.array([time.monotonic_ns()])
        return ClientResult(ClientUpdates({"x": np.zeros((1, 1))}, np.ones(1), cohort,
                                          metrics={"start": t}))


def test_clients_start_largest_first_and_come_back_in_cohort_order():
    """Longest-processing-time-first, as the threads backend: the large clients start first,
    so none is left to start last while the other workers idle."""
    from partialfl.algorithms.base import RoundContext, ServerState
    from partialfl.runtime.clients import ClientCall

    data = toy_data(8, sizes=np.array([3, 9, 1, 9, 5, 12, 2, 7]))
    pb = _problem("output", False, data)
    call = ClientCall(_StartTime(), pb, ServerState({}), np.arange(8), RoundContext(0, 0))
    with ProcessBackend(workers=1) as be:
        out = be.map_groups(call, [np.array([i]) for i in range(8)])
    assert [int(r.updates.cohort[0]) for r in out] == list(range(8))
    started = [int(r.updates.metrics["start"][0]) for r in out]
    assert list(np.argsort(started)) == [5, 1, 3, 7, 4, 0, 6, 2]  # ties (9, 9) in cohort order


_BUSY_ORPHAN = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from conftest import SMALL
from partialfl.algorithms import FFGG
from partialfl.local import GradientDescent
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime.pool import Task, WorkerPool
p = LeastSquaresProblem(SMALL)
alg = FFGG(GradientDescent(1))
pool = WorkerPool(p, alg, 2, start_method="fork")
pool.wait_ready()
state = alg.init(p, p.init_theta())
from partialfl.algorithms.base import RoundContext
for w in range(2):  # each worker busy for 60 s (it sleeps out the task's duration)
    pool.send(w, Task(w, w, state, RoundContext(0, 0), None, 60.0))
time.sleep(1.0)
print(*[q.pid for q in pool.procs], flush=True)
os._exit(0)  # the parent dies without closing the pool
"""


@pytest.mark.timeout(60)
def test_workers_have_their_own_sessions_and_die_with_their_parent_even_when_busy(tmp_path):
    """Each worker is a session of its own (a fair CPU share per worker under load, as
    torchrun's ranks) and, out of the parent's process group, is killed by the kernel when
    its parent dies, even in the middle of a task."""
    import subprocess
    import sys

    with ProcessBackend(workers=1) as be:
        run_rounds(LeastSquaresProblem(SMALL, basis="standard"), Scaffold(2), 1,
                   clients_per_round=1, backend=be)
        pid = be._pool.procs[0].pid
        assert os.getsid(pid) == pid != os.getsid(0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(tmp_path / "pids", "w") as f:  # a file, not a pipe the workers would hold
        subprocess.run([sys.executable, "-c", _BUSY_ORPHAN, os.path.dirname(__file__)],
                       env=env, check=True, stdout=f, timeout=50)
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_exists(pid) for pid in pids)


def test_workers_started_beside_a_running_thread_pool_are_not_forked():
    """A fork copies the locks the threads of a running ThreadBackend hold at that instant
    (one hang of a processes run started beside one, in a loaded full suite); while such a
    pool runs, new worker pools start from the forkserver (its own single-threaded process),
    and the run is still the sequential one bit for bit; after it closes, fork again."""
    import torch

    from partialfl.runtime.cohort_pool import default_start_method
    from partialfl.runtime.pool import LIVE_THREAD_POOLS
    from partialfl.runtime.threads import ThreadBackend

    if torch.cuda.is_available():
        pytest.skip("with a GPU the workers are spawned anyway")
    make, kind = ALGOS["ffgg"]
    data = toy_data()
    seq = run_rounds(_problem(kind, False, data), make(), 2, clients_per_round=4, seed=3,
                     backend=SequentialBackend())
    assert not LIVE_THREAD_POOLS and default_start_method() == "fork"
    with ThreadBackend(2) as tb:
        run_rounds(_problem(kind, False, data), make(), 1, clients_per_round=4, seed=3,
                   backend=tb)
        assert len(LIVE_THREAD_POOLS) == 1 and default_start_method() == "forkserver"
        with ProcessBackend(workers=2) as be:
            par = run_rounds(_problem(kind, False, data), make(), 2, clients_per_round=4,
                             seed=3, backend=be)
            assert be._pool is not None and be._pool.ctx.get_start_method() == "forkserver"
    assert max_diff(seq.state.theta, par.state.theta) == 0
    assert not LIVE_THREAD_POOLS and default_start_method() == "fork"


def test_a_forkserver_worker_idle_between_rounds_stays_alive():
    """A worker started from the forkserver (a thread pool runs, or start_method =
    "forkserver") is the forkserver's child: it took ``os.getppid() != parent`` for its
    parent's death and quit after one idle second, so the next round counted its client as
    failed (skipped: θ differed from the sequential run) and respawned the worker. Now it
    stays: no failure, no respawn, the sequential θ bit for bit."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the workers are spawned anyway")
    make, kind = ALGOS["ffgg"]
    data = toy_data()
    seq = run_rounds(_problem(kind, False, data), make(), 2, clients_per_round=4, seed=3,
                     backend=SequentialBackend())
    prob, alg = _problem(kind, False, data), make()
    with ProcessBackend(workers=2, start_method="forkserver", poll=0.05) as be:
        run_rounds(prob, alg, 1, clients_per_round=4, seed=3, backend=be)
        pids = [p.pid for p in be._pool.procs]
        time.sleep(1.6)  # idle past the workers' one-second check
        par = run_rounds(prob, alg, 2, clients_per_round=4, seed=3, backend=be)
        assert [p.pid for p in be._pool.procs] == pids and all(p.is_alive()
                                                               for p in be._pool.procs)
    assert par.faults.lost == 0
    assert max_diff(seq.state.theta, par.state.theta) == 0
