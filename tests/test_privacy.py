"""Privacy in the simulator: nothing derived from a client's personal w reaches the server —
neither its messages (checked on the one message path) nor its files (private checkpoints)."""

from __future__ import annotations

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
from partialfl.runtime.sync import client_side_path
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
        if self.how == "vector-metric":
            metrics["train_loss"] = next(iter(w.values())).reshape(k, -1).numpy()
        elif self.how == "unknown-metric":
            metrics["loss_gap"] = np.zeros(k)
        elif self.how == "personal-vector":
            vectors.update(w)
        else:
            extra["w"] = w
        return ClientResult(ClientUpdates(vectors, u.weights, u.cohort, u.grad_evals, metrics,
                                          extra), res.client_state)


def _model_problem(split="output"):
    return ModelProblem(make_split(toy_model(), split), toy_data(4), vectorize=False)


@pytest.mark.parametrize("how,match", [
    ("vector-metric", "one scalar per client"),
    ("unknown-metric", "'loss_gap' is not allowed"),
    ("personal-vector", "not global parameters"),
    ("extra", "not global parameters"),
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
    server, meta = pio.load_state(ckpt)
    assert "client_state" not in server and meta["side"] == "server"
    cfile = client_side_path(ckpt)
    assert cfile.name == "s.client-side.ckpt"
    cs, cmeta = pio.load_state(cfile)
    assert cmeta["side"] == "client" and set(cs) == {"c_theta", "c_w"}
    np.testing.assert_array_equal(cs["c_w"], res.client_state["c_w"])
    # no tensor of the server file equals any client's personal control variate
    tensors, _ = pio.load_tensors(ckpt)
    rows = [r for r in res.client_state["c_w"] if np.abs(r).sum() > 0]
    assert rows
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
    server, _ = pio.load_state(ckpt)
    assert "client_state" in server and not client_side_path(ckpt).exists()


def test_no_server_side_pipeline_file_holds_personal_values(tmp_path):
    st = StageConfig(rounds=1, clients_per_round=2, client=SGDConfig(lr=0.1, batch_size=4),
                     eval_every=1)
    cfg = RunSpec(method=MethodConfig(algorithm="fedalt", split="output"), pretrain=st,
                         personalize=st, finetune=FinetuneConfig(lr=0.1, epochs=1, batch_size=4),
                         checkpoint_every=1)
    run_pipeline(cfg, Task(toy_data(4), toy_model, name="toy"), tmp_path / "r", progress=False)
    run = tmp_path / "r"
    client_files = sorted(p.name for p in run.iterdir() if "client-side" in p.name)
    assert client_files == ["client_state_stage2.client-side.safetensors",
                            "stage2.client-side.ckpt"]
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
