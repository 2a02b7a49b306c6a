"""Small CNNs for (F)EMNIST, 28×28 grey-scale input ``[B, 1, 28, 28]`` → logits ``[B, C]``.

API note::

    EmnistCNN(num_classes=62)  # Pillutla et al. 2022; params conv1.*, conv2.*, fc.*  (115,646)
    LeafCNN(num_classes=62)    # LEAF's FEMNIST CNN;   params conv1.*, conv2.*, dense.*, fc.*
                               #                                                    (6,603,710)
    model.input_layer_names() == ["conv1.weight", "conv1.bias"]
    model.output_layer_names() == ["fc.weight", "fc.bias"]

Parameter counts with 62 classes (weights + biases):

- ``EmnistCNN``: conv1 1·32·25+32 = 832; conv2 32·64·25+64 = 51,264; fc 1024·62+62 = 63,550.
- ``LeafCNN``: conv1 832; conv2 51,264; dense 3136·2048+2048 = 6,424,576; fc 2048·62+62 = 127,038.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialfl.models.base import ModelContext, NamedLayersMixin, seeded
from partialfl.registry import option, register


def relu_pool(x: Tensor) -> Tensor:
    """ReLU then 2×2 max-pool, computed as pool then ReLU: ReLU is monotone, so
    max(relu(a), relu(b)) = relu(max(a, b)) exactly, and the pooled argmax (first maximum) gets
    the same gradient (zero where the maximum is ≤ 0); the ReLU then runs on 4× fewer
    values. Bit for bit the values and gradients of ``max_pool2d(relu(x), 2)``."""
    return F.relu(F.max_pool2d(x, 2))


class EmnistCNN(NamedLayersMixin, nn.Module):
    """The EMNIST CNN of Pillutla et al. (2022), ``pfl/models/emnist_convnet.py``.

    conv 5×5, 32 (no padding: 28→24) → ReLU → max-pool 2×2 (→12) → conv 5×5, 64 (→8) → ReLU →
    max-pool 2×2 (→4) → flatten (64·4·4 = 1024) → linear 1024→C. Parameter names differ from
    the original (``convnet.c1`` / ``convnet.c3`` → ``conv1`` / ``conv2``); the maths is the same.
    """

    INPUT_LAYERS = ("conv1",)
    OUTPUT_LAYERS = ("fc",)

    def __init__(self, num_classes: int = 62, in_channels: int = 1) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.fc = nn.Linear(64 * 4 * 4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]`` of images ``[B, in_channels, 28, 28]``."""
        x = relu_pool(self.conv1(x))
        x = relu_pool(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


class LeafCNN(NamedLayersMixin, nn.Module):
    """LEAF's FEMNIST CNN (``models/femnist/cnn.py`` in TalwalkarLab/leaf).

    conv 5×5, 32, 'same' padding (28→28) → ReLU → max-pool 2×2 (→14) → conv 5×5, 64, 'same'
    (→14) → ReLU → max-pool 2×2 (→7) → flatten (7·7·64 = 3136) → dense 3136→2048 → ReLU →
    linear 2048→C. (LEAF flattens in NHWC order; with fresh weights the order is immaterial.)
    """

    INPUT_LAYERS = ("conv1",)
    OUTPUT_LAYERS = ("fc",)

    def __init__(self, num_classes: int = 62, in_channels: int = 1, hidden: int = 2048) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.dense = nn.Linear(7 * 7 * 64, hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]`` of images ``[B, in_channels, 28, 28]``."""
        x = relu_pool(self.conv1(x))
        x = relu_pool(self.conv2(x))
        x = F.relu(self.dense(torch.flatten(x, 1)))
        return self.fc(x)


@dataclass(frozen=True)
class ImageCNNOptions:
    """Input channels of an image CNN."""

    in_channels: int = option(1, "input channels")


@register("model", "emnist_cnn", options=ImageCNNOptions)
def _emnist_cnn(opts: ImageCNNOptions, ctx: ModelContext) -> EmnistCNN:
    """The EMNIST CNN (2 conv + 2 dense layers) of the partial-personalization papers."""
    return seeded(EmnistCNN, ctx.num_classes, ctx.seed, in_channels=opts.in_channels)


@dataclass(frozen=True)
class LeafCNNOptions:
    """Input channels and the dense width of LEAF's CNN."""

    in_channels: int = option(1, "input channels")
    hidden: int = option(2048, "width of the dense layer")


@register("model", "leaf_cnn", options=LeafCNNOptions)
def _leaf_cnn(opts: LeafCNNOptions, ctx: ModelContext) -> LeafCNN:
    """LEAF's FEMNIST CNN (5×5 conv 32, pool, 5×5 conv 64, pool, dense, output)."""
    return seeded(LeafCNN, ctx.num_classes, ctx.seed, in_channels=opts.in_channels,
                  hidden=opts.hidden)
