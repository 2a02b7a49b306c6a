"""Model architectures written in plain torch (no torchvision).

API note::

    from partialfl.build import make_model   # names → these classes: partialfl.build.REGISTRY
    model = make_model("emnist_cnn", num_classes=62, seed=0)   # seeded init, global RNG untouched
    model.input_layer_names(), model.output_layer_names(), model.norm_layer_names()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partialfl.models.base import NamedLayersMixin
from partialfl.models.cnn import EmnistCNN, LeafCNN
from partialfl.models.har import HarCNN
from partialfl.models.resnet import ResNet18GN, load_pretrained, resnet18_224, resnet18_emnist
from partialfl.rng import torch_seed


def seeded(factory: Callable[..., nn.Module], num_classes: int, seed: int | None = None,
           **kw: Any) -> nn.Module:
    """``factory(num_classes=num_classes, **kw)`` with its initial weights drawn from
    ``partialfl.rng.torch_seed(seed, "model_init")`` inside ``torch.random.fork_rng`` (the
    global torch RNG is left untouched); ``seed`` None: from the global torch RNG."""
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if seed is None:
        return factory(num_classes=int(num_classes), **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, "model_init"))
        return factory(num_classes=int(num_classes), **kw)


__all__ = ["EmnistCNN", "HarCNN", "LeafCNN", "NamedLayersMixin", "ResNet18GN",
           "load_pretrained", "resnet18_224", "resnet18_emnist", "seeded"]
