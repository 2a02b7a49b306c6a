"""A new algorithm written in a test file, with no edit anywhere else, runs on least squares,
on a CNN model problem, synchronously on every backend, in the asynchronous runtime and in a
Flower simulation (``algorithm_factory``: the ServerApp and the ClientApps build it).

The toy (``tests/toy_plugin.Toy``, under 40 lines, also the worked example of
docs/architecture.md) speaks only the problem interface: fresh w = 0,
``tau`` gradient steps on w with θ fixed, then the θ-gradient at that w; its deployment
(cohort-scoped, :meth:`Algorithm.deploy`) is the same w. On least squares it is FFGG with the
GD solver (Algorithm 2) from w = 0, so both must give the same θ.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from _nn_toy import max_diff, one_thread, toy_data, toy_model
from conftest import SMALL
from toy_plugin import Toy  # τ GD steps on w from 0, then ∇_θ f_m(θ, w)

from partialfl.algorithms import FFGG
from partialfl.local import GradientDescent
from partialfl.metrics import closed_form_metrics
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.runtime.asynchronous import run_async
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.server import SGD
from partialfl.split import make_split


def _ls():
    return LeastSquaresProblem(SMALL, basis="standard")


def test_toy_on_least_squares_is_ffgg_with_gd_fine_tuning():
    p = _ls()
    lr_w = 0.5 / float(p.lipschitz_w(np.arange(p.num_clients)).max())
    kw = dict(clients_per_round=3, seed=2, evaluate=closed_form_metrics)
    toy = run_rounds(p, Toy(4, lr_w, SGD(1.0 / p.L)), 6, **kw)
    ref = run_rounds(p, FFGG(GradientDescent(4, lr_w, "zero", closed_form=False),
                             SGD(1.0 / p.L)), 6, **kw)
    np.testing.assert_allclose(toy.state.theta["theta"], ref.state.theta["theta"],
                               rtol=1e-10, atol=1e-12)
    assert toy.history[-1]["rel_dist2"] < toy.history[0]["rel_dist2"]
    # the deployment (cohort-scoped) is evaluated: the personalized loss gap is logged
    assert np.isfinite(toy.history[-1]["loss_gap"])
    seq = run_rounds(p, Toy(4, lr_w, SGD(1.0 / p.L)), 6, backend=SequentialBackend(), **kw)
    np.testing.assert_allclose(seq.state.theta["theta"], toy.state.theta["theta"], rtol=1e-12)


def test_toy_on_a_cnn_every_backend_and_deploy():
    def problem(vectorize):
        return ModelProblem(make_split(toy_model(0), "output"), toy_data(), vectorize=vectorize)

    runs = {}
    with one_thread():
        for name, vec, backend in (("vmap", True, BatchedBackend()),
                                   ("sequential", False, SequentialBackend()),
                                   ("processes", False, ProcessBackend(workers=2))):
            runs[name] = run_rounds(problem(vec), Toy(2, 0.05, SGD(0.1)), 2, seed=1,
                                    clients_per_round=4, backend=backend,
                                    evaluate=round_evaluator(("test",)))
            if name == "processes":
                backend.close()
    assert max_diff(runs["vmap"].state.theta, runs["sequential"].state.theta) < 1e-5
    assert max_diff(runs["processes"].state.theta, runs["sequential"].state.theta) == 0.0
    h = runs["sequential"].history
    assert h[-1]["test_loss"] < h[0]["test_loss"] and h[-1]["grad_evals"] == 2 * 3


@pytest.mark.parametrize("kind", ["least-squares", "cnn"])
def test_toy_in_the_async_runtime_one_in_flight_is_one_client_rounds(kind):
    """Algorithm 3 with one client in flight applies each update at staleness 0: the same θ
    as synchronous rounds of one sampled client."""
    if kind == "cnn":
        p = ModelProblem(make_split(toy_model(0), "output"), toy_data(), vectorize=False)
        alg = Toy(2, 0.05, SGD(0.1))
    else:
        p = _ls()
        alg = Toy(3, 0.5 / float(p.lipschitz_w(np.arange(p.num_clients)).max()),
                  SGD(1.0 / p.L))
    with one_thread():
        a = run_async(p, alg, steps=5, concurrency=1, seed=4)
        s = run_rounds(p, alg, 5, clients_per_round=1, seed=4)
    assert a.staleness.tolist() == [0] * 5
    assert all(np.array_equal(np.asarray(a.state.theta[n]), np.asarray(s.state.theta[n]))
               for n in s.state.theta)
    b = run_async(p, alg, steps=6, concurrency=3, seed=4)  # stale updates are applied too
    assert b.staleness.max() > 0 and len(b.steps["client"]) == 6


def _toy_for(cfg, problem):
    """The toy for a Flower run (on the server and on every SuperNode): least squares."""
    lr_w = 0.5 / float(problem.lipschitz_w(np.arange(problem.num_clients)).max())
    return Toy(3, lr_w, SGD(1.0 / problem.L))


@pytest.mark.slow  # a Ray start-up: ~20 s or more on a shared machine
def test_toy_in_a_flower_simulation_matches_in_process():
    pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")
    ray = pytest.importorskip("ray", reason="Flower's simulation engine needs ray")
    # the ClientApp actors cannot import the test folder: send its code along
    import toy_plugin
    from _flower_sims import ls_run

    from partialfl.build import problem_of
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.simulation import run_simulation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(toy_plugin)
    run = ls_run(3, 5, eval_every=3)
    report = run_simulation(run, num_supernodes=2, num_cpus=2, algorithm_factory=_toy_for)
    cfg = parse_run_config(run)
    p = problem_of(cfg.run)
    ref = run_rounds(p, _toy_for(cfg, p), 3, clients_per_round=5, seed=3)
    np.testing.assert_allclose(report.theta["theta"], ref.state.theta["theta"], rtol=0,
                               atol=1e-6)
    assert not report.failures and report.server_steps == 3
    # the nodes evaluated their own clients' deployment (Toy.deploy) at rounds 0 and 3
    ev = [h for h in report.history if "eval_loss_gap" in h]
    assert [h["round"] for h in ev] == [0, 3] and ev[-1]["eval_clients"] == 8
    assert ev[-1]["eval_loss_gap"] < ev[0]["eval_loss_gap"]
