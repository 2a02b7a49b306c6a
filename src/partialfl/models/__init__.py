"""Model architectures written in plain torch (no torchvision), each registered by name
(registry kind ``model``).

API note::

    from partialfl.build import make_model   # by registered name (registry kind "model")
    model = make_model("emnist_cnn", num_classes=62, seed=0)   # seeded init, global RNG untouched
    model.input_layer_names(), model.output_layer_names(), model.norm_layer_names()
"""

from __future__ import annotations

from partialfl.models.base import ModelContext, NamedLayersMixin, seeded
from partialfl.models.cnn import EmnistCNN, LeafCNN
from partialfl.models.har import HarCNN
from partialfl.models.resnet import ResNet18GN, load_pretrained, resnet18_224, resnet18_emnist
from partialfl.models.transformer import TransformerConfig, TransformerLM

__all__ = ["EmnistCNN", "HarCNN", "LeafCNN", "ModelContext", "NamedLayersMixin", "ResNet18GN",
           "TransformerConfig", "TransformerLM", "load_pretrained", "resnet18_224",
           "resnet18_emnist", "seeded"]
