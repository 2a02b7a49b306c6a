"""BatchNorm running statistics as personal client state (ModelProblem, run_sgd, algorithms)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _nn_toy import max_diff, one_thread, toy_bn_model, toy_data
from torch import nn

from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.model import FedAvg, FedSim, model_ffgg
from partialfl.algorithms.presets import build_preset
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.runtime import BatchedBackend, SequentialBackend, run_rounds
from partialfl.server import SGD
from partialfl.split import make_split

CFG = SGDConfig(lr=0.1, batch_size=4)
STATS = ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked",
         "bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked")


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _problem(kind="output", vectorize=True, data=None):
    return ModelProblem(make_split(toy_bn_model(0), kind), data or toy_data(),
                        vectorize=vectorize)


def _distinct_stats(pb, w):
    """Give every client different running statistics (so mixing them up shows)."""
    k = next(iter(w.values())).shape[0]
    out = dict(w)
    for n in pb.state_names:
        if n.endswith("num_batches_tracked"):
            out[n] = torch.arange(k) + 3
        else:
            r = torch.linspace(0.0, 1.0, k * w[n].shape[1]).reshape(k, -1)
            out[n] = (0.5 + r) if n.endswith("running_var") else 0.2 * (r - 0.5)
    return out


def _plain(pb, theta, w, i):
    """A plain copy of the module with client i's θ, w and running statistics loaded."""
    mod = copy.deepcopy(pb.module)
    own = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
    with torch.no_grad():
        for n, v in {**theta, **{n: v[i] for n, v in w.items()}}.items():
            own[n].copy_(v)
    return mod


def test_running_statistics_are_personal_state_not_parameters():
    pb = _problem()
    assert pb.state_names == STATS
    assert not set(STATS) & set(pb.w_names) and not set(STATS) & set(pb.theta_names)
    c = np.arange(3)
    w = pb.init_w(c, "pretrained", 0, 0)
    assert set(w) == set(pb.w_names) | set(STATS)
    assert torch.equal(w["bn1.running_var"], torch.ones(3, 4))
    z = pb.init_w(c, "zero", 0, 0)
    assert torch.equal(z["fc.weight"], torch.zeros(3, 5, 64))
    assert torch.equal(z["bn2.running_var"], torch.ones(3, 4))  # a fresh layer's, not zeros
    with pytest.raises(KeyError, match="lacks the running statistics"):
        pb.loss(c, pb.init_theta(), {n: w[n] for n in pb.w_names})
    # gradients are never taken w.r.t. running statistics
    g = pb.grad_w(c, pb.init_theta(), w)
    assert set(g) == set(pb.w_names)


@pytest.mark.parametrize("wrt", ["w", "theta", "both"])
def test_a_minibatch_step_is_a_train_mode_forward_of_the_plain_module(wrt):
    """Gradient, loss and the updated running statistics equal those of the plain module in
    train mode on the same batch — on the vmap path (clients grouped by batch size, no
    padding) and the plain path; a client without a batch keeps its statistics."""
    data = toy_data()
    c = np.array([0, 2, 3, 4])
    batches = [np.arange(4), np.array([3, 1, 0]), None, np.array([2, 0, 1, 4])]
    for vec in (True, False):
        pb = _problem("output", vec, data)
        theta = pb.init_theta()
        w = _distinct_stats(pb, pb.init_w(c, "random", 0, 0))
        g, loss, st = pb.minibatch_grads(c, theta, w, batches, wrt, with_state=True)
        assert set(st) == set(STATS)
        for i, m in enumerate(c):
            if batches[i] is None:
                assert all(torch.equal(st[n][i], w[n][i]) for n in STATS)
                assert all(torch.count_nonzero(v[i]) == 0 for v in g.values())
                continue
            mod = _plain(pb, theta, w, i).train()
            x, y = data.train_x[m][batches[i]], data.train_y[m][batches[i]]
            ref = F.cross_entropy(mod(x), y)
            ref.backward()
            assert loss[i].item() == pytest.approx(ref.item(), rel=1e-5)
            own = dict(mod.named_parameters())
            for n in g:
                assert torch.allclose(g[n][i], own[n].grad, atol=1e-5), (vec, n)
            bufs = dict(mod.named_buffers())
            for n in STATS:
                assert torch.allclose(st[n][i].double(), bufs[n].double(), atol=1e-6), n
            assert not torch.equal(st["bn1.running_mean"][i], w["bn1.running_mean"][i])


def test_full_passes_use_each_clients_running_statistics_in_eval_mode():
    data = toy_data()
    c = np.arange(data.num_clients)
    for vec in (True, False):
        pb = _problem("output", vec, data)
        theta = pb.init_theta()
        w = _distinct_stats(pb, pb.init_w(c, "random", 0, 0))
        loss = pb.loss(c, theta, w)
        counts = pb.metric_counts(c, theta, w, "test")
        for i in c:
            mod = _plain(pb, theta, w, i).eval()
            with torch.no_grad():
                out = mod(data.train_x[i])
                tout = mod(data.test_x[i])
            assert loss[i] == pytest.approx(F.cross_entropy(out, data.train_y[i]).item(),
                                            rel=1e-5)
            assert counts["correct"][i] == (tout.argmax(-1) == data.test_y[i]).sum().item()
        # the statistics matter: other statistics give another loss
        w2 = {**w, "bn2.running_var": w["bn2.running_var"] * 2.0}
        assert np.all(np.abs(pb.loss(c, theta, w2) - loss) > 1e-6)


def test_run_sgd_carries_the_statistics_whatever_is_trained():
    pb = _problem()
    c = np.array([0, 2])
    w = pb.init_w(c, "pretrained", 0, 0)
    cfg = SGDConfig(lr=0.1, batch_size=4, epochs=2)
    res = run_sgd(pb, c, pb.init_theta(), w, train="theta", cfg=cfg, seed=0, round_=0,
                  stream="s")
    assert torch.equal(res.w["fc.weight"], w["fc.weight"])  # w not trained ...
    steps = [len(range(0, int(n), 4)) * 2 for n in pb.num_examples(c)]
    assert res.w["bn1.num_batches_tracked"].tolist() == steps  # ... but the stats moved
    assert max_diff({"m": res.w["bn2.running_mean"]}, {"m": w["bn2.running_mean"]}) > 1e-3


ALGOS = {
    "fedsim-output": (lambda: FedSim(CFG), "output"),
    "fedavg": (lambda: FedAvg(CFG), "none"),
    "ffgg": (lambda: model_ffgg(CFG, server_opt=SGD(0.5)), "output"),
}


@pytest.mark.parametrize("name", list(ALGOS))
def test_bn_cnn_trains_and_backends_agree(name):
    make, kind = ALGOS[name]
    data = toy_data()
    out = {}
    for vec, backend in ((True, BatchedBackend()), (False, SequentialBackend())):
        pb = _problem(kind, vec, data)
        out[vec] = run_rounds(pb, make(), 4, clients_per_round=4, seed=3, backend=backend,
                              evaluate=round_evaluator(("train",)), eval_every=4)
    a, b = out[True], out[False]
    assert max_diff(a.state.theta, b.state.theta) < 1e-5
    assert a.history[-1]["train_loss"] == pytest.approx(b.history[-1]["train_loss"], rel=1e-5)
    assert a.history[-1]["train_loss"] < a.history[0]["train_loss"] - 0.05
    if name != "ffgg":  # stateful: the statistics are kept on the clients, per client
        assert set(STATS) <= set(a.client_state)
        assert max_diff(a.client_state, b.client_state) < 1e-5
        rm = a.client_state["bn1.running_mean"]
        assert not torch.allclose(rm[0], rm[2])


def _leaks(received, stats_seen, names) -> list[str]:
    """Names and values of running statistics among what the server received."""
    found = []
    for up in received:
        fields = {**up.vectors, **{f"{e}.{n}": v for e, t in up.extra.items()
                                   for n, v in t.items()}}
        found += [n for n in (*fields, *up.metrics) if any(s in n for s in names)]
        for n, v in fields.items():
            for row in v:
                for s in stats_seen:
                    if row.shape == s.shape and torch.allclose(row.double(), s.double()):
                        found.append(f"value of {n}")
    return found


def test_fedbn_no_running_statistic_reaches_the_server():
    """FedBN on the BatchNorm CNN: capture every update the server receives; no running
    statistic is among them by name or by value (the conv biases have the statistics' shape,
    so a statistic sent under a global name would be found)."""
    alg, split = build_preset("fedbn", toy_bn_model(0), CFG)
    pb = ModelProblem(split, toy_data())
    received, stats_seen = [], []
    server_update, client_update = alg.server_update, alg.client_update

    def spy_server(state, updates, ctx):
        received.append(updates)
        return server_update(state, updates, ctx)

    def spy_client(state, problem, cohort, ctx, client_state=None):
        res = client_update(state, problem, cohort, ctx, client_state)
        stats_seen.extend(t.clone() for n in STATS if "running" in n
                          for t in res.client_state[n])
        return res

    alg.server_update, alg.client_update = spy_server, spy_client
    res = run_rounds(pb, alg, 3, clients_per_round=4, seed=0)
    assert len(received) == 3 and stats_seen
    init = pb.init_w(np.arange(1), "pretrained", 0, 0)
    assert not torch.allclose(stats_seen[0], init["bn1.running_mean"][0])  # they moved
    assert _leaks(received, stats_seen, ("running_", "num_batches", "bn1.", "bn2.")) == []
    for up in received:
        assert set(up.vectors) == {"c1.weight", "c1.bias", "c2.weight", "c2.bias",
                                   "fc.weight", "fc.bias"}
    assert not set(res.state.theta) & set(STATS)
    # the check itself finds a statistic smuggled in under a global name
    bad = received[0].vectors["c1.bias"].clone()
    bad[1] = stats_seen[5]
    leaky = type(received[0])({**received[0].vectors, "c1.bias": bad}, received[0].weights,
                              received[0].cohort)
    assert _leaks([leaky], stats_seen, ("running_",)) == ["value of c1.bias"]


def test_bf16_bn_steps_run_and_agree_across_backends():
    """torch cannot differentiate a train-mode BatchNorm under vmap + autocast; the vmap
    problem then steps client by client and takes the plain problem's steps."""
    data = toy_data()
    out = []
    for vec, backend in ((True, BatchedBackend()), (False, SequentialBackend())):
        alg, split = build_preset("fedbn", toy_bn_model(0), CFG)
        pb = ModelProblem(split, data, vectorize=vec, precision="bf16")
        res = run_rounds(pb, alg, 2, clients_per_round=3, seed=0, backend=backend)
        out.append({**res.state.theta, **res.client_state})
        assert res.client_state["bn1.running_mean"].dtype == torch.float32
    assert max_diff(out[0], out[1]) < 1e-5
    # the running statistics were updated (in fp32) by the bf16 forward passes
    assert out[0]["bn2.num_batches_tracked"].max() > 0
    assert out[0]["bn2.running_mean"].abs().max() > 1e-3
    assert max_diff(out[0], {**pb.init_theta(), **pb.init_w(np.arange(6), "pretrained", 0,
                                                            0)}) > 1e-3


def test_refused_batchnorm_variants():
    class Cum(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(1, 2, 3)
            self.bn = nn.BatchNorm2d(2, momentum=None)
            self.fc = nn.Linear(72, 5)

        def forward(self, x):
            return self.fc(self.bn(self.c(x)).flatten(1))

    with pytest.raises(ValueError, match="'bn' has momentum=None"):
        ModelProblem(make_split(Cum(), "output"), toy_data())
    pb = ModelProblem(make_split(Cum(), "output"), toy_data(), vectorize=False)
    assert "bn.running_mean" in pb.state_names


def test_the_pipeline_deploys_the_clients_own_statistics(tmp_path):
    """FedAvg on a BatchNorm CNN through the three stages: stage 3 evaluates each client with
    the running statistics it kept in stage 2 (not the untrained layer's 0 / 1)."""
    from partialfl.build import Task
    from partialfl.pipeline.evaluation import evaluate_model
    from partialfl.pipeline.files import load_params
    from partialfl.pipeline.stages import run_pipeline
    from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig

    data = toy_data(8)
    stage = StageConfig(rounds=2, clients_per_round=3, client=SGDConfig(lr=0.1, batch_size=4))
    cfg = RunSpec(method=MethodConfig(algorithm="fedavg", split="none"), pretrain=stage,
                         personalize=stage, finetune=FinetuneConfig(lr=0.1, epochs=1))
    res = run_pipeline(cfg, Task(data=data, model_fn=toy_bn_model, name="bn"), tmp_path,
                       progress=False)
    from partialfl.io import load_tensors

    stats, _ = load_tensors(tmp_path / "client_state_stage2.client-side.safetensors")
    assert set(stats) == set(STATS)
    pb = ModelProblem(make_split(load_params(toy_bn_model(0), res.theta), "none"), data)
    allc = np.arange(pb.num_clients)
    assert res.metrics["test_acc"] == evaluate_model(pb, res.theta, stats, "test").accuracy
    fresh = pb.init_w(allc, "pretrained", 0, 0)
    assert res.metrics["test_loss"] != evaluate_model(pb, res.theta, fresh, "test").loss


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (none on this machine): BatchNorm under vmap on CUDA")
def test_fedbn_on_cuda_takes_the_cpu_steps():
    """With TF32 off: CUDA's default convolutions round their inputs to 10-bit mantissas,
    which alone moved this run 9e-3 from the CPU's on a lent H200 (1.2e-7 with TF32 off), so
    the test failed there until it asked for fp32."""
    data = toy_data()
    out = {}
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for dev in ("cpu", "cuda"):
            alg, split = build_preset("fedbn", toy_bn_model(0), CFG)
            res = run_rounds(ModelProblem(split, data, device=dev), alg, 3,
                             clients_per_round=4, seed=0)
            out[dev] = {n: v.cpu() for n, v in {**res.state.theta, **res.client_state}.items()}
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    assert set(STATS) <= set(out["cuda"])
    assert max_diff(out["cpu"], out["cuda"]) < 1e-4


def test_fedavg_without_client_state_restarts_the_statistics_each_round():
    """A runtime that holds no client state (the Flower app): FedAvg's clients start from the
    model's running statistics every round and send only Δθ."""
    pb = _problem("none")
    alg = FedAvg(CFG)
    st = alg.init(pb, pb.init_theta())
    res = alg.client_update(st, pb, np.array([0, 2]), RoundContext(0, 0), None)
    assert res.client_state is None
    assert set(res.updates.vectors) == set(pb.theta_names)
    dep = alg.deployed(st, pb, None, RoundContext(0, 1))
    assert torch.equal(dep.w["bn1.running_var"], torch.ones(pb.num_clients, 4))


def test_running_statistics_in_the_on_disk_client_state_store(tmp_path):
    """FedBN with its client state (BatchNorm layers and int64 batch counts included) in the
    on-disk store takes the in-memory run's steps."""
    from partialfl.algorithms.disk_state import OnDiskClientState

    data = toy_data()
    out = []
    for disk in (False, True):
        alg, split = build_preset("fedbn", toy_bn_model(0), CFG)
        alg = OnDiskClientState(alg, tmp_path / "state") if disk else alg
        res = run_rounds(ModelProblem(split, data), alg, 2, clients_per_round=3, seed=0)
        cs = res.client_state
        out.append({**res.state.theta, **{n: torch.as_tensor(cs[n][np.arange(6)])
                                           for n in STATS}})
    assert out[1]["bn1.num_batches_tracked"].dtype == torch.int64
    assert max_diff(out[0], out[1]) == 0.0


def test_processes_backend_and_pickling_keep_the_statistics_exact():
    """FedBN on worker processes equals the sequential run bit for bit (statistics too); a
    pickled problem (spawned workers) toggles its own module's BatchNorm layers."""
    import pickle

    from partialfl.runtime.cohort_pool import ProcessBackend

    data = toy_data()
    out = []
    for backend in (SequentialBackend(), ProcessBackend(workers=2)):
        alg, split = build_preset("fedbn", toy_bn_model(0), CFG)
        pb = ModelProblem(split, data, vectorize=False)
        res = run_rounds(pb, alg, 2, clients_per_round=4, seed=3, backend=backend)
        if isinstance(backend, ProcessBackend):
            backend.close()
        out.append({**res.state.theta, **res.client_state})
    assert max_diff(out[0], out[1]) == 0
    pb2 = pickle.loads(pickle.dumps(pb))
    mods = dict(pb2.module.named_modules())
    assert pb2._norm_modules[0] is mods["bn1"] and pb2._norm_modules[1] is mods["bn2"]
    c = np.array([0, 2])
    w = pb.init_w(c, "pretrained", 0, 0)
    a = pb.minibatch_grads(c, pb.init_theta(), w, [np.arange(3)] * 2, "both", with_state=True)
    b = pb2.minibatch_grads(c, pb.init_theta(), w, [np.arange(3)] * 2, "both", with_state=True)
    assert max_diff(a[0], b[0]) == 0 and max_diff(a[2], b[2]) == 0


def test_plain_autograd_step_equals_functorch_with_running_statistics():
    """The sequential path's plain-autograd step and the functorch step give the same
    gradient, loss and updated statistics on a BatchNorm model."""
    pb = _problem("output", vectorize=False)
    c = np.array([3])
    w = _distinct_stats(pb, pb.init_w(c, "random", 0, 0))
    w_par, stats = pb._split_state({n: v[0] for n, v in w.items()})
    train, frozen, _, _ = pb._arrange(pb.init_theta(), w_par, None, "both")
    x, y = pb._store["train"].gather(3, np.arange(5))
    g, (loss, st) = pb._plain_step(train, frozen, stats, x, y, torch.ones(5), None)
    g_ref, (loss_ref, st_ref) = pb._step_fn(train, frozen, stats, x, y, torch.ones(5), None)
    assert max_diff(g, g_ref) < 1e-6 and abs(loss.item() - loss_ref.item()) < 1e-6
    assert max_diff(st, st_ref) < 1e-7 and max_diff(st, stats) > 1e-3
