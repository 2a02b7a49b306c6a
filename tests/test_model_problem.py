"""Model problems (functional evaluation, vmap vs plain paths) and the local SGD loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _nn_toy import max_diff, one_thread, toy_data, toy_model
from torch import nn

from partialfl.local.sgd import SGDConfig, SGDFineTuner, batch_plan, run_sgd
from partialfl.pipeline.evaluation import evaluate_model, summarize_counts
from partialfl.problems.model import ModelProblem, masked_token_accuracy
from partialfl.rng import generator
from partialfl.split import make_split

KINDS = ["output", "input", "adapter"]


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _problem(kind="output", vectorize=True, data=None, **kw):
    split = make_split(toy_model(0), kind)
    return ModelProblem(split, data or toy_data(), vectorize=vectorize, **kw)


def _reference_loss_and_grads(problem, m, theta, w):
    """Plain autograd on a copy of the module holding (θ, w_m): mean CE over client m."""
    model = problem.module
    params = {**theta, **{n: v[m] for n, v in w.items()}}
    leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
    out = torch.func.functional_call(model, leaves, (problem.data.train_x[m],))
    loss = F.cross_entropy(out, problem.data.train_y[m])
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.item(), dict(zip(leaves, grads))


@pytest.mark.parametrize("kind", KINDS)
def test_full_data_quantities_match_brute_force(kind):
    pb = _problem(kind, chunk=4)  # several chunks per client
    theta = pb.init_theta()
    cohort = np.arange(pb.num_clients)
    w = pb.init_w(cohort, "random", 3, 0)
    gt, gw, loss = pb.grad_theta(cohort, theta, w), pb.grad_w(cohort, theta, w), \
        pb.loss(cohort, theta, w)
    for m in cohort:
        ref_loss, ref = _reference_loss_and_grads(pb, m, theta, w)
        assert loss[m] == pytest.approx(ref_loss, rel=1e-5)
        for n in theta:
            torch.testing.assert_close(gt[n][m], ref[n], rtol=1e-4, atol=1e-6)
        for n in w:
            torch.testing.assert_close(gw[n][m], ref[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("train", ["w", "theta", "both", "alternate"])
def test_vmap_and_plain_paths_agree(kind, train):
    data = toy_data()
    res = {}
    for vec in (True, False):
        pb = _problem(kind, vectorize=vec, data=data, chunk=5)
        c = np.arange(pb.num_clients)
        theta, w = pb.init_theta(), pb.init_w(c, "random", 1, 2)
        cfg = SGDConfig(lr=0.2, batch_size=4, epochs=2, clip_norm=2.0)
        r = run_sgd(pb, c, theta, w, train=train, cfg=cfg, seed=5, round_=2, stream="t")
        th = r.theta if train != "w" else theta
        res[vec] = (r, pb.grad_theta(c, th, r.w), pb.metric_counts(c, th, r.w, "test"))
    (a, ga, ca), (b, gb, cb) = res[True], res[False]
    assert max_diff(a.theta, b.theta) < 1e-5 and max_diff(a.w, b.w) < 1e-5
    assert max_diff(ga, gb) < 1e-5
    assert np.array_equal(ca["correct"], cb["correct"])
    np.testing.assert_allclose(ca["loss_sum"], cb["loss_sum"], rtol=1e-5)
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5)
    assert a.steps == b.steps == max(len(p) for p in (batch_plan(
        int(n), 4, 2, None, generator(5, "t", 2, i)) for i, n in enumerate(
        toy_data().train_sizes())))


def test_results_do_not_depend_on_the_cohort():
    pb = _problem("output")
    theta = pb.init_theta()
    cfg = SGDConfig(lr=0.3, batch_size=3, epochs=1)
    full = np.array([0, 2, 4, 5])
    r_all = run_sgd(pb, full, theta, pb.init_w(full, "pretrained", 0, 0), train="both",
                    cfg=cfg, seed=0, round_=1, stream="x")
    one = run_sgd(pb, np.array([4]), theta, pb.init_w(np.array([4]), "pretrained", 0, 0),
                  train="both", cfg=cfg, seed=0, round_=1, stream="x")
    for n in one.w:
        torch.testing.assert_close(one.w[n][0], r_all.w[n][2], rtol=0, atol=1e-6)
    for n in one.theta:
        torch.testing.assert_close(one.theta[n][0], r_all.theta[n][2], rtol=0, atol=1e-6)


def test_one_full_batch_step_is_gradient_descent():
    pb = _problem("output", vectorize=False)
    c = np.array([0])
    theta, w = pb.init_theta(), pb.init_w(c, "random", 0, 0)
    n = int(pb.num_examples(c)[0])
    cfg = SGDConfig(lr=0.5, batch_size=n, epochs=1)
    r = run_sgd(pb, c, theta, w, train="both", cfg=cfg, seed=0, round_=0, stream="x")
    gt, gw = pb.grad_theta(c, theta, w), pb.grad_w(c, theta, w)
    for k in theta:
        torch.testing.assert_close(r.theta[k][0], theta[k] - 0.5 * gt[k][0])
    for k in w:
        torch.testing.assert_close(r.w[k][0], w[k][0] - 0.5 * gw[k][0])
    assert r.steps == 1


def test_clipping_bounds_the_step():
    pb = _problem("output", vectorize=False)
    c = np.array([0])
    theta, w = pb.init_theta(), pb.init_w(c, "random", 0, 0)
    n = int(pb.num_examples(c)[0])
    gw = pb.grad_w(c, theta, w)
    gnorm = torch.sqrt(sum((v ** 2).sum() for v in gw.values())).item()
    clip = gnorm / 10
    r = run_sgd(pb, c, theta, w, train="w", cfg=SGDConfig(lr=1.0, batch_size=n, clip_norm=clip),
                seed=0, round_=0, stream="x")
    step = torch.sqrt(sum(((r.w[k] - w[k]) ** 2).sum() for k in w)).item()
    assert step == pytest.approx(clip, rel=1e-4)
    for k in w:  # same direction as the gradient
        torch.testing.assert_close(r.w[k] - w[k], -gw[k] / 10, rtol=1e-4, atol=1e-7)


def test_batch_plan_is_seeded_epochs_cover_data():
    p1 = batch_plan(10, 4, 2, None, generator(1, "s", 0, 3))
    p2 = batch_plan(10, 4, 2, None, generator(1, "s", 0, 3))
    assert [len(b) for b in p1] == [4, 4, 2, 4, 4, 2]
    assert all(np.array_equal(a, b) for a, b in zip(p1, p2))
    assert sorted(np.concatenate(p1[:3])) == list(range(10))
    assert sorted(np.concatenate(p1[3:])) == list(range(10))
    assert not np.array_equal(np.concatenate(p1[:3]), np.concatenate(
        batch_plan(10, 4, 1, None, generator(1, "s", 1, 3))))
    assert [len(b) for b in batch_plan(10, 4, 1, 7, generator(0))] == [4, 4, 2, 4, 4, 2, 4]
    assert batch_plan(0, 4, 3, None, generator(0)) == []


def test_init_w_kinds():
    pb = _problem("output")
    c = np.array([0, 3])
    pre = pb.init_w(c, "pretrained", 0, 0)
    for n, v in pre.items():
        assert torch.equal(v[0], pb.w_pretrained[n]) and torch.equal(v[1], v[0])
    assert all(v.abs().sum() == 0 for v in pb.init_w(c, "zero", 0, 0).values())
    r1, r2 = pb.init_w(c, "random", 7, 4), pb.init_w(c, "random", 7, 4)
    assert max_diff(r1, r2) == 0
    assert not torch.equal(r1["fc.weight"][0], r1["fc.weight"][1])
    assert not torch.equal(r1["fc.weight"][0], pre["fc.weight"][0])
    r3 = pb.init_w(np.array([3]), "random", 7, 4)  # per (seed, round, client)
    assert torch.equal(r3["fc.weight"][0], r1["fc.weight"][1])
    assert not torch.equal(pb.init_w(c, "random", 7, 5)["fc.weight"], r1["fc.weight"])
    bound = 1 / np.sqrt(8)  # nn.Linear(8, 5) default init
    assert r1["fc.weight"].abs().max() <= bound
    with pytest.raises(ValueError, match="allowed: pretrained, zero, random"):
        pb.init_w(c, "ones", 0, 0)
    # fresh adapters keep a zero output
    pa = _problem("adapter")
    ra = pa.init_w(c, "random", 1, 0)
    assert ra["fc.adapter.up.weight"].abs().sum() == 0
    assert ra["fc.adapter.down.weight"].abs().sum() > 0


def test_finetuner_and_evaluation():
    pb = _problem("output")
    c = np.arange(pb.num_clients)
    theta = pb.init_theta()
    w0 = pb.init_w(c, "pretrained", 0, 0)
    sol = SGDFineTuner(SGDConfig(lr=0.5, epochs=20, batch_size=8))(pb, c, theta, 0, 0)
    assert (pb.loss(c, theta, sol.w) < pb.loss(c, theta, w0)).all()
    ev = evaluate_model(pb, theta, sol.w, "train")
    counts = pb.metric_counts(c, theta, sol.w, "train")
    # brute force: accuracy of each client's own model on its training data
    for m in c:
        out = torch.func.functional_call(pb.module, {**theta, **{n: v[m] for n, v in
                                         sol.w.items()}}, (pb.data.train_x[m],))
        hits = (out.argmax(1) == pb.data.train_y[m]).sum().item()
        assert counts["correct"][m] == hits and counts["total"][m] == len(pb.data.train_y[m])
    assert ev.accuracy == pytest.approx(counts["correct"].sum() / counts["total"].sum())


def test_summarize_counts_percentiles():
    ev = summarize_counts({"correct": np.array([1, 9, 0, 5]), "total": np.array([2, 10, 0, 5]),
                           "loss_sum": np.ones(4), "loss_weight": np.array([2, 10, 0, 5])})
    assert ev.accuracy == pytest.approx(15 / 17)
    assert np.isnan(ev.per_client[2])
    np.testing.assert_allclose(ev.per_client[[0, 1, 3]], [0.5, 0.9, 1.0])
    assert ev.p50 == pytest.approx(0.9) and ev.p10 == pytest.approx(0.58)
    assert ev.mean_client == pytest.approx(0.8)


def test_token_loss_and_masked_metric():
    """A (sum, count) loss and a masked per-token metric (next-word style) are supported."""

    class Lm(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 6)
            self.out = nn.Linear(6, 7)

        def forward(self, x):
            return self.out(self.emb(x))

    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(1, 7, (n, 5), generator=g) for n in (3, 4)]
    ys = [torch.where(torch.rand(x.shape, generator=g) < 0.3, 0, (x + 1) % 7) for x in xs]
    from partialfl.data.federated import FederatedDataset

    ds = FederatedDataset(xs, ys, xs, ys, ["a", "b"], 7)

    def loss_fn(out, y):
        ce = F.cross_entropy(out.transpose(1, 2), y, reduction="none", ignore_index=0)
        valid = (y != 0).float()
        return (ce * valid).sum(-1), valid.sum(-1)

    for vec in (True, False):
        pb = ModelProblem(make_split(Lm(), "output"), ds, loss_fn=loss_fn,
                          metric=masked_token_accuracy(0), vectorize=vec)
        c = np.arange(2)
        theta, w = pb.init_theta(), pb.init_w(c, "pretrained", 0, 0)
        loss = pb.loss(c, theta, w)
        counts = pb.metric_counts(c, theta, w, "train")
        for m in c:
            out = pb.module(xs[m])
            ref = F.cross_entropy(out.transpose(1, 2), ys[m], ignore_index=0)
            assert loss[m] == pytest.approx(ref.item(), rel=1e-5)
            assert counts["total"][m] == (ys[m] != 0).sum().item()
            hits = ((out.argmax(-1) == ys[m]) & (ys[m] != 0)).sum().item()
            assert counts["correct"][m] == hits


def test_errors():
    class WithBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(1, 2, 3)
            self.bn = nn.BatchNorm2d(2, track_running_stats=False)
            self.fc = nn.Linear(72, 5)

        def forward(self, x):
            return self.fc(self.bn(self.c(x)).flatten(1))

    with pytest.raises(ValueError, match="'bn' is a BatchNorm without running statistics"):
        ModelProblem(make_split(WithBN(), "output"), toy_data())
    pb = _problem()
    c = np.array([0])
    with pytest.raises(ValueError, match="shape"):
        pb.grad_theta(c, {n: v[None, None] for n, v in pb.init_theta().items()},
                      pb.init_w(c, "zero", 0, 0))
    with pytest.raises(ValueError, match="client ids must be in"):
        pb.num_examples(np.array([99]))
    with pytest.raises(TypeError, match="no known smoothness"):
        pb.lipschitz_w(c)
    with pytest.raises(ValueError, match="allowed: w, theta, both, alternate"):
        run_sgd(pb, c, pb.init_theta(), pb.init_w(c, "zero", 0, 0), train="all",
                cfg=SGDConfig(lr=0.1), seed=0, round_=0, stream="x")
    with pytest.raises(ValueError, match="client lr"):
        SGDConfig(lr=0)
    with pytest.raises(KeyError, match="personal values"):
        ModelProblem(make_split(toy_model(), "output"), toy_data(), w_pretrained={"x": 1})


def test_one_client_kernels_without_a_mask_equal_a_mask_of_ones_bit_for_bit():
    """The one-client kernels pass no mask (no padding): ℓ·1 = ℓ exactly, so the loss, its
    gradient and the forward sums are those of a mask of ones, bit for bit; and the flat data
    is gathered with index_select, the same rows as indexing."""
    pb = _problem("output", vectorize=False)
    store = pb._store["train"]
    idx = torch.tensor([[3, 0, 5], [1, 1, 2]])
    x, y = store.take(idx)
    assert torch.equal(x, store.x[idx]) and torch.equal(y, store.y[idx])
    x, y = store.gather(1, np.array([2, 0, 1]))
    theta, w = pb.split.params()
    train, frozen, _, _ = pb._arrange(theta, w, None, "both")
    ones = torch.ones(len(y))
    for kernel in (pb._plain_sum, lambda *a: pb._plain_step(a[0], a[1], {}, *a[2:])):
        g1, aux1 = kernel(train, frozen, x, y, ones, None)
        g0, aux0 = kernel(train, frozen, x, y, None, None)
        assert all(torch.equal(g1[n], g0[n]) for n in g1)
        assert torch.equal(aux1 if torch.is_tensor(aux1) else aux1[0],
                           aux0 if torch.is_tensor(aux0) else aux0[0])
    params = {**theta, **w}
    assert all(torch.equal(a, b) for a, b in zip(pb._forward_fn(params, x, y, ones),
                                                 pb._forward_fn(params, x, y, None)))
