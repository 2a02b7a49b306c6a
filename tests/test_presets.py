"""Named personalization baselines: FedPer, FedRep, LG-FedAvg, FedBN (algorithms.presets)."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_toy import max_diff, one_thread, toy_bn_model, toy_data, toy_model

from partialfl.algorithms.base import RoundContext
from partialfl.algorithms.context import AlgorithmContext
from partialfl.algorithms.model import FedAlt, FedSim
from partialfl.algorithms.presets import build_preset, preset_names, preset_split
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.evaluation import round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.registry import entry
from partialfl.runtime import run_rounds
from partialfl.split import SplitError, make_split

CFG = SGDConfig(lr=0.1, batch_size=4)
TOY = ("c1.weight", "c1.bias", "fc1.weight", "fc1.bias", "mid.weight", "mid.bias",
       "mid2.weight", "mid2.bias", "fc.weight", "fc.bias")
BN_TOY = ("c1.weight", "c1.bias", "bn1.weight", "bn1.bias", "c2.weight", "c2.bias",
          "bn2.weight", "bn2.bias", "fc.weight", "fc.bias")
#: what each preset's docstring says is personal (on ToyNet, or ToyBNNet for FedBN)
PERSONAL = {
    "fedper": ("fc.weight", "fc.bias"),
    "fedrep": ("fc.weight", "fc.bias"),
    "lg-fedavg": TOY[:-2],
    "fedbn": ("bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"),
}


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _model(name):
    return toy_bn_model(0) if name == "fedbn" else toy_model(0)


def test_the_registry():
    assert sorted(preset_names()) == ["fedbn", "fedper", "fedrep", "lg-fedavg"]
    for name in preset_names():
        e = entry("algorithm", name)
        assert e.trait("paper") and e.trait("schedule") and e.trait("personal") and e.doc
    with pytest.raises(ValueError, match="'fedx' is not allowed.*allowed: .*fedper"):
        build_preset("fedx", toy_model(0), CFG)
    # split and algorithm can be built apart (a builder makes the split in a later stage)
    e = entry("algorithm", "fedrep")
    opts = e.parse({"layers": 2, "head_epochs": 3})
    alg = e.create(opts, AlgorithmContext(CFG, weighting="examples"))
    assert (alg.local.epochs, alg.local_theta.epochs, alg.weighting) == (3, 1, "examples")
    assert preset_split("fedrep", toy_model(0), opts).personal_names == \
        ("mid2.weight", "mid2.bias", "fc.weight", "fc.bias")


@pytest.mark.parametrize("name", list(PERSONAL))
def test_each_preset_has_the_documented_split_and_schedule(name):
    alg, split = build_preset(name, _model(name), CFG)
    p = entry("algorithm", name)
    assert split.personal_names == PERSONAL[name]
    names = BN_TOY if name == "fedbn" else TOY
    assert split.global_names == tuple(n for n in names if n not in PERSONAL[name])
    assert split.kind == p.trait("split_kind")
    assert alg.name == name
    if name == "fedrep":
        assert type(alg) is FedAlt
        assert (alg.local.epochs, alg.local_theta.epochs) == (10, 1)
        assert alg.local.lr == alg.local_theta.lr == CFG.lr
    else:
        assert type(alg) is FedSim and alg.local == CFG
    assert not alg.stateless  # w_m is kept on the clients across rounds


@pytest.mark.parametrize("name", list(PERSONAL))
def test_each_preset_trains_a_few_rounds(name):
    opts = {"head_epochs": 2} if name == "fedrep" else {}
    alg, split = build_preset(name, _model(name), CFG, **opts)
    pb = ModelProblem(split, toy_data())
    res = run_rounds(pb, alg, 4, clients_per_round=4, seed=1,
                     evaluate=round_evaluator(("train",)), eval_every=4)
    assert res.history[-1]["train_loss"] < res.history[0]["train_loss"] - 0.05
    assert max_diff(res.state.theta, pb.init_theta()) > 1e-4
    w0 = pb.init_w(np.arange(pb.num_clients), "pretrained", 0, 0)
    assert max_diff({n: res.client_state[n] for n in pb.w_names},
                    {n: w0[n] for n in pb.w_names}) > 1e-4


@pytest.mark.parametrize("name, kind, opts", [("fedper", "output", {}),
                                              ("lg-fedavg", "input", {"layers": 4})])
def test_fedsim_presets_are_exactly_fedsim_with_their_split(name, kind, opts):
    data = toy_data()
    alg, split = build_preset(name, toy_model(0), CFG)
    ref_split = make_split(toy_model(0), kind, **opts)
    assert ref_split.personal_names == split.personal_names
    a = run_rounds(ModelProblem(split, data), alg, 2, clients_per_round=3, seed=4)
    b = run_rounds(ModelProblem(ref_split, data), FedSim(CFG), 2, clients_per_round=3, seed=4)
    assert max_diff(a.state.theta, b.state.theta) == 0.0
    assert max_diff(a.client_state, b.client_state) == 0.0


def test_fedrep_trains_the_head_then_the_body():
    """One round of FedRep = head_epochs epochs on w_m, then body_epochs epochs on θ: the
    reported local steps are those of both phases."""
    alg, split = build_preset("fedrep", toy_model(0), CFG, head_epochs=3, body_epochs=2)
    pb = ModelProblem(split, toy_data())
    c = np.array([0, 2])
    st = alg.init(pb, pb.init_theta())
    cs = {n: v[c] for n, v in alg.init_client_state(pb).items()}
    res = alg.client_update(st, pb, c, RoundContext(0, 0), cs)
    per_epoch = int(np.ceil(pb.num_examples(c) / CFG.batch_size).max())
    assert res.updates.grad_evals == 3 * per_epoch + 2 * per_epoch
    assert set(res.updates.vectors) == set(TOY[:-2])


def test_preset_options_and_errors():
    _, s = build_preset("fedper", toy_model(0), CFG, layers=2)
    assert s.personal_names == ("mid2.weight", "mid2.bias", "fc.weight", "fc.bias")
    _, s = build_preset("lg-fedavg", toy_model(0), CFG, global_layers=2)
    assert s.global_names == ("mid2.weight", "mid2.bias", "fc.weight", "fc.bias")
    with pytest.raises(ValueError, match=r"unknown key .*head_epochs.*allowed keys.*layers"):
        build_preset("fedper", toy_model(0), CFG, head_epochs=3)
    with pytest.raises(ValueError, match="body_epochs must be a positive integer"):
        build_preset("fedrep", toy_model(0), CFG, body_epochs=0)
    with pytest.raises(SplitError, match="'fedbn' keeps the BatchNorm layers local"):
        build_preset("fedbn", toy_model(0), CFG)
