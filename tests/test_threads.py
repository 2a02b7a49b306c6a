"""The ``threads`` backend: the cohort over threads of this process, same θ bit for bit."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data
from conftest import SMALL
from test_nn_algorithms import ALGOS, _problem

from partialfl.algorithms import FFGG, FedAvg, Scaffold
from partialfl.algorithms.base import RoundContext
from partialfl.local import GradientDescent
from partialfl.local.gd import GDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import SequentialBackend, run_rounds
from partialfl.runtime.threads import ThreadBackend
from partialfl.server import SGD


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _both(make_problem, make_alg, rounds=3, k=8, evaluate=True):
    out = []
    for backend in (SequentialBackend(), ThreadBackend(workers=3)):
        out.append(run_rounds(make_problem(), make_alg(), rounds, clients_per_round=k, seed=3,
                              backend=backend, evaluate=round_evaluator() if evaluate else None,
                              eval_every=rounds))
    return out


# fedavg: the module's parameters are swapped by functional_call (one module per thread);
# ffgg-adapter: a random personal initialisation reseeds torch's global generator (locked)
@pytest.mark.parametrize("name", ["fedavg", "ffgg", "ffgg-adapter", "fedalt"])
def test_threads_equal_sequential_bit_for_bit(name):
    make, kind = ALGOS[name]
    data = toy_data(12)
    seq, par = _both(lambda: _problem(kind, False, data), make)
    assert max_diff(seq.state.theta, par.state.theta) == 0
    assert seq.history[-1]["test_acc"] == par.history[-1]["test_acc"]
    assert [h["grad_evals"] for h in seq.history] == [h["grad_evals"] for h in par.history]
    if seq.client_state is not None:
        assert max_diff(seq.client_state, par.client_state) == 0
    assert max_diff(seq.state.theta, _problem(kind, False, data).init_theta()) > 1e-4


@pytest.mark.parametrize("make", [lambda: FedAvg(GDConfig(3), weighting="examples", share_w=True),
                                  lambda: FFGG(GradientDescent(3, init="random"), SGD(0.05)),
                                  lambda: Scaffold(3)], ids=["fedavg", "ffgg", "scaffold"])
def test_least_squares_equal_sequential_bit_for_bit(make):
    seq, par = _both(lambda: LeastSquaresProblem(SMALL, basis="standard"), make, rounds=4,
                     k=5, evaluate=False)
    for n in seq.state.theta:
        assert np.array_equal(seq.state.theta[n], par.state.theta[n])
    if seq.client_state is not None:
        for n in seq.client_state:
            assert np.array_equal(seq.client_state[n], par.client_state[n])


def test_one_torch_thread_per_client_and_the_callers_count_restored():
    seen, names = [], set()

    def fn(pos):
        seen.append(torch.get_num_threads())
        names.add(threading.current_thread().name)
        return pos

    torch.set_num_threads(2)
    with ThreadBackend(workers=2) as be:
        out = be.map_groups(fn, [np.array([i]) for i in range(6)])
    assert [int(o[0]) for o in out] == list(range(6))  # group order
    assert seen == [1] * 6 and all(n.startswith("partialfl-cohort") for n in names)
    assert torch.get_num_threads() == 2


class _Failing:
    """FFGG whose client 2 raises."""

    def __init__(self):
        _, self.kind = ALGOS["ffgg"]
        self.base = ALGOS["ffgg"][0]()

    def __getattr__(self, n):
        return getattr(self.base, n)

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        if 2 in cohort:
            raise FloatingPointError("client 2 diverged")
        return self.base.client_update(state, problem, cohort, ctx, client_state)


def test_a_failing_client_raises_and_is_isolated_as_in_sequential():
    data = toy_data(12)
    alg, be = _Failing(), ThreadBackend(workers=3)
    pb = _problem("output", False, data)
    state = alg.init(pb, pb.init_theta())
    with pytest.raises(FloatingPointError, match="client 2 diverged"):
        be.run(alg, state, pb, np.arange(6), RoundContext(0, 0))
    res = be.run(alg, state, pb, np.array([0, 1, 3]), RoundContext(0, 0))  # still usable
    assert res.updates.cohort.tolist() == [0, 1, 3]
    runs = [run_rounds(_problem("output", False, data), _Failing(), 2, seed=0, backend=b,
                       max_failure_fraction=0.9) for b in (SequentialBackend(), be)]
    assert max_diff(runs[0].state.theta, runs[1].state.theta) == 0
    assert runs[0].faults.record() == runs[1].faults.record()
    be.close()


def test_replicas_share_the_data_own_the_module_and_are_reused_within_a_run():
    pb = _problem("output", False, toy_data())
    r = pb.thread_replica()
    assert r.module is not pb.module and r._store is pb._store and r.data is pb.data
    assert all(a.data_ptr() != b.data_ptr()
               for a, b in zip(r.module.parameters(), pb.module.parameters()))
    alg = ALGOS["ffgg"][0]()
    with ThreadBackend(workers=2) as be:
        made = []
        orig = pb.thread_replica
        pb.thread_replica = lambda: made.append(1) or orig()
        run_rounds(pb, alg, 3, clients_per_round=4, backend=be)
        assert len(made) == 2 and len(be._replicas) == 2  # once per thread for the run
        reps = list(be._replicas)
        run_rounds(pb, alg, 1, clients_per_round=4, backend=be)  # a new run: made anew
        assert len(made) == 4 and all(x not in reps for x in be._replicas)
        pb2 = _problem("output", False, toy_data())
        run_rounds(pb2, alg, 1, clients_per_round=4, backend=be)
        assert be._problem is pb2 and all(x not in reps for x in be._replicas)
    assert be._executor is None and be._replicas == []


def test_clients_start_largest_first_and_come_back_in_cohort_order():
    from partialfl.algorithms.base import ClientResult
    from partialfl.runtime.clients import ClientCall
    from partialfl.types import ClientUpdates

    data = toy_data(8, sizes=np.array([3, 9, 1, 9, 5, 12, 2, 7]))
    pb = _problem("output", False, data)
    started = []

    class Recording:
        def client_update(self, state, problem, cohort, ctx, client_state=None):
            started.append(int(cohort[0]))
            return ClientResult(ClientUpdates({}, np.ones(1), np.asarray(cohort), 0))

    call = ClientCall(Recording(), pb, None, np.arange(8), RoundContext(0, 0))
    with ThreadBackend(workers=1) as be:
        out = be.map_groups(call, [np.array([i]) for i in range(8)])
    assert [int(r.updates.cohort[0]) for r in out] == list(range(8))
    assert started == [5, 1, 3, 7, 4, 0, 6, 2]  # by size, ties (9, 9) in cohort order


def test_bad_workers_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="workers must be a positive integer"):
            ThreadBackend(workers=bad)


def test_global_torch_seed_draws_reproducibly_and_restores_the_generator():
    from partialfl.rng import global_torch_seed

    before = torch.random.get_rng_state()
    draws = []
    for _ in range(2):
        with global_torch_seed(7, "init_w", 0, 3):
            draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_backend_threads_by_name_equals_sequential(tmp_path, asynchronous):
    """``backend = {name = "threads"}`` from a TOML spec: the same history as sequential, in
    the synchronous loop (a pool mode) and the asynchronous one (its simulated clock)."""
    import json

    from partialfl.cli import main

    text = ('seed = 2\n[problem]\nname = "least-squares"\nnum_clients = 12\nn = 20\n'
            'd_theta = 4\nd_w = 2\n[method]\nalgorithm = "ffgg"\n'
            '[personalize]\nrounds = 6\nclients_per_round = 5\neval_every = 2\n'
            'client = { name = "gd", tau = 2 }\nserver = { lr = 0.05 }\n')
    if asynchronous:
        text += '[asynchronous]\nconcurrency = 3\n'
    hist = {}
    for name in ("sequential", "threads"):
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(f'backend = {{ name = "{name}" }}\n' + text)
        assert main(["run", str(cfg), "--no-progress", "--out", str(tmp_path / name)]) == 0
        hist[name] = [json.loads(x) for x in
                      (tmp_path / name / f"{name}.jsonl").read_text().splitlines()]
    assert len(hist["threads"]) == 4
    for a, b in zip(hist["sequential"], hist["threads"], strict=True):
        assert a["rel_dist2"] == b["rel_dist2"] and a["grad_evals"] == b["grad_evals"]
    assert hist["threads"][-1]["rel_dist2"] < hist["threads"][0]["rel_dist2"]
