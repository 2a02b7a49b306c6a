"""Model architectures written in plain torch (no torchvision).

API note::

    model = make_model("emnist_cnn", num_classes=62, seed=0)   # seeded init, global RNG untouched
    MODELS  # {"emnist_cnn", "leaf_cnn", "har_cnn", "resnet18_emnist", "resnet18_224"} -> class
    model.input_layer_names(), model.output_layer_names(), model.norm_layer_names()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from partialfl.models.base import NamedLayersMixin
from partialfl.models.cnn import EmnistCNN, LeafCNN
from partialfl.models.har import HarCNN
from partialfl.models.resnet import ResNet18GN, load_pretrained
from partialfl.rng import torch_seed


def _resnet18_emnist(num_classes: int, **kw: Any) -> ResNet18GN:
    return ResNet18GN(num_classes=num_classes, variant="emnist", **kw)


def _resnet18_224(num_classes: int, **kw: Any) -> ResNet18GN:
    return ResNet18GN(num_classes=num_classes, variant="224", **kw)


MODELS: dict[str, Any] = {
    "emnist_cnn": EmnistCNN,
    "leaf_cnn": LeafCNN,
    "har_cnn": HarCNN,
    "resnet18_emnist": _resnet18_emnist,
    "resnet18_224": _resnet18_224,
}


def make_model(name: str, num_classes: int, *, seed: int | None = None, **kw: Any) -> nn.Module:
    """Build model ``name`` with ``num_classes`` outputs; extra keywords go to its constructor.

    Names may use hyphens instead of underscores (``"leaf-cnn"`` is ``"leaf_cnn"``).

    With ``seed`` the initial weights are drawn from ``partialfl.rng.torch_seed(seed,
    "model_init")`` inside ``torch.random.fork_rng`` (the global torch RNG is left untouched);
    without it they come from the global torch RNG. For ``resnet18_224``, ``pretrained=PATH``
    loads a state_dict file (see :func:`partialfl.models.resnet.load_pretrained`).
    """
    key = name.replace("-", "_")  # "emnist-cnn" (CLI / config style) == "emnist_cnn"
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if seed is None:
        return MODELS[key](num_classes=int(num_classes), **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, "model_init"))
        return MODELS[key](num_classes=int(num_classes), **kw)


__all__ = ["MODELS", "EmnistCNN", "HarCNN", "LeafCNN", "NamedLayersMixin", "ResNet18GN",
           "load_pretrained", "make_model"]
