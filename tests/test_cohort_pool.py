"""The ``processes`` backend: the cohort over worker processes, same θ bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _nn_toy import max_diff, one_thread, toy_data
from conftest import SMALL
from test_nn_algorithms import ALGOS, _problem

from partialfl.aggregation import CoordinateMedian
from partialfl.algorithms import Scaffold
from partialfl.algorithms.byzantine import ByzantineRobust
from partialfl.algorithms.model import model_ffgg
from partialfl.build import make_backend
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import SequentialBackend, run_rounds
from partialfl.runtime.cohort_pool import ProcessBackend, WorkerError
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
    assert [h["local_grads"] for h in seq.history] == [h["local_grads"] for h in par.history]
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
def test_worker_failures_are_reported(how):
    pb = _problem("output", False, toy_data())
    alg = _Failing(how)
    be = ProcessBackend(workers=2)
    state = alg.init(pb, pb.init_theta())
    from partialfl.algorithms.base import RoundContext

    match = "client 2 diverged" if how == "raise" else "died \\(exit code 7\\)"
    with pytest.raises(WorkerError, match=match):
        be.run(alg, state, pb, np.array([0, 2, 4]), RoundContext(0, 0))
    assert be._pool is None or be._pool.procs == []
    be.close()



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
