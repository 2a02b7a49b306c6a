"""A small 1-D CNN for windows of inertial signals ``[B, 6, T]`` (acc + gyro) → logits.

API note::

    HarCNN(num_classes=6)   # conv1 6→32 k5 → (GroupNorm) → ReLU → max-pool 2 → conv2 32→64 k5
                            # → (GroupNorm) → ReLU → global average pool → fc 64→C
    model.input_layer_names() == ["conv1.weight", "conv1.bias"]
    model.output_layer_names() == ["fc.weight", "fc.bias"]
    model.norm_layer_names()  == ["norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"]

The convolutions and head are those of the HAPT calibration in ``shared/data/README.md``
(``norm=False`` is that network exactly). ``norm=True`` (default) adds a GroupNorm (4 groups)
after each convolution so that a ``norm`` split (FedBN-style personal scale and shift per
subject) exists. Parameters with 6 classes: conv1 6·32·5+32 = 992; conv2 32·64·5+64 = 10,304;
fc 64·6+6 = 390; norms 2·32 + 2·64 = 192 (11,878 in all with norms, 11,686 without).
Works for any window length ≥ 14.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from partialfl.models.base import ModelContext, NamedLayersMixin, seeded
from partialfl.registry import option, register


class HarCNN(NamedLayersMixin, nn.Module):
    """The 2-convolution 1-D CNN described in the module docstring."""

    INPUT_LAYERS = ("conv1",)
    OUTPUT_LAYERS = ("fc",)

    def __init__(self, num_classes: int = 6, in_channels: int = 6, norm: bool = True,
                 groups: int = 4) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.conv1 = nn.Conv1d(in_channels, 32, kernel_size=5)
        self.conv2 = nn.Conv1d(32, 64, kernel_size=5)
        self.norm1 = nn.GroupNorm(groups, 32) if norm else nn.Identity()
        self.norm2 = nn.GroupNorm(groups, 64) if norm else nn.Identity()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool1d(F.relu(self.norm1(self.conv1(x))), 2)
        x = F.relu(self.norm2(self.conv2(x)))
        return self.fc(x.mean(dim=-1))


@dataclass(frozen=True)
class HarCNNOptions:
    """Channels and normalisation of the HAR CNN."""

    in_channels: int = option(6, "input channels (accelerometer and gyroscope axes)")
    norm: bool = option(True, "GroupNorm after each convolution")
    groups: int = option(4, "GroupNorm groups")


@register("model", "har_cnn", options=HarCNNOptions)
def _har_cnn(opts: HarCNNOptions, ctx: ModelContext) -> HarCNN:
    """The 1-D CNN for activity recognition windows ``[B, 6, 128]``."""
    return seeded(HarCNN, ctx.num_classes, ctx.seed, in_channels=opts.in_channels,
                  norm=opts.norm, groups=opts.groups)
