"""Model architectures: shapes, parameter counts, layer names, seeding, weight loading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partialfl.build import make_model
from partialfl.models import EmnistCNN, LeafCNN, ResNet18GN, load_pretrained
from partialfl.models.resnet import PretrainedWeightsError
from partialfl.registry import names


def _count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _resnet18_count(in_ch: int, stem_k: int, c: int) -> int:
    """Hand count: convs have no bias; every GroupNorm has 2·channels affine parameters."""
    n = in_ch * 64 * stem_k * stem_k + 2 * 64  # stem conv + GN
    cin = 64
    for planes in (64, 128, 256, 512):
        for j in range(2):
            n += cin * planes * 9 + 2 * planes + planes * planes * 9 + 2 * planes
            if j == 0 and cin != planes:
                n += cin * planes + 2 * planes  # 1x1 downsample conv + GN
            cin = planes
    return n + 512 * c + c


def test_parameter_counts_by_hand():
    c = 62
    emnist = (1 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (64 * 4 * 4 * c + c)
    leaf = (1 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (7 * 7 * 64 * 2048 + 2048) + (2048 * c + c)
    assert _count(EmnistCNN(c)) == emnist == 115_646
    assert _count(LeafCNN(c)) == leaf == 6_603_710
    assert _count(ResNet18GN(c, "emnist")) == _resnet18_count(1, 3, c)
    # torchvision's resnet18 has 11,689,512 parameters with 1000 classes (BN affine == GN affine)
    assert _count(ResNet18GN(1000, "224")) == _resnet18_count(3, 7, 1000) == 11_689_512


@pytest.mark.parametrize(
    "name, shape",
    [("emnist_cnn", (3, 1, 28, 28)), ("leaf_cnn", (3, 1, 28, 28)),
     ("resnet18_emnist", (2, 1, 28, 28)), ("resnet18_224", (1, 3, 224, 224))],
)
def test_output_shape_and_layer_names_follow_the_forward_order(name, shape):
    model = make_model(name, num_classes=10, seed=0)
    called: list[str] = []
    for mname, mod in model.named_modules():
        if mname and any(True for _ in mod.parameters(recurse=False)):
            mod.register_forward_hook(lambda *_, n=mname: called.append(n))
    with torch.no_grad():
        out = model(torch.randn(*shape))
    assert out.shape == (shape[0], 10) and torch.isfinite(out).all()
    params = dict(model.named_parameters())
    inp, outp = model.input_layer_names(), model.output_layer_names()
    assert set(inp) <= set(params) and set(outp) <= set(params) and not set(inp) & set(outp)
    # the input layer is what the forward pass applies first, the output layer last
    first = [m for m in called if m in type(model).INPUT_LAYERS]
    assert called[: len(first)] == first and first
    assert called[-1] in type(model).OUTPUT_LAYERS
    assert outp == ["fc.weight", "fc.bias"]
    assert params["fc.weight"].shape[0] == 10


def test_specific_layer_names_and_norms():
    assert EmnistCNN().input_layer_names() == ["conv1.weight", "conv1.bias"]
    assert LeafCNN().input_layer_names() == ["conv1.weight", "conv1.bias"]
    assert EmnistCNN().norm_layer_names() == []
    r = ResNet18GN(62, "emnist")
    assert r.input_layer_names() == ["conv1.weight", "bn1.weight", "bn1.bias"]
    norms = r.norm_layer_names()
    gns = [m for m in r.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 2 * len(gns) == 2 * (1 + 8 * 2 + 3)  # stem, 2 per block, 3 downsample
    assert "layer2.0.downsample.1.weight" in norms and all("conv" not in n for n in norms)


@pytest.mark.parametrize("variant, size, final", [("emnist", 28, 4), ("224", 224, 7)])
def test_resnet_stems_and_group_norms(variant, size, final):
    """EMNIST stem keeps 28x28 (3x3 stride 1, no max-pool); the 224 stem divides by 4."""
    r = ResNet18GN(10, variant)
    shapes = {}
    for name in ("conv1", "layer1", "layer4"):
        getattr(r, name).register_forward_hook(
            lambda _m, _i, out, n=name: shapes.__setitem__(n, tuple(out.shape)))
    with torch.no_grad():
        r(torch.zeros(1, 1 if variant == "emnist" else 3, size, size))
    stem = size if variant == "emnist" else size // 2
    assert shapes["conv1"] == (1, 64, stem, stem)
    side1 = size if variant == "emnist" else size // 4  # after the 224 stem's max-pool
    assert shapes["layer1"] == (1, 64, side1, side1)
    assert shapes["layer4"] == (1, 512, final, final)
    assert r.conv1.kernel_size == ((3, 3) if variant == "emnist" else (7, 7))
    groups = {m.num_channels: m.num_groups for m in r.modules() if isinstance(m, nn.GroupNorm)}
    assert groups == {64: 8, 128: 8, 256: 16, 512: 32}  # Pillutla et al.'s table


def test_emnist_cnn_shapes_inside():
    # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4, and 64·4·4 = 1024 features
    m = EmnistCNN()
    assert m.fc.in_features == 1024
    leaf = LeafCNN()
    assert leaf.dense.in_features == 3136 and leaf.dense.out_features == 2048


def test_make_model_seeding_and_errors():
    state = torch.random.get_rng_state()
    a = make_model("leaf_cnn", 62, seed=3)
    b = make_model("leaf_cnn", 62, seed=3)
    c = make_model("leaf_cnn", 62, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.conv1.weight, c.conv1.weight)
    hyphen = make_model("leaf-cnn", 62, seed=3)  # config / CLI spelling
    assert isinstance(hyphen, LeafCNN) and torch.equal(hyphen.fc.weight, a.fc.weight)
    with pytest.raises(ValueError, match="'vgg' is not allowed; allowed: emnist_cnn"):
        make_model("vgg", 62)
    with pytest.raises(ValueError, match="num_classes"):
        make_model("emnist_cnn", 0)
    with pytest.raises(ValueError, match="variant"):
        ResNet18GN(62, variant="cifar")  # type: ignore[arg-type]
    assert set(names("model")) == {"emnist_cnn", "leaf_cnn", "har_cnn", "resnet18_emnist",
                                   "resnet18_224", "transformer"}


@pytest.mark.parametrize("name", ["emnist_cnn", "resnet18_emnist"])
def test_functional_call_vmaps_over_parameter_sets(name):
    """Models are pure functions of their parameters (no in-place ops), as problems need."""
    model = make_model(name, num_classes=5, seed=0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    k = 2
    stacked = {n: torch.stack([p + 0.01 * i for i in range(k)]) for n, p in params.items()}
    x = torch.randn(k, 3, 1, 28, 28)

    def f(p, xb):
        return torch.func.functional_call(model, p, (xb,))

    out = torch.func.vmap(f)(stacked, x)
    for i in range(k):
        ref = f({n: v[i] for n, v in stacked.items()}, x[i])
        torch.testing.assert_close(out[i], ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------- pretrained weights
def test_load_pretrained_round_trip(tmp_path):
    src = make_model("resnet18_224", 7, seed=1)
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    dst = make_model("resnet18_224", 7, seed=2, pretrained=path)  # default excludes fc
    for (n, p), q in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(p, q) == (not n.startswith("fc.")), n
    full = make_model("resnet18_224", 7, seed=2)
    loaded = load_pretrained(full, path, exclude=())
    assert len(loaded) == len(list(full.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(src.parameters(), full.parameters()))


def test_load_torchvision_style_checkpoint_with_bn_buffers_and_other_head(tmp_path):
    src = make_model("resnet18_224", 1000, seed=1)
    sd = {"state_dict": dict(src.state_dict())}
    for name, mod in src.named_modules():
        if isinstance(mod, nn.GroupNorm):  # what a BatchNorm checkpoint carries in addition
            sd["state_dict"][f"{name}.running_mean"] = torch.zeros(mod.num_channels)
            sd["state_dict"][f"{name}.running_var"] = torch.ones(mod.num_channels)
            sd["state_dict"][f"{name}.num_batches_tracked"] = torch.tensor(5)
    path = tmp_path / "tv.pt"
    torch.save(sd, path)
    dst = make_model("resnet18_224", 2028, seed=0, pretrained=path)
    assert torch.equal(dst.layer4[1].conv2.weight, src.layer4[1].conv2.weight)
    assert torch.equal(dst.layer1[0].bn1.bias, src.layer1[0].bn1.bias)
    assert dst.fc.weight.shape == (2028, 512)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # from the corrupt file
def test_load_pretrained_errors(tmp_path):
    model = make_model("resnet18_emnist", 62, seed=0)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_pretrained(model, tmp_path / "nope.pt")
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"\x80\x04 definitely not a checkpoint")
    with pytest.raises(PretrainedWeightsError, match="not a readable"):
        load_pretrained(model, bad)
    notdict = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], notdict)
    with pytest.raises(PretrainedWeightsError, match="does not hold a state_dict"):
        load_pretrained(model, notdict)
    sd = make_model("resnet18_emnist", 62, seed=1).state_dict()
    missing = tmp_path / "missing.pt"
    torch.save({k: v for k, v in sd.items() if k != "layer3.1.conv1.weight"}, missing)
    with pytest.raises(PretrainedWeightsError, match=r"missing 1 key\(s\) \['layer3.1.conv1"):
        load_pretrained(model, missing)
    extra = tmp_path / "extra.pt"
    torch.save({**sd, "adapter.weight": torch.zeros(3)}, extra)
    with pytest.raises(PretrainedWeightsError, match="unexpected 1 key.*adapter.weight"):
        load_pretrained(model, extra)
    # a 224-variant file has a 7x7x3 stem: shape mismatch named even with strict=False
    other = tmp_path / "r224.pt"
    torch.save(make_model("resnet18_224", 62, seed=1).state_dict(), other)
    with pytest.raises(PretrainedWeightsError, match=r"conv1.weight: file \(64, 3, 7, 7\)"):
        load_pretrained(model, other, strict=False)
    # nothing was modified by the failed loads
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    # non-strict loading of the overlap works and reports what it loaded
    loaded = load_pretrained(model, missing, strict=False)
    assert "layer3.1.conv1.weight" not in loaded and "layer3.1.conv2.weight" in loaded
