"""One executor per run (issue 26 item 4): the run chooses the batching mode once and the loop
passes it down (RoundContext → algorithm → local trainer → the problem's kernels); the
problem never chooses. The small run object (``Run``) and its keyword forms give the same
runs."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_toy import one_thread, toy_data, toy_model

from partialfl.algorithms.model import FedAvg, model_ffgg
from partialfl.batching import MAX_EXAMPLES, Executor, Loop, Vmap
from partialfl.local.sgd import SGDConfig
from partialfl.problems.model import ModelProblem
from partialfl.problems.overpersonalized import OverpersonalizedLeastSquares
from partialfl.runtime import (
    Arrivals,
    Checkpointing,
    Evaluation,
    Rounds,
    Run,
    SequentialBackend,
    execute,
    run_rounds,
)
from partialfl.runtime.asynchronous import run_async
from partialfl.runtime.cohort_pool import ProcessBackend
from partialfl.server import SGD
from partialfl.split import make_split

CFG = SGDConfig(lr=0.2, batch_size=4)
VMAPPED = ("_minibatch_vmap", "_full_grad_vmap", "_pass_vmap")


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _spied(problem) -> list[tuple[str, int]]:
    """Record every call of the problem's vmapped kernels: (kernel, clients in the call)."""
    calls: list[tuple[str, int]] = []
    for name in VMAPPED:
        orig = getattr(problem, name)

        def spy(cohort, *a, _orig=orig, _name=name, **kw):
            calls.append((_name, len(cohort)))
            return _orig(cohort, *a, **kw)

        setattr(problem, name, spy)
    return calls


def _evaluate(alg, state, problem, client_state, ctx):
    """Deploy every client (FFGG fine-tunes w) and evaluate, in the run's mode."""
    allc = np.arange(problem.num_clients)
    dep = alg.deploy(state, problem, allc, client_state, ctx)
    c = problem.metric_counts(allc, dep.theta, dep.w, mode=ctx.mode)
    return {"acc": float(c["correct"].sum() / c["total"].sum())}


def test_a_loop_executor_never_calls_a_vmapped_kernel():
    """The problem's own default is Vmap, the run's executor a loop: no computation of the
    run — client updates, FFGG's fine-tuning in deploy, the evaluation — is vectorised."""
    pb = ModelProblem(make_split(toy_model(0), "output"), toy_data(), mode=Vmap())
    calls = _spied(pb)
    seen = []
    alg = model_ffgg(CFG, server_opt=SGD(0.5))
    res = run_rounds(pb, alg, 2, clients_per_round=4, seed=1, backend=SequentialBackend(),
                     evaluate=lambda *a: (seen.append(a[-1].mode), _evaluate(*a))[1])
    assert calls == []
    assert seen and all(m == Loop() for m in seen)
    assert 0 <= res.history[-1]["acc"] <= 1
    # the same problem outside a run keeps its own (vectorised) default
    pb.loss(np.arange(4), pb.init_theta(), pb.init_w(np.arange(4), "pretrained", 0, 0))
    assert ("_pass_vmap", 4) in calls


def test_the_executors_vmap_groups_reach_the_kernels():
    """The problem's default is a loop; the run's Vmap(max_examples) decides: minibatch steps
    run vmapped in groups of max_examples // batch_size clients, full passes (the
    evaluation) in groups of max_examples // chunk."""
    pb = ModelProblem(make_split(toy_model(0), "none"), toy_data(), mode=Loop(), chunk=8)
    calls = _spied(pb)
    ex = Executor(Vmap(max_examples=4 * CFG.batch_size))
    run = Run(pb, FedAvg(CFG), Rounds(1, clients_per_round=5), seed=3, executor=ex,
              evaluation=Evaluation(_evaluate))
    execute(run)
    assert {k for name, k in calls if name == "_minibatch_vmap"} == {4}  # [0..3], [4] plain
    assert {k for name, k in calls if name == "_pass_vmap"} == {2}  # 16 // 8: six clients


def test_the_problem_mode_is_only_a_default_given_explicitly():
    split = make_split(toy_model(0), "output")
    data = toy_data()
    assert ModelProblem(split, data).mode == Vmap(MAX_EXAMPLES)  # as before: vmapped, 2048
    assert ModelProblem(split, data, vectorize=False).mode == Loop()  # older spellings
    assert ModelProblem(split, data, vectorize=True, max_vmap_examples=64).mode == Vmap(64)
    assert ModelProblem(split, data, batching=ProcessBackend(workers=1)).mode == Loop()
    with pytest.raises(TypeError, match="mode=… alone"):
        ModelProblem(split, data, mode=Loop(), vectorize=True)
    with pytest.raises(TypeError, match="Vmap or a Loop"):
        ModelProblem(split, data, mode="vmap")
    pb = ModelProblem(split, data, mode=Loop())
    calls = _spied(pb)
    c = np.arange(4)
    w = pb.init_w(c, "pretrained", 0, 0)
    g_loop = pb.grad_theta(c, pb.init_theta(), w)
    assert calls == []
    g_vmap = pb.grad_theta(c, pb.init_theta(), w, mode=Vmap())
    assert calls == [("_full_grad_vmap", 4)]
    assert max((g_loop[n] - g_vmap[n]).abs().max().item() for n in g_loop) < 1e-5


def test_an_executor_names_one_device_for_the_whole_run():
    pb = OverpersonalizedLeastSquares(num_clients=4, n=20, d_theta=3, d_w=2, seed=0)
    with pytest.raises(ValueError, match="CPU worker processes"):
        Executor(ProcessBackend(workers=1), "cuda")
    with pytest.raises(ValueError, match="computes on the CPU"):
        Run(pb, FedAvg(CFG), Rounds(1), executor=Executor(Vmap(), "cuda:0"))
    mp = ModelProblem(make_split(toy_model(0), "none"), toy_data())
    with pytest.raises(ValueError, match="build the problem on the executor's device"):
        Run(mp, FedAvg(CFG), Rounds(1), executor=Executor(Loop(), "mps"))
    assert Executor.of(mp) == Executor(Vmap(), "cpu")
    assert Executor(ProcessBackend(workers=1)).kernel_mode == Loop()


def test_the_keyword_forms_are_the_run_object(tmp_path):
    """run_rounds / run_async build a Run; execute(Run) gives the same runs bit for bit,
    checkpoints and resume included."""
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver
    from partialfl.runtime.asynchronous import ComputeTimeModel, Exponential

    pb = OverpersonalizedLeastSquares(num_clients=6, n=40, d_theta=4, d_w=3, seed=1)
    alg = FFGG(make_solver("gd", 3), SGD(lr=0.05))
    kw = run_rounds(pb, alg, 6, clients_per_round=3, seed=2, eval_every=2,
                    checkpoint=tmp_path / "a", checkpoint_every=3)
    obj = execute(Run(pb, alg, Rounds(6, clients_per_round=3), seed=2,
                      evaluation=Evaluation(every=2),
                      checkpoint=Checkpointing(tmp_path / "b", every=3)))
    assert np.array_equal(kw.state.theta["theta"], obj.state.theta["theta"])
    assert [r["round"] for r in kw.history] == [r["round"] for r in obj.history] == [0, 2, 4, 6]
    execute(Run(pb, alg, Rounds(3, clients_per_round=3), seed=2,
                checkpoint=Checkpointing(tmp_path / "c", every=3)))
    resumed = execute(Run(pb, alg, Rounds(6, clients_per_round=3), seed=2,
                          evaluation=Evaluation(every=2),
                          checkpoint=Checkpointing(tmp_path / "c", every=3, resume=True)))
    assert np.array_equal(resumed.state.theta["theta"], obj.state.theta["theta"])
    ct = ComputeTimeModel(Exponential(1.0))
    a = run_async(pb, alg, steps=8, concurrency=3, compute_time=ct, seed=4)
    b = execute(Run(pb, alg, Arrivals(steps=8, concurrency=3, compute_time=ct), seed=4))
    assert np.array_equal(a.state.theta["theta"], b.state.theta["theta"])
    assert a.events == b.events
    with pytest.raises(ValueError, match="give steps"):
        Arrivals()
    with pytest.raises(ValueError, match="eval_every must be an integer >= 1"):
        Evaluation(every=0)
    with pytest.raises(TypeError, match="Rounds"):
        Run(pb, alg, 5)


def test_the_run_mode_is_in_every_context_the_algorithm_sees():
    """Client updates and server steps of both loops get the executor's kernel mode."""
    from partialfl.algorithms.ffgg import FFGG
    from partialfl.build import make_solver

    class Spy(FFGG):
        modes: list = []

        def client_update(self, state, problem, cohort, ctx, client_state=None):
            self.modes.append(ctx.mode)
            return super().client_update(state, problem, cohort, ctx, client_state)

    pb = OverpersonalizedLeastSquares(num_clients=4, n=20, d_theta=3, d_w=2, seed=0)
    alg = Spy(make_solver("exact"), SGD(lr=0.1))
    execute(Run(pb, alg, Rounds(2), executor=Executor(Vmap(64))))
    execute(Run(pb, alg, Arrivals(steps=3, concurrency=2), executor=Executor(Loop())))
    assert alg.modes[:2] == [Vmap(64)] * 2 and alg.modes[2:] == [Loop()] * len(alg.modes[2:])


def test_a_spec_names_its_executor_once():
    from partialfl.build import executor_of
    from partialfl.config import from_dict
    from partialfl.runtime.backends import BatchedBackend, SequentialBackend
    from partialfl.spec import RunSpec

    ls = from_dict(RunSpec, {"problem": {"name": "least-squares"}})
    assert executor_of(ls) == Executor(BatchedBackend(), "cpu")  # a closed form: vmap
    model = from_dict(RunSpec, {"backend": {"name": "vmap", "max_examples": 64}})
    ex = executor_of(model)
    assert isinstance(ex.mode, BatchedBackend) and ex.kernel_mode == Vmap(64)
    assert executor_of(from_dict(RunSpec, {})).mode == SequentialBackend()  # a model run
