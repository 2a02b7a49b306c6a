"""Privacy in the simulator: nothing derived from a client's personal w reaches the server —
neither its messages (checked on the one message path) nor its files (private checkpoints)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from _nn_toy import toy_data, toy_model
from conftest import SMALL

from partialfl import io as pio
from partialfl.algorithms import Scaffold
from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.model import FedAlt, FedAvg
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.build import Task
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.stages import run_pipeline
from partialfl.privacy import CLIENT_METRICS, PrivacyError
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.problems.model import ModelProblem
from partialfl.runtime import run_rounds
from partialfl.runtime.asynchronous import run_async
from partialfl.runtime.checkpoint import CLIENT, SERVER, Checkpoint
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig
from partialfl.split import make_split
from partialfl.types import ClientUpdates


class Spy(AlgorithmWrapper):
    """Records every message the server receives."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.seen: list[ClientUpdates] = []

    def server_update(self, state, updates, ctx):
        self.seen.append(updates)
        return self.base.server_update(state, updates, ctx)


class Leaky(AlgorithmWrapper):
    """A client that tries to send something personal, in one of several ways."""

    def __init__(self, base, how: str) -> None:
        super().__init__(base)
        self.how = how

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u, k = res.updates, len(cohort)
        metrics, vectors, extra = dict(u.metrics), dict(u.vectors), dict(u.extra)
        w = {n: v[cohort] for n, v in problem.init_w(np.arange(problem.num_clients), "zero",
                                                     0, 0).items()}
        w0 = next(iter(w.values()))
        if self.how == "vector-metric":
            metrics["train_loss"] = w0.reshape(k, -1).numpy()
        elif self.how == "text-metric":  # w as text, under an allowed metric name
            metrics["train_loss"] = np.array([repr(r.tolist()) for r in w0], dtype=object)
        elif self.how == "unknown-metric":
            metrics["loss_gap"] = np.zeros(k)
        elif self.how == "personal-vector":
            vectors.update(w)
        elif self.how == "theta-name-extra":  # w's values under θ's leaf names
            extra["dc"] = {n: (v.reshape(k, -1)[:, :1] * 0 + w0.reshape(k, -1)[:, :1]).expand(
                v.shape[0], v[0].numel()).reshape(v.shape) for n, v in vectors.items()}
        elif self.how == "packed-vector":  # a θ name, but rows that are not θ-shaped
            n = next(iter(vectors))
            vectors[n] = torch.cat([vectors[n].reshape(k, -1), w0.reshape(k, -1)], 1)
        else:
            extra["w"] = w
        return ClientResult(ClientUpdates(vectors, u.weights, u.cohort, u.grad_evals, metrics,
                                          extra), res.client_state)


def _model_problem(split="output"):
    return ModelProblem(make_split(toy_model(), split), toy_data(4), vectorize=False)


@pytest.mark.parametrize("how,match", [
    ("vector-metric", "one scalar per client"),
    ("text-metric", "'train_loss' must be a float per client"),
    ("unknown-metric", "'loss_gap' is not allowed"),
    ("personal-vector", "not global parameters"),
    ("extra", "extra\\['w'\\] is not declared"),
    ("theta-name-extra", "extra\\['dc'\\] is not declared"),
    ("packed-vector", "not one θ-shaped row per client"),
])
def test_a_personal_payload_never_reaches_the_server(how, match):
    p = _model_problem()
    alg = Spy(Leaky(FedAlt(SGDConfig(lr=0.1, epochs=1, batch_size=4)), how))
    with pytest.raises(PrivacyError, match=match):
        run_rounds(p, alg, 2, clients_per_round=2)
    assert alg.seen == []  # refused before the server saw anything
    with pytest.raises(PrivacyError, match=match):
        run_async(p, alg, steps=2, concurrency=2)


def test_the_server_sees_no_per_client_metric():
    p = ModelProblem(make_split(toy_model(), "none"), toy_data(4), vectorize=False)
    alg = Spy(FedAvg(SGDConfig(lr=0.1, epochs=1, batch_size=4)))
    run_rounds(p, alg, 2, clients_per_round=3)
    assert alg.seen and all(dict(u.metrics) == {} for u in alg.seen)
    names = set(p.theta_names)
    for u in alg.seen:
        assert set(u.vectors) <= names and not u.extra
    assert "train_loss" in CLIENT_METRICS  # allowed to be computed, kept on the client


def test_simulator_checkpoint_keeps_client_state_in_a_client_side_file(tmp_path):
    p = LeastSquaresProblem(SMALL, basis="standard")
    ckpt = tmp_path / "s.ckpt"
    res = run_rounds(p, Scaffold(3), 4, clients_per_round=3, seed=1, checkpoint=ckpt,
                     checkpoint_every=2)
    files = Checkpoint(ckpt).files()
    body, meta = pio.load_state(files[SERVER])
    assert "client" not in body and "client_state" not in body["server"]
    assert meta["side"] == "server"
    cfile = files[CLIENT]
    assert cfile.name == "s.g2.client-side.ckpt"
    cs, cmeta = pio.load_state(cfile)
    assert cmeta["side"] == "client" and set(cs) == {"c_theta", "c_w"}
    np.testing.assert_array_equal(cs["c_w"], res.client_state["c_w"])
    # no tensor of the server's files equals any client's personal control variate
    rows = [r for r in res.client_state["c_w"] if np.abs(r).sum() > 0]
    assert rows
    for f in (ckpt, files[SERVER]):
        tensors, _ = pio.load_tensors(f)
        for t in tensors.values():
            flat = np.asarray(t).reshape(-1)
            for r in rows:
                assert not (flat.size == r.size and np.allclose(flat, r))
    # resuming reads the client-side file back: exact continuation
    full = run_rounds(p, Scaffold(3), 6, clients_per_round=3, seed=1)
    again = run_rounds(p, Scaffold(3), 6, clients_per_round=3, seed=1, checkpoint=ckpt,
                       checkpoint_every=2, resume=True)
    for n in full.state.theta:
        np.testing.assert_array_equal(full.state.theta[n], again.state.theta[n])


def test_non_private_checkpoints_are_an_explicit_choice(tmp_path):
    p = LeastSquaresProblem(SMALL, basis="standard")
    ckpt = tmp_path / "s.ckpt"
    run_rounds(p, Scaffold(3), 2, checkpoint=ckpt, checkpoint_every=2,
               private_checkpoints=False)
    files = Checkpoint(ckpt).files()
    body, _ = pio.load_state(files[SERVER])
    assert set(body["client"]) == {"c_theta", "c_w"} and CLIENT not in files


def test_no_server_side_pipeline_file_holds_personal_values(tmp_path):
    st = StageConfig(rounds=1, clients_per_round=2, client=SGDConfig(lr=0.1, batch_size=4),
                     eval_every=1)
    cfg = RunSpec(method=MethodConfig(algorithm="fedalt", split="output"), pretrain=st,
                         personalize=st, finetune=FinetuneConfig(lr=0.1, epochs=1, batch_size=4),
                         checkpoint_every=1)
    run_pipeline(cfg, Task(toy_data(4), toy_model, name="toy"), tmp_path / "r", progress=False)
    run = tmp_path / "r"
    client_files = sorted(p.name for p in run.iterdir() if "client-side" in p.name)
    assert client_files[0] == "client_state_stage2.client-side.safetensors"
    assert len(client_files) == 2 and re.fullmatch(r"stage2\.g\d+\.client-side\.ckpt",
                                                   client_files[1])
    w, _ = pio.load_tensors(run / client_files[0])
    w_pre = pio.load_tensors(run / "deploy.safetensors")[0]
    # the rows a client trained (an unsampled client still holds the global w_pre)
    personal = [v[m].reshape(-1) for n, v in w.items() for m in range(v.shape[0])
                if not torch.equal(v[m], w_pre[f"w_pretrained/{n}"])]
    assert personal
    for f in run.rglob("*"):
        if f.suffix not in (".ckpt", ".safetensors") or "client-side" in f.name:
            continue
        tensors, _ = pio.load_tensors(f)
        for name, t in tensors.items():
            t = torch.as_tensor(t).reshape(-1)
            for v in personal:
                assert not (t.numel() == v.numel() and torch.equal(t, v)), (f.name, name)


class _InfLoss(AlgorithmWrapper):
    """Client 1's train_loss is infinite in round 0 (its update is fine)."""

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        u = res.updates
        loss = np.asarray(u.metrics["train_loss"], dtype=float).copy()
        loss[(np.asarray(cohort) == 1) & (ctx.round == 0)] = np.inf
        return ClientResult(ClientUpdates(u.vectors, u.weights, u.cohort, u.grad_evals,
                                          {"train_loss": loss}, u.extra), res.client_state)


def test_a_refused_client_is_skipped_and_counted_the_others_pass():
    """A message refused by value (here an infinite metric) drops that client only; it is
    counted as ``updates_refused`` and θ equals the run without its update."""
    from partialfl.runtime.faults import DropClients

    p = _model_problem()

    def fedalt():
        return FedAlt(SGDConfig(lr=0.1, epochs=1, batch_size=4))

    res = run_rounds(p, _InfLoss(fedalt()), 2, seed=1)
    ref = run_rounds(p, DropClients(fedalt(), [(0, 1)]), 2, seed=1)
    for n in ref.state.theta:
        assert torch.equal(res.state.theta[n], ref.state.theta[n])
    assert res.faults.refused == 1 and res.history[-1]["updates_refused"] == 1


def test_wrappers_forward_every_declaration_of_the_wrapped_algorithm():
    """FaultInjector(Ditto) and ByzantineRobust(Ditto) run (they were refused with a false
    PrivacyError: the wrapper dropped Ditto's client_metrics); a wrapper's own assignment
    overrides only that wrapper's value."""
    from partialfl.aggregation import CoordinateMedian
    from partialfl.algorithms.byzantine import ByzantineRobust
    from partialfl.algorithms.ditto import Ditto
    from partialfl.algorithms.wrapper import MIRRORED
    from partialfl.runtime.faults import FaultInjector

    p = ModelProblem(make_split(toy_model(), "none"), toy_data(4), vectorize=False)
    sgd = SGDConfig(lr=0.1, batch_size=4)
    for wrap in (lambda a: FaultInjector(a), lambda a: ByzantineRobust(a, CoordinateMedian())):
        base = Ditto(sgd, sgd, 0.5)
        alg = wrap(base)
        for attr in MIRRORED:
            if attr not in ("name", "aggregator", "fixed_extra"):
                assert getattr(alg, attr) is getattr(base, attr), attr
        # ByzantineRobust adds its planned cohort to what a resumed state must keep
        assert set(base.fixed_extra) <= set(alg.fixed_extra)
        res = run_rounds(p, alg, 1, clients_per_round=2)
        assert res.faults.refused == 0 and res.state.round == 1
    br = ByzantineRobust(Ditto(sgd, sgd, 0.5), CoordinateMedian())
    assert br.name == "br-ditto" and br.base.name == "ditto"
    assert isinstance(br.aggregator, CoordinateMedian) and br.client_metrics == ("personal_loss",)


def test_server_metrics_pass_as_float64_without_nan_payloads():
    from partialfl.privacy import server_view

    class Reads(FedAvg):
        server_metrics = ("train_loss",)

    payload = np.array([np.nan, 1.5]).view(np.uint64)
    payload[0] |= 0x1234  # a NaN whose mantissa carries bits
    up = ClientUpdates({"x": np.zeros((2, 3))}, np.ones(2), np.arange(2),
                       metrics={"train_loss": payload.view(np.float64)})
    got = server_view(up, Reads(SGDConfig(lr=0.1)))
    assert got.metrics["train_loss"].dtype == np.float64
    assert got.metrics["train_loss"].view(np.uint64)[0] == np.array(np.nan).view(np.uint64)
    assert got.metrics["train_loss"][1] == 1.5


@pytest.mark.parametrize("wdtype", [np.int8, np.uint16, np.int32, np.float16, np.float32])
def test_the_server_view_fixes_the_dtypes_a_client_may_choose(wdtype):
    """A client may send its weights in any integer or float dtype and its ids in any integer
    dtype; that choice (a few bits, e.g. picked from w_m) must not reach the server: the
    server's view holds float64 weights and int64 ids of the same values."""
    from partialfl.privacy import server_view
    from partialfl.types import ClientUpdates

    up = ClientUpdates({"a": np.ones((2, 3), np.float32)}, np.array([3, 5], dtype=wdtype),
                       np.array([4, 7], dtype=np.uint8), 2, {}, {})
    seen = server_view(up)
    assert seen.weights.dtype == np.float64 and seen.cohort.dtype == np.int64
    assert seen.weights.tolist() == [3.0, 5.0] and seen.cohort.tolist() == [4, 7]


def test_plain_never_hands_over_a_rows_strides_or_version_counter():
    """Round 39a's channels at the unit level: a size-1 axis with a chosen stride, a tensor's
    version counter and a read-only flag never survive :func:`partialfl.arrays.plain`."""
    from partialfl.arrays import plain

    a = np.zeros((1, 4), np.float32)
    odd = np.lib.stride_tricks.as_strided(a, (1, 4), (123456, 4))
    assert plain(odd).strides == (16, 4)
    ro = np.zeros(3)
    ro.flags.writeable = False
    assert plain(ro).flags.writeable
    t = torch.zeros(1, 4)
    t.add_(1).add_(1)  # version 2
    p = plain(t)
    assert p is not t and p._version <= 1 and p.stride() == (4, 1)
    assert torch.equal(p, t)
    fresh = np.zeros((2, 2))
    assert plain(fresh) is fresh  # a canonical array the caller owns is not copied
