"""Splits of model parameters into global θ and personal w (partialfl.split)."""

from __future__ import annotations

import pytest
import torch
from _nn_toy import ToyNet, one_thread, toy_model
from torch import nn

from partialfl.build import make_model
from partialfl.split import (
    ConvAdapter,
    LowRankAdapter,
    Split,
    SplitError,
    make_split,
    split_report,
    validate_partition,
)

MODELS = {
    "emnist_cnn": lambda: make_model("emnist_cnn", 62, seed=0),
    "leaf_cnn": lambda: make_model("leaf_cnn", 62, seed=0),
    "resnet18_emnist": lambda: make_model("resnet18_emnist", 62, seed=0),
    "toy": lambda: toy_model(0),
}
INPUTS = {"emnist_cnn": (2, 1, 28, 28), "leaf_cnn": (2, 1, 28, 28),
          "resnet18_emnist": (2, 1, 28, 28), "toy": (2, 1, 8, 8)}
EXPECTED_PERSONAL = {
    ("emnist_cnn", "input"): {"conv1.weight", "conv1.bias"},
    ("emnist_cnn", "output"): {"fc.weight", "fc.bias"},
    ("leaf_cnn", "input"): {"conv1.weight", "conv1.bias"},
    ("leaf_cnn", "output"): {"fc.weight", "fc.bias"},
    ("resnet18_emnist", "input"): {"conv1.weight", "bn1.weight", "bn1.bias"},
    ("resnet18_emnist", "output"): {"fc.weight", "fc.bias"},
    ("toy", "input"): {"c1.weight", "c1.bias"},
    ("toy", "output"): {"fc.weight", "fc.bias"},
}


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _names(model):
    return [n for n, _ in model.named_parameters()]


def _check_partition(s: Split) -> None:
    names = _names(s.model)
    assert set(s.global_names) | set(s.personal_names) == set(names)
    assert not set(s.global_names) & set(s.personal_names)
    c = s.counts()
    total = sum(p.numel() for p in s.model.parameters())
    assert c["global_params"] + c["personal_params"] == total


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kind", ["none", "input", "output", "adapter", "norm"])
def test_every_split_on_every_model(name, kind):
    model = MODELS[name]()
    if kind == "norm" and name != "resnet18_emnist":
        with pytest.raises(SplitError, match="no normalization layer"):
            make_split(model, kind)
        return
    s = make_split(model, kind)
    _check_partition(s)
    if (name, kind) in EXPECTED_PERSONAL:
        assert set(s.personal_names) == EXPECTED_PERSONAL[(name, kind)]
    if kind == "none":
        assert s.personal_names == ()
    if kind == "norm":
        gn = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.GroupNorm)
              for p in ("weight", "bias")}
        assert set(s.personal_names) == gn
    if kind == "adapter":
        assert all(".adapter." in n for n in s.personal_names)
        # the base model's names are unchanged and global
        assert set(_names(model)) == set(s.global_names)
        assert s.model is not model and not any("adapter" in n for n in _names(model))
        # zero-initialised adapters: the adapted model computes exactly the base model
        x = torch.randn(*INPUTS[name])
        with torch.no_grad():
            assert torch.equal(model.eval()(x), s.model.eval()(x))


def test_adapter_shapes_counts_and_effect():
    model = make_model("emnist_cnn", 62, seed=0)
    s = make_split(model, "adapter", rank=8)
    shapes = {n: tuple(p.shape) for n, p in s.model.named_parameters() if n in s.personal_names}
    assert shapes == {
        "conv1.adapter.conv.weight": (32, 32, 1, 1), "conv1.adapter.conv.bias": (32,),
        "conv2.adapter.conv.weight": (64, 64, 1, 1), "conv2.adapter.conv.bias": (64,),
        "fc.adapter.down.weight": (8, 62), "fc.adapter.up.weight": (62, 8),
        "fc.adapter.up.bias": (62,),
    }
    assert s.counts()["personal_params"] == 32 * 33 + 64 * 65 + 8 * 62 + 62 * 8 + 62
    x = torch.randn(3, 1, 28, 28)
    base = s.model(x).detach()
    with torch.no_grad():
        s.model.conv2.adapter.conv.bias.fill_(0.3)  # a non-zero adapter changes the output
    assert not torch.allclose(s.model(x), base)
    # the forward is z + A(z): check the hook on the conv by hand
    z = model.conv1(x)
    a = s.model.conv1.adapter
    torch.testing.assert_close(s.model.conv1(x), z + a(z))


def test_adapter_seed():
    m = toy_model()
    a, b = make_split(m, "adapter", seed=3), make_split(m, "adapter", seed=3)
    c = make_split(m, "adapter", seed=4)
    wa, wb, wc = a.params()[1], b.params()[1], c.params()[1]
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert not torch.equal(wa["fc.adapter.down.weight"], wc["fc.adapter.down.weight"])


def test_adapter_modules_pattern_and_unsupported_module():
    model = make_model("leaf_cnn", 62, seed=0)
    s = make_split(model, "adapter", modules=[r"dense"], rank=4)
    assert set(s.personal_names) == {"dense.adapter.down.weight", "dense.adapter.up.weight",
                                     "dense.adapter.up.bias"}
    assert isinstance(s.model.dense.adapter, LowRankAdapter)
    assert isinstance(make_split(model, "adapter").model.conv1.adapter, ConvAdapter)
    with pytest.raises(SplitError, match="cannot insert an adapter after module 'bn1'"):
        make_split(make_model("resnet18_emnist", 10, seed=0), "adapter", modules=["bn1"])
    with pytest.raises(SplitError, match="match no module"):
        make_split(model, "adapter", modules=["nope"])


def test_input_output_follow_forward_order_with_example_input():
    class Reversed(nn.Module):  # registered head first, used last
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 2)
            self.body = nn.Linear(3, 4)

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    m = Reversed()
    assert set(make_split(m, "input").personal_names) == {"head.weight", "head.bias"}
    x = torch.randn(2, 3)
    assert set(make_split(m, "input", example_input=x).personal_names) == {"body.weight",
                                                                           "body.bias"}
    assert set(make_split(m, "output", example_input=x).personal_names) == {"head.weight",
                                                                            "head.bias"}
    s = make_split(toy_model(), "output", layers=2)
    assert set(s.personal_names) == {"fc.weight", "fc.bias", "mid2.weight", "mid2.bias"}
    with pytest.raises(SplitError, match="would make all"):
        make_split(m, "output", layers=2)


def test_explicit_modules_for_blocks():
    s = make_split(make_model("resnet18_emnist", 10, seed=0), "input", modules=[r"layer1\.0"])
    assert s.personal_names and all(n.startswith("layer1.0.") for n in s.personal_names)
    _check_partition(s)


def test_pattern_split_and_validation_errors():
    m = toy_model()
    s = make_split(m, "pattern", personal=[r"^mid\."])
    assert set(s.personal_names) == {"mid.weight", "mid.bias"}
    s2 = make_split(m, "pattern", personal=[r"^fc\."], global_=[r"^(c1|fc1|mid|mid2)\."])
    assert set(s2.personal_names) == {"fc.weight", "fc.bias"}
    with pytest.raises(SplitError, match=r"on both sides: \['mid.weight', 'mid.bias'\]"):
        make_split(m, "pattern", personal=[r"^mid\."], global_=[r"."])
    with pytest.raises(SplitError, match=r"on neither side: \['c1.weight', 'c1.bias'\]"):
        make_split(m, "pattern", personal=[r"^fc\."], global_=[r"^(fc1|mid|mid2)\."])
    with pytest.raises(SplitError, match="match no parameter"):
        make_split(m, "pattern", personal=["zzz"])
    with pytest.raises(SplitError, match="invalid regular expression"):
        make_split(m, "pattern", personal=["("])
    with pytest.raises(SplitError, match="needs personal"):
        make_split(m, "pattern")


def test_validate_partition_and_split_constructor():
    names = ["a", "b", "c"]
    validate_partition(names, ["a"], ["b", "c"])
    with pytest.raises(SplitError, match=r"neither side: \['c'\]"):
        validate_partition(names, ["a"], ["b"])
    with pytest.raises(SplitError, match=r"both sides: \['b'\]"):
        validate_partition(names, ["a", "b"], ["b", "c"])
    with pytest.raises(SplitError, match="does not have"):
        validate_partition(names, ["a", "zz"], ["b", "c"])
    m = ToyNet()
    with pytest.raises(SplitError, match="neither side"):
        Split(m, "pattern", ("c1.weight",), ("fc.weight",))


def test_bad_kind_and_empty_sides():
    m = toy_model()
    from partialfl.registry import names

    with pytest.raises(SplitError, match="allowed: " + ", ".join(names("split"))):
        make_split(m, "head")
    with pytest.raises(SplitError, match="every parameter personal"):
        make_split(m, "pattern", personal=["."])
    assert make_split(m, "pattern", personal=["."], allow_empty=True).global_names == ()
    with pytest.raises(TypeError, match="nn.Module"):
        make_split("not a model", "output")


def test_partition_params_and_report():
    m = make_model("emnist_cnn", 62, seed=0)
    s = make_split(m, "output")
    theta, w = s.params()
    assert set(w) == {"fc.weight", "fc.bias"} and torch.equal(w["fc.weight"], m.fc.weight)
    w["fc.weight"].zero_()  # detached copies
    assert m.fc.weight.abs().sum() > 0
    with pytest.raises(KeyError, match="missing"):
        s.partition(theta)
    rep = split_report(m)
    assert "| output | 52,096 | 63,550 |" in rep
    assert "| input | 114,814 | 832 |" in rep
    assert "norm | – | – | – | n/a" in rep
    assert "63,550 personal" in s.describe()
