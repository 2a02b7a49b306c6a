"""The three-stage pipeline: configs, stages, checkpoints, resume, new-client evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl.build import Task, build_server_opt
from partialfl.config import ConfigError
from partialfl.io import load_tensors
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.pipeline.evaluation import evaluate_new_clients, evaluate_run
from partialfl.pipeline.files import read_deploy
from partialfl.pipeline.stages import run_pipeline
from partialfl.problems.model import ModelProblem
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, ServerConfig, StageConfig
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _task(data=None, **kw):
    return Task(data=data or toy_data(8), model_fn=toy_model, name="toy", **kw)


def _cfg(algorithm="ffgg", split="output", **kw):
    stage = StageConfig(rounds=4, clients_per_round=3, client=SGDConfig(lr=0.1, batch_size=4),
                        eval_every=2)
    opts = {k: kw.pop(k) for k in list(kw) if k in ("stateless", "local_steps")}
    method = MethodConfig(algorithm=algorithm, split=split, options=opts,
                          **{k: kw.pop(k) for k in list(kw) if k in
                             ("finetune_split", "w_init")})
    return RunSpec(method=method, pretrain=replace_lr(stage, 0.3), personalize=stage,
                          finetune=FinetuneConfig(lr=0.1, epochs=2, batch_size=4),
                          checkpoint_every=1, **kw)


def replace_lr(stage, lr):
    from dataclasses import replace

    return replace(stage, client=replace(stage.client.options, lr=lr))


class Interrupt(Exception):
    pass


def _interrupt_at(stage_name, r):
    def hook(stage, rnd):
        if stage == stage_name and rnd == r:
            raise Interrupt
    return hook


def test_config_validation_names_key_and_allowed_values():
    with pytest.raises(ConfigError, match=r"method.algorithm: 'fedsimm' is not allowed \(did "
                                          r"you mean 'fedsim'\?\); allowed: .*fedalt, fedavg, "):
        RunSpec.from_dict({"method": {"algorithm": "fedsimm"}})
    with pytest.raises(ConfigError, match=r"unknown key 'method.spilt' \(did you mean "
                                          r"'split'\?\); allowed keys in "
                                          r"\[method\]: algorithm, finetune_split"):
        RunSpec.from_dict({"method": {"spilt": "output"}})
    with pytest.raises(ConfigError, match="backend: 'gpu' is not allowed; allowed: "
                                          "processes, sequential, threads, vmap"):
        RunSpec.from_dict({"backend": "gpu"})
    with pytest.raises(ConfigError, match="server.optimizer: 'rmsprop' is not allowed"):
        RunSpec.from_dict({"pretrain": {"server": {"optimizer": "rmsprop"}}})
    with pytest.raises(ConfigError, match="client lr must be a positive"):
        RunSpec.from_dict({"personalize": {"client": {"lr": -1.0}}})
    with pytest.raises(ConfigError, match="fedavg trains one shared model"):
        MethodConfig(algorithm="fedavg", split="output")
    with pytest.raises(ConfigError, match="needs personal parameters"):
        MethodConfig(algorithm="ffgg", split="none")
    with pytest.raises(ConfigError, match="unknown key 'method.stateless'"):
        MethodConfig(algorithm="ffgg", options={"stateless": True})
    with pytest.raises(ConfigError, match=r"rounds.*expected an integer"):
        RunSpec.from_dict({"pretrain": {"rounds": 1.5}})
    cfg = _cfg("fedalt", stateless=True)
    assert RunSpec.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("algorithm,split,extra", [
    ("ffgg", "adapter", {}), ("fedavg", "none", {"finetune_split": "output"}),
    ("fedalt", "output", {}), ("local-ffgg", "input", {"local_steps": 2}),
])
def test_pipeline_end_to_end(tmp_path, algorithm, split, extra):
    cfg = _cfg(algorithm, split, **extra)
    res = run_pipeline(cfg, _task(), tmp_path / "run", progress=False)
    m = res.metrics
    for key in ("test_acc", "test_acc_p10", "test_acc_p50", "test_acc_p90", "train_acc",
                "test_acc_before_ft", "per_client_test_acc"):
        assert key in m
    assert 0 <= m["test_acc"] <= 1 and len(m["per_client_test_acc"]) == 8
    # θ checkpoints after each stage
    s1 = load_tensors(tmp_path / "run" / "stage1" / "theta.safetensors")[0]
    s2 = load_tensors(tmp_path / "run" / "theta_stage2.safetensors")[0]
    assert set(s1) == {n for n, _ in toy_model().named_parameters()}
    assert set(s2) == set(res.split.global_names) if algorithm != "fedavg" else set(s1)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test_acc"] == \
        m["test_acc"]
    h2 = [json.loads(line) for line in (tmp_path / "run" / "stage2.jsonl").open()]
    assert [h["round"] for h in h2] == [0, 2, 4] and all("test_acc" in h for h in h2)
    # stage 2 starts from stage 1: w_pre holds the stage-1 values of the personal layers
    # and the round-0 model of FedAvg / FedAlt is exactly the final stage-1 model
    dep = read_deploy(tmp_path / "run")[0]
    for n, v in dep["w_pretrained"].items():
        if n in s1 and algorithm != "fedavg":
            assert torch.equal(v, s1[n])
    h1 = [json.loads(line) for line in (tmp_path / "run" / "stage1" / "stage1.jsonl").open()]
    if algorithm in ("fedavg", "fedalt"):
        assert h2[0]["test_acc"] == h1[-1]["test_acc"]
    # a finished run is not recomputed
    calls = []
    again = run_pipeline(cfg, _task(), tmp_path / "run", progress=False,
                         on_round=lambda s, r: calls.append((s, r)))
    assert calls == [] and again.metrics["test_acc"] == m["test_acc"]


def test_fedavg_finetune_improves_over_fedavg_on_heterogeneous_clients(tmp_path):
    cfg = _cfg("fedavg", "none", finetune_split="output")
    from dataclasses import replace

    cfg = replace(cfg, finetune=FinetuneConfig(lr=0.3, epochs=20, batch_size=4))
    m = run_pipeline(cfg, _task(), tmp_path / "r", progress=False).metrics
    assert m["test_acc"] > m["test_acc_before_ft"] + 0.1
    assert m["split_counts"]["personal_params"] == 8 * 5 + 5


@pytest.mark.parametrize("stage,at", [("stage2", 2), ("stage1", 1)])
def test_resume_after_interruption_is_exact(tmp_path, stage, at):
    cfg = _cfg("fedsim", "output")
    ref = run_pipeline(cfg, _task(), tmp_path / "ref", progress=False)
    with pytest.raises(Interrupt):
        run_pipeline(cfg, _task(), tmp_path / "cut", progress=False,
                     on_round=_interrupt_at(stage, at))
    assert (tmp_path / "cut" / ("stage1/stage1.ckpt" if stage == "stage1" else
                                "stage2.ckpt")).exists()
    assert not (tmp_path / "cut" / "metrics.json").exists()
    resumed_rounds = []
    res = run_pipeline(cfg, _task(), tmp_path / "cut", progress=False,
                       on_round=lambda s, r: resumed_rounds.append((s, r)))
    assert (stage, 0) not in resumed_rounds  # resumed, not restarted
    assert max_diff(res.theta, ref.theta) == 0
    assert res.metrics["test_acc"] == ref.metrics["test_acc"]
    assert res.metrics["per_client_test_acc"] == ref.metrics["per_client_test_acc"]
    h = [json.loads(line)["round"] for line in (tmp_path / "cut" / "stage2.jsonl").open()]
    assert h == [0, 2, 4]


def test_shared_stage1_and_config_mismatch(tmp_path):
    a = run_pipeline(_cfg("ffgg", "output"), _task(), tmp_path / "a",
                     stage1_dir=tmp_path / "s1", progress=False)
    calls = []
    run_pipeline(_cfg("fedalt", "output"), _task(), tmp_path / "b", stage1_dir=tmp_path / "s1",
                 progress=False, on_round=lambda s, r: calls.append(s))
    assert "stage1" not in calls and a.metrics
    with pytest.raises(ConfigError, match="different configuration"):
        run_pipeline(_cfg("fedsim", "output"), _task(), tmp_path / "a", progress=False)
    other = _cfg("ffgg", "output", seed=0)
    from dataclasses import replace

    other = replace(other, pretrain=replace(other.pretrain, rounds=5))
    with pytest.raises(ConfigError, match="stage-1 pre-training"):
        run_pipeline(other, _task(), tmp_path / "c", stage1_dir=tmp_path / "s1", progress=False)


def test_evaluate_run_on_new_clients(tmp_path):
    data = toy_data(10, seed=3)
    seen, new = data.split_clients(num_new=3, seed=0)
    run_pipeline(_cfg("ffgg", "output"), _task(seen), tmp_path / "r", progress=False)
    res = evaluate_run(tmp_path / "r", new, model_fn=toy_model)
    assert res["num_clients"] == 3 and res["split"] == "output"
    zero = evaluate_run(tmp_path / "r", new, model_fn=toy_model, finetune_epochs=0)
    assert zero["test"].accuracy == zero["before"].accuracy == res["before"].accuracy
    # brute force: fine-tune by hand with the run's settings and count hits
    dep = read_deploy(tmp_path / "r")[0]
    split = make_split(toy_model(), "output")
    pb = ModelProblem(split, new, w_pretrained=dep["w_pretrained"], vectorize=False)
    c = np.arange(3)
    w = run_sgd(pb, c, dep["theta"], pb.init_w(c, "pretrained", 0, -1), train="w",
                cfg=SGDConfig(lr=0.1, epochs=2, batch_size=4), seed=0, round_=-1,
                stream="new-clients").w
    hits = tot = 0
    for m in c:
        out = torch.func.functional_call(pb.module, {**dep["theta"], **{n: v[m] for n, v in
                                         w.items()}}, (new.test_x[m],))
        hits += (out.argmax(1) == new.test_y[m]).sum().item()
        tot += len(new.test_y[m])
    assert res["test"].accuracy == pytest.approx(hits / tot)
    with pytest.raises(FileNotFoundError, match="run the pipeline"):
        evaluate_run(tmp_path / "nothing", new, model_fn=toy_model)


def test_evaluate_new_clients_argument_errors():
    model = toy_model()
    theta = make_split(model, "output").params()[0]
    data = toy_data(3)
    with pytest.raises(KeyError, match="missing"):
        evaluate_new_clients({}, model, "output", data, lr=0.1)
    with pytest.raises(ValueError, match="pass the model"):
        evaluate_new_clients(theta, None, "output", data, lr=0.1)
    r = evaluate_new_clients(theta, model, "output", data, 1, lr=0.1)
    assert set(r) == {"test", "train", "before", "num_clients", "split"}


def test_task_split_fn_is_used(tmp_path):
    seen = []

    def split_fn(model, kind, options):
        seen.append(kind)
        if kind == "none":
            return make_split(model, "none")
        return make_split(model, "pattern", personal=[r"^mid\."])

    cfg = _cfg("ffgg", "pattern")
    res = run_pipeline(cfg, _task(split_fn=split_fn), tmp_path / "r", progress=False)
    assert seen == ["none", "pattern"]
    assert set(res.split.personal_names) == {"mid.weight", "mid.bias"}


def test_server_config_builds_schedules_and_clipping():
    warm = {"name": "warmup-linear", "warmup": 2}
    opt = build_server_opt(ServerConfig("adam", 0.01, schedule=warm, clip_norm=1.0), 10)
    assert type(opt).__name__ == "Clipped" and opt.inner.schedule.total == 10
    with pytest.raises(ConfigError, match="warmup-linear needs"):
        build_server_opt(ServerConfig("sgd", 1.0, schedule={**warm, "warmup": 20}), 10)
    with pytest.raises(ConfigError, match="server.schedule: 'cosine' is not allowed"):
        ServerConfig("sgd", 1.0, schedule="cosine")


def test_a_shared_stage2_gives_each_run_its_own_numbers(tmp_path):
    """FedAvg's stage 2 does not depend on the part stage 3 fine-tunes: a FedAvg + FT run
    reusing another FedAvg run's stage 2 (``stage2_dir``) computes no round and gets the
    numbers of a run of its own; a folder holding another stage 2 is refused."""
    from dataclasses import replace

    ft = _cfg("fedavg", "none", finetune_split="output")
    own = run_pipeline(ft, _task(), tmp_path / "own", stage1_dir=tmp_path / "s1",
                       progress=False).metrics
    plain = run_pipeline(_cfg("fedavg", "none"), _task(), tmp_path / "plain",
                         stage1_dir=tmp_path / "s1", progress=False).metrics
    calls = []
    shared = run_pipeline(ft, _task(), tmp_path / "shared", stage1_dir=tmp_path / "s1",
                          stage2_dir=tmp_path / "plain", progress=False,
                          on_round=lambda s, r: calls.append(s)).metrics
    assert calls == [] and not (tmp_path / "shared" / "stage2.jsonl").exists()
    for k in ("test_acc", "test_acc_before_ft", "per_client_test_correct", "train_acc"):
        assert shared[k] == own[k], k
    assert own["test_acc_before_ft"] == plain["test_acc"]  # FT starts from FedAvg's model
    longer = replace(ft, personalize=replace(ft.personalize, rounds=5))
    with pytest.raises(ConfigError, match="holds the stage 2 of another configuration"):
        run_pipeline(longer, _task(), tmp_path / "x", stage1_dir=tmp_path / "s1",
                     stage2_dir=tmp_path / "plain", progress=False)
    # a fresh shared folder records the stage 2 it holds; its owner must match it later
    run_pipeline(ft, _task(), tmp_path / "y", stage1_dir=tmp_path / "s1",
                 stage2_dir=tmp_path / "fresh", progress=False)
    assert (tmp_path / "fresh" / "stage2.json").exists()
    with pytest.raises(ConfigError, match="different configuration"):
        run_pipeline(longer, _task(), tmp_path / "fresh", stage1_dir=tmp_path / "s1",
                     progress=False)


def test_fedavg_then_adapter_fine_tuning(tmp_path):
    """FedAvg + FT with the adapter split (stage 3 inserts zero-output adapters into FedAvg's
    model, then fine-tunes them per client): before fine-tuning it is FedAvg's model
    exactly; fine-tuning moves it; new clients rebuild the adapters from deploy.safetensors."""
    from dataclasses import replace

    data = toy_data(10, seed=3)
    seen, new = data.split_clients(num_new=3, seed=0)
    cfg = _cfg("fedavg", "none", finetune_split="adapter")
    cfg = replace(cfg, finetune=FinetuneConfig(lr=0.3, epochs=5, batch_size=4))
    plain = run_pipeline(_cfg("fedavg", "none"), _task(seen), tmp_path / "plain",
                         stage1_dir=tmp_path / "s1", progress=False).metrics
    m = run_pipeline(cfg, _task(seen), tmp_path / "ad", stage1_dir=tmp_path / "s1",
                     stage2_dir=tmp_path / "plain", progress=False).metrics
    assert m["test_acc_before_ft"] == plain["test_acc"]
    assert m["per_client_test_correct"] != plain["per_client_test_correct"]
    counts = m["split_counts"]
    assert counts["personal_params"] > 0 and counts["global_params"] == sum(
        p.numel() for p in toy_model().parameters())
    groups, meta = read_deploy(tmp_path / "ad")
    assert meta["built_as"] == "adapter" and any("adapter" in n for n in groups["w_pretrained"])
    ev = evaluate_run(tmp_path / "ad", new, model_fn=toy_model)
    ev0 = evaluate_run(tmp_path / "plain", new, model_fn=toy_model)
    assert ev["before"].accuracy == ev0["test"].accuracy  # zero adapters: FedAvg's model
    assert ev["test"].per_client_correct.tolist() != ev["before"].per_client_correct.tolist()
