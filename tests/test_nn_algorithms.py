"""Algorithms on model problems: FFGG, Local FFGG, FedAvg, FedAlt, FedSim."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.model import FedAlt, FedAvg, FedSim, LocalFFGG, model_ffgg
from partialfl.local.sgd import SGDConfig, SGDFineTuner, run_sgd
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.server import SGD, Adam, Clipped
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


CFG = SGDConfig(lr=0.2, batch_size=4)
ALGOS = {
    "fedavg": (lambda: FedAvg(CFG), "none"),
    "ffgg": (lambda: model_ffgg(CFG, server_opt=SGD(0.5)), "output"),
    "ffgg-adapter": (lambda: model_ffgg(CFG, init="random", server_opt=Adam(0.01)), "adapter"),
    "local-ffgg": (lambda: LocalFFGG(CFG, SGDConfig(lr=0.2, batch_size=4, steps=3)), "adapter"),
    "fedalt": (lambda: FedAlt(CFG), "output"),
    "fedsim": (lambda: FedSim(CFG, server_opt=Clipped(SGD(1.0), 0.5)), "input"),
    "fedalt-stateless": (lambda: FedAlt(CFG, stateless=True), "output"),
    "fedsim-pattern": (lambda: FedSim(CFG), "pattern"),
}


def _problem(kind, vectorize=True, data=None):
    opts = {"personal": [r"^mid\."]} if kind == "pattern" else {}
    if kind == "adapter":
        opts["seed"] = 0
    return ModelProblem(make_split(toy_model(0), kind, **opts), data or toy_data(),
                        vectorize=vectorize)


@pytest.mark.parametrize("name", list(ALGOS))
def test_batched_vmap_and_sequential_backends_give_the_same_theta(name):
    make, kind = ALGOS[name]
    data = toy_data()
    out = {}
    for vec, backend in ((True, BatchedBackend()), (False, SequentialBackend())):
        pb = _problem(kind, vec, data)
        out[vec] = run_rounds(pb, make(), 3, clients_per_round=4, seed=2, backend=backend,
                              evaluate=round_evaluator(), eval_every=3)
    a, b = out[True], out[False]
    assert max_diff(a.state.theta, b.state.theta) < 1e-5
    assert a.history[-1]["test_acc"] == pytest.approx(b.history[-1]["test_acc"], abs=1e-9)
    if a.client_state is not None:
        assert max_diff(a.client_state, b.client_state) < 1e-5
    # θ moved
    theta0 = _problem(kind, True, data).init_theta()
    assert max_diff(a.state.theta, theta0) > 1e-4


def test_ffgg_sends_the_theta_gradient_at_the_finetuned_w():
    pb = _problem("output")
    alg = model_ffgg(CFG, server_opt=SGD(0.5))
    state = alg.init(pb, pb.init_theta())
    cohort = np.array([0, 3, 4])
    res = alg.client_update(state, pb, cohort, RoundContext(7, 2))
    w = SGDFineTuner(CFG)(pb, cohort, state.theta, 7, 2).w
    ref = pb.grad_theta(cohort, state.theta, w)
    assert max_diff(res.updates.vectors, ref) == 0
    assert set(res.updates.vectors) == set(pb.theta_names)
    new = alg.server_update(state, res.updates, RoundContext(7, 2))
    for n in state.theta:
        torch.testing.assert_close(new.theta[n], state.theta[n] - 0.5 * ref[n].mean(0))


def test_fedavg_one_full_batch_step_is_gradient_descent_and_refuses_personal():
    pb = _problem("none", vectorize=False)
    n = int(pb.num_examples(np.array([2]))[0])
    alg = FedAvg(SGDConfig(lr=0.3, batch_size=n))
    state = alg.init(pb, pb.init_theta())
    res = alg.client_update(state, pb, np.array([2]), RoundContext(0, 0))
    g = pb.grad_theta(np.array([2]), state.theta, {})
    new = alg.server_update(state, res.updates, RoundContext(0, 0))
    for k in state.theta:
        torch.testing.assert_close(new.theta[k], state.theta[k] - 0.3 * g[k][0])
    with pytest.raises(ValueError, match="split 'none'"):
        alg.client_update(state, _problem("output"), np.array([0]), RoundContext(0, 0))


def test_local_ffgg_is_one_w_epoch_then_alternating_steps():
    pb = _problem("adapter", vectorize=False)
    local = SGDConfig(lr=0.2, batch_size=4, steps=3)
    alg = LocalFFGG(CFG, local)
    state = alg.init(pb, pb.init_theta())
    c = np.array([3])
    res = alg.client_update(state, pb, c, RoundContext(1, 4))
    w = pb.init_w(c, "pretrained", 1, 4)
    r1 = run_sgd(pb, c, state.theta, w, train="w", cfg=CFG, seed=1, round_=4, stream="finetune")
    r2 = run_sgd(pb, c, state.theta, r1.w, train="alternate", cfg=local, seed=1, round_=4,
                 stream="local")
    for n in state.theta:
        torch.testing.assert_close(res.updates.vectors[n][0], r2.theta[n][0] - state.theta[n])
    assert res.updates.grad_evals == r1.steps + 2 * 3


def test_fedalt_fedsim_keep_w_on_clients():
    pb = _problem("output")
    for cls in (FedAlt, FedSim):
        res = run_rounds(pb, cls(CFG), 2, clients_per_round=2, seed=0)
        cs0 = cls(CFG).init_client_state(pb)
        moved = [m for m in range(pb.num_clients)
                 if not torch.equal(res.client_state["fc.weight"][m], cs0["fc.weight"][m])]
        sampled = set()
        from partialfl.runtime import sample_cohort

        for r in range(2):
            sampled |= set(sample_cohort(0, r, pb.num_clients, 2).tolist())
        assert set(moved) == sampled
        dep = cls(CFG).deployed(res.state, pb, res.client_state, RoundContext(0, 2))
        assert max_diff(dep.w, res.client_state) == 0
    assert FedAlt(CFG, stateless=True).init_client_state(pb) is None
    with pytest.raises(ValueError, match="holds client state"):
        FedAlt(CFG).client_update(FedAlt(CFG).init(pb, pb.init_theta()), pb, np.array([0]),
                                  RoundContext(0, 0), None)


def test_fedalt_trains_w_then_theta():
    pb = _problem("output", vectorize=False)
    alg = FedAlt(CFG)
    state = alg.init(pb, pb.init_theta())
    c = np.array([2])
    cs = {n: v[c] for n, v in alg.init_client_state(pb).items()}
    res = alg.client_update(state, pb, c, RoundContext(3, 1), cs)
    r1 = run_sgd(pb, c, state.theta, cs, train="w", cfg=CFG, seed=3, round_=1, stream="local-w")
    r2 = run_sgd(pb, c, state.theta, r1.w, train="theta", cfg=CFG, seed=3, round_=1,
                 stream="local-theta")
    assert max_diff(res.client_state, r1.w) == 0
    assert max_diff(res.updates.vectors, {n: r2.theta[n] - state.theta[n]
                                          for n in state.theta}) == 0


def _check_no_leak(make, kind: str, name: str) -> None:
    """Everything the server receives (updates: vectors, extra, metrics) and holds (state)
    is keyed by global names only, and no personal value a client ever used or produced
    appears in it (the toy model's personal `mid` has the shape of the global `mid2`)."""
    for vec, backend in ((True, BatchedBackend()), (False, SequentialBackend())):
        pb = _problem(kind, vec)
        seen_w: list[torch.Tensor] = []
        orig = pb.minibatch_grads

        def spy(cohort, theta, w, batches, wrt, orig=orig, seen_w=seen_w, **kw):
            for v in w.values():
                seen_w.extend(v.detach().clone())
            return orig(cohort, theta, w, batches, wrt, **kw)

        pb.minibatch_grads = spy
        orig_plain = pb.plain_sgd

        def spy_plain(client, theta, w, *a, orig=orig_plain, seen_w=seen_w):
            out = orig(client, theta, w, *a)
            seen_w.extend(v.detach().clone() for tree in (w, out[1]) for v in tree.values())
            return out

        pb.plain_sgd = spy_plain  # one client's steps in a loop (the sequential backend)
        orig_head = pb.head_finetune_grad

        def spy_head(client, theta, w, *a, orig=orig_head, seen_w=seen_w):
            out = orig(client, theta, w, *a)
            seen_w.extend(v.detach().clone() for tree in (w, out[0]) for v in tree.values())
            return out

        pb.head_finetune_grad = spy_head  # FFGG's one-pass client (w the output layer)
        alg = make()
        received = []
        server_update = alg.server_update

        def spy_server(state, updates, ctx, server_update=server_update, received=received):
            received.append(updates)
            return server_update(state, updates, ctx)

        alg.server_update = spy_server
        res = run_rounds(pb, alg, 2, clients_per_round=3, seed=1, backend=backend)
        if res.client_state is not None:
            seen_w.extend(t for v in res.client_state.values() for t in v)
        personal = set(pb.w_names)
        assert set(res.state.theta) == set(pb.theta_names)
        assert not personal & set(res.state.extra)
        sent = []
        for up in received:
            assert set(up.vectors) == set(pb.theta_names)
            assert not personal & set(up.metrics)
            for tree in up.extra.values():
                assert not personal & set(tree)
                sent.extend(t for v in tree.values() for t in v)
            sent.extend(t for v in up.vectors.values() for t in v)
        sent.extend(res.state.theta.values())
        if personal:
            assert seen_w, "the spy saw no personal values"
        for s in sent:
            for w in seen_w:
                if s.shape == w.shape:
                    assert not torch.equal(s, w), f"a personal value reached the server ({name})"


@pytest.mark.parametrize("name", list(ALGOS))
def test_no_personal_parameter_reaches_the_server(name):
    make, kind = ALGOS[name]
    if kind == "none":  # FedAvg has no personal side; it refuses a problem that has one
        with pytest.raises(ValueError, match="split 'none'"):
            run_rounds(_problem("pattern"), make(), 1, clients_per_round=2, seed=0)
    _check_no_leak(make, kind, name)


def test_the_leak_check_catches_a_leaky_algorithm():
    class Leaky(FedSim):
        def client_update(self, state, problem, cohort, ctx, client_state=None):
            res = super().client_update(state, problem, cohort, ctx, client_state)
            res.updates.vectors["mid2.weight"] = res.client_state["mid.weight"].clone()
            return res

    with pytest.raises(AssertionError, match="a personal value reached the server"):
        _check_no_leak(lambda: Leaky(CFG), "pattern", "leaky")


def test_clipped_server_optimizer():
    opt = Clipped(SGD(1.0), 1.0)
    theta = {"a": torch.zeros(2), "b": torch.zeros(1)}
    new, _ = opt.step(theta, {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])},
                      opt.init(theta), 0)
    torch.testing.assert_close(new["a"], torch.tensor([-0.6, 0.0]))
    torch.testing.assert_close(new["b"], torch.tensor([-0.8]))
    small, _ = opt.step(theta, {"a": torch.tensor([0.3, 0.0]), "b": torch.tensor([0.4])},
                        None, 0)
    torch.testing.assert_close(small["b"], torch.tensor([-0.4]))
    with pytest.raises(ValueError, match="max_norm"):
        Clipped(SGD(1.0), 0.0)


def test_bad_options():
    with pytest.raises(ValueError, match="allowed: uniform, examples"):
        FedAvg(CFG, weighting="size")
    with pytest.raises(ValueError, match="allowed: pretrained, zero, random"):
        FedSim(CFG, w_init="ones")
    with pytest.raises(ValueError, match="allowed: pretrained, zero, random"):
        model_ffgg(CFG, init="ones")
