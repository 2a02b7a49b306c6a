"""The personalized models as a product: personalize, evaluate, save, load
(partialfl.pipeline.deploy)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_bn_model, toy_data, toy_model
from safetensors.torch import load_file, save_file

from partialfl.algorithms.model import FedSim, model_ffgg
from partialfl.algorithms.presets import build_preset
from partialfl.data.federated import FederatedDataset
from partialfl.io import UnsafeFileError
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.deploy import (
    FORMAT,
    PersonalizedModels,
    load_personalized,
    personalize,
    read_index,
)
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.runtime import run_rounds
from partialfl.server import SGD
from partialfl.split import make_split

CFG = SGDConfig(lr=0.1, batch_size=4)


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _plain_accuracy(module, data, m) -> tuple[int, int]:
    with torch.no_grad():
        out = module(data.test_x[m])
    return int((out.argmax(-1) == data.test_y[m]).sum()), len(data.test_y[m])


def test_save_load_gives_identical_per_client_accuracies(tmp_path):
    """FedBN on a BatchNorm CNN: each client's saved model (θ, its BatchNorm layers and running
    statistics), loaded into a freshly built module, has exactly the accuracy the evaluation
    table reports for that client id."""
    data = toy_data()
    alg, split = build_preset("fedbn", toy_bn_model(0), CFG)
    pb = ModelProblem(split, data)
    res = run_rounds(pb, alg, 3, clients_per_round=4, seed=1)
    models = personalize(pb, alg, res, seed=1, metadata={"note": "test"})
    table = models.evaluate("test")
    assert table.client_ids == data.client_ids
    out = models.save(tmp_path / "dep")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["clients/000000.safetensors", "clients/000001.safetensors",
                     "clients/000002.safetensors", "clients/000003.safetensors",
                     "clients/000004.safetensors", "clients/000005.safetensors",
                     "index.json", "theta.safetensors"]
    index = read_index(out)
    assert index["format"] == FORMAT and index["split"] == "norm"
    assert index["metadata"] == {"algorithm": "fedbn", "rounds": 3, "seed": 1, "note": "test"}
    assert "bn1.running_mean" in index["state_names"]
    accs = {}
    for m, cid in enumerate(data.client_ids):
        fresh = toy_bn_model(123)  # other initial values: everything must come from the files
        net = load_personalized(out, fresh, cid)
        assert net is fresh and not net.training
        for n, v in {**dict(net.named_parameters()), **dict(net.named_buffers())}.items():
            assert torch.equal(v, models.params(cid)[n]), n
        c, t = _plain_accuracy(net, data, m)
        assert table[cid]["correct"] == c and table[cid]["total"] == t
        assert table.accuracy[m] == c / t
        accs[cid] = c / t
        c2, _ = _plain_accuracy(models.module(cid), data, m)
        assert c2 == c
    # the clients' models differ (their own BatchNorm layers and statistics)
    a, b = models.params(data.client_ids[0]), models.params(data.client_ids[2])
    assert not torch.equal(a["bn1.running_mean"], b["bn1.running_mean"])
    assert torch.equal(a["c1.weight"], b["c1.weight"])
    assert table.pooled_accuracy == pytest.approx(
        sum(table[c]["correct"] for c in accs) / sum(table[c]["total"] for c in accs))
    assert "| c3 |" in table.to_markdown()
    # the whole folder back on a fresh module, evaluated on (some of) the clients' data
    back = PersonalizedModels.load(out, toy_bn_model(321))
    again = back.evaluate(data=data)
    np.testing.assert_array_equal(again.correct, table.correct)
    np.testing.assert_allclose(again.loss, table.loss, rtol=1e-6)
    some = _subset(data, [4, 1])
    part = back.evaluate(data=some)
    assert part.client_ids == ("c4", "c1")
    for c in ("c4", "c1"):
        assert part[c]["correct"] == table[c]["correct"] and part[c]["total"] == table[c]["total"]
        assert part[c]["loss"] == pytest.approx(table[c]["loss"], rel=1e-6)


def _subset(data, positions):
    return FederatedDataset([data.train_x[i] for i in positions],
                            [data.train_y[i] for i in positions],
                            [data.test_x[i] for i in positions],
                            [data.test_y[i] for i in positions],
                            [data.client_ids[i] for i in positions], data.num_classes)


def test_personalize_ffgg_deploys_what_the_run_evaluated():
    """FFGG fine-tunes w_m from θ (seeded by the run's seed): the deployed models' pooled
    accuracy is the run's last evaluation."""
    data = toy_data()
    pb = ModelProblem(make_split(toy_model(0), "output"), data)
    alg = model_ffgg(CFG, server_opt=SGD(0.5))
    res = run_rounds(pb, alg, 2, clients_per_round=3, seed=5, evaluate=round_evaluator(),
                     eval_every=2)
    table = personalize(pb, alg, res, seed=5).evaluate()
    assert table.pooled_accuracy == pytest.approx(res.history[-1]["test_acc"], abs=1e-12)
    assert personalize(pb, alg, res.state.theta, seed=5).evaluate().pooled_accuracy == \
        table.pooled_accuracy


def test_adapter_models_load_into_the_plain_architecture(tmp_path):
    data = toy_data()
    pb = ModelProblem(make_split(toy_model(0), "adapter", seed=0, rank=2), data)
    alg = FedSim(CFG)
    res = run_rounds(pb, alg, 2, clients_per_round=3, seed=0)
    models = personalize(pb, alg, res)
    table = models.evaluate()
    models.save(tmp_path)
    for m, cid in enumerate(data.client_ids):
        net = load_personalized(tmp_path, toy_model(9), m)  # by position
        assert "fc.adapter.down.weight" in dict(net.named_parameters())
        assert _plain_accuracy(net, data, m) == (table[cid]["correct"], table[cid]["total"])
    back = PersonalizedModels.load(tmp_path, toy_model(9)).evaluate(data=data)
    np.testing.assert_array_equal(back.correct, table.correct)
    # a received index naming another rank (10^9 would allocate first) is refused in a line
    import json

    from partialfl import io as pio

    f = next(tmp_path.rglob("index.json"))
    index = json.loads(f.read_text())
    index["adapters"]["rank"] = 10**9
    f.write_text(json.dumps(index))
    for load in (lambda: load_personalized(tmp_path, toy_model(9), 0),
                 lambda: PersonalizedModels.load(tmp_path, toy_model(9))):
        with pytest.raises(pio.FileFormatError, match="adapter rank 1000000000 of the index"):
            load()


def test_errors(tmp_path):
    data = toy_data()
    pb = ModelProblem(make_split(toy_model(0), "output"), data)
    alg = FedSim(CFG)
    res = run_rounds(pb, alg, 1, clients_per_round=2, seed=0)
    with pytest.raises(ValueError, match="keeps w_m on the clients"):
        personalize(pb, alg, res.state)
    with pytest.raises(TypeError, match="run must be a RunResult"):
        personalize(pb, alg, 3)
    models = personalize(pb, alg, res)
    with pytest.raises(KeyError, match="unknown client id 'nobody'"):
        models.params("nobody")
    with pytest.raises(ValueError, match="carry no data"):
        PersonalizedModels(models.split, models.theta, models.w, models.client_ids).evaluate()
    with pytest.raises(FileNotFoundError, match="index.json not found"):
        load_personalized(tmp_path, toy_model(0), "c0")
    models.save(tmp_path)
    with pytest.raises(KeyError, match="does not fit this module"):
        load_personalized(tmp_path, toy_bn_model(0), "c0")
    idx = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps({**idx, "format": "other"}))
    with pytest.raises(ValueError, match="expected 'partialfl.personalized/1'"):
        load_personalized(tmp_path, toy_model(0), "c0")
    (tmp_path / "index.json").write_text(json.dumps({**idx, "theta_file": "../x.safetensors"}))
    with pytest.raises(ValueError, match="names a file outside"):
        load_personalized(tmp_path, toy_model(0), "c0")
    (tmp_path / "index.json").write_text(json.dumps(idx))
    th = load_file(str(tmp_path / "theta.safetensors"))
    save_file({**th, "c1.bias": th["c1.bias"] * float("nan")}, str(tmp_path / "theta.safetensors"))
    with pytest.raises(ValueError, match="'c1.bias': the saved values are not all finite"):
        load_personalized(tmp_path, toy_model(0), "c0")
    torch.save(th, tmp_path / "theta.safetensors")  # a pickle in disguise is never loaded
    with pytest.raises(UnsafeFileError, match="theta.safetensors is a zip"):
        load_personalized(tmp_path, toy_model(0), "c0")
    with pytest.raises(TypeError, match="metadata must be JSON-able"):
        PersonalizedModels(models.split, models.theta, models.w, models.client_ids,
                           metadata={"x": object()}).save(tmp_path / "other")
    assert not [p for p in tmp_path.rglob("*tmp*")]  # atomic writes leave no temporary file
    np.testing.assert_array_equal(models.evaluate().total, pb.num_examples(
        np.arange(pb.num_clients), "test"))


def test_the_pipeline_saves_every_clients_deployed_model(tmp_path):
    """run_pipeline(save_personalized=True): each client's saved model, loaded into a fresh
    module, has the per-client test accuracy of the run's metrics.json."""
    from partialfl.build import Task
    from partialfl.pipeline.stages import run_pipeline
    from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig

    data = toy_data(5)
    stage = StageConfig(rounds=2, clients_per_round=3, client=SGDConfig(lr=0.1, batch_size=4))
    cfg = RunSpec(method=MethodConfig(algorithm="fedsim", split="output"),
                         pretrain=stage, personalize=stage,
                         finetune=FinetuneConfig(lr=0.1, epochs=1, batch_size=4))
    task = Task(data=data, model_fn=toy_model, name="toy")
    res = run_pipeline(cfg, task, tmp_path, progress=False)
    assert not (tmp_path / "personalized").exists()  # opt-in
    res = run_pipeline(cfg, task, tmp_path, progress=False, save_personalized=True)
    assert read_index(tmp_path / "personalized")["metadata"]["method"] == cfg.method.name
    for m, cid in enumerate(data.client_ids):
        net = load_personalized(tmp_path / "personalized", toy_model(7), cid)
        c, t = _plain_accuracy(net, data, m)
        assert c / t == pytest.approx(res.metrics["per_client_test_acc"][m], abs=1e-12)
