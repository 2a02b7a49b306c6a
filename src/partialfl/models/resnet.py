"""ResNet-18 with GroupNorm (as in Pillutla et al. 2022, used by the paper), no torchvision.

API note::

    ResNet18GN(num_classes=62, variant="emnist")            # [B, 1, 28, 28] -> [B, 62]
    ResNet18GN(num_classes=2028, variant="224", pretrained="resnet18.pt")   # [B, 3, 224, 224]
    load_pretrained(model, path, exclude=("fc",), strict=True) -> list[str]  # names loaded
    model.input_layer_names()  == ["conv1.weight", "bn1.weight", "bn1.bias"]
    model.output_layer_names() == ["fc.weight", "fc.bias"]
    model.norm_layer_names()   # every GroupNorm weight / bias (the "norm" split)

Architecture (torchvision's ResNet-18 with BatchNorm replaced by GroupNorm, parameter names kept
so that torchvision-style state_dict files load directly):

- stem, ``variant="emnist"``: 3×3 conv, 64, stride 1, padding 1 → GN → ReLU (no max-pool);
- stem, ``variant="224"``: 7×7 conv, 64, stride 2, padding 3 → GN → ReLU → 3×3 max-pool, stride 2;
- ``layer1..layer4``: two BasicBlocks each with 64, 128, 256, 512 channels (stride 2 from
  layer2 on; 1×1 conv + GN ``downsample`` where the shape changes);
- global average pool → ``fc`` 512→C.

GroupNorm groups follow Pillutla et al.'s table: 64→8, 128→8, 256→16, 512→32 groups. The
normalisation modules keep torchvision's names (``bn1``, ``bn2``, ``downsample.1``) although they
are GroupNorm. Convolutions have no bias; Kaiming-normal (fan_out) init, GN weight 1, bias 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialfl.models.base import ModelContext, NamedLayersMixin, seeded
from partialfl.registry import option, register

GROUP_NORM_GROUPS = {64: 8, 128: 8, 256: 16, 512: 32}
# BatchNorm buffers in torchvision checkpoints; GroupNorm has no running statistics.
_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


class PretrainedWeightsError(ValueError):
    """A weights file cannot be read or does not match the model (keys or shapes)."""


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with Pillutla et al.'s number of groups for ``channels`` channels."""
    return nn.GroupNorm(GROUP_NORM_GROUPS[channels], channels)


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`` with 3×3 convolutions."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = group_norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = group_norm(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), group_norm(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        """relu(GN(conv(relu(GN(conv(x))))) + shortcut(x)); the shortcut is a 1×1 convolution + GN
        when the shape changes, else x."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18GN(NamedLayersMixin, nn.Module):
    """ResNet-18 with GroupNorm; ``variant`` "emnist" (28×28, 1 channel) or "224" (3 channels)."""

    INPUT_LAYERS = ("conv1", "bn1")
    OUTPUT_LAYERS = ("fc",)

    def __init__(
        self,
        num_classes: int = 62,
        variant: Literal["emnist", "224"] = "emnist",
        in_channels: int | None = None,
        pretrained: str | Path | None = None,
        blocks: Sequence[int] = (2, 2, 2, 2),
    ) -> None:
        super().__init__()
        if variant not in ("emnist", "224"):
            raise ValueError(f"unknown ResNet variant {variant!r}; allowed: 'emnist', '224'")
        self.variant = variant
        self.num_classes = num_classes
        if in_channels is None:
            in_channels = 1 if variant == "emnist" else 3
        if variant == "emnist":
            self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = group_norm(64)
        inplanes = 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
            stride = 1 if i == 1 else 2
            layer = []
            for j in range(n):
                layer.append(BasicBlock(inplanes, planes, stride if j == 0 else 1))
                inplanes = planes
            setattr(self, f"layer{i}", nn.Sequential(*layer))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if pretrained is not None:
            load_pretrained(self, pretrained)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]`` of images ``[B, C, H, W]``."""
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18_emnist(num_classes: int, **kw: Any) -> ResNet18GN:
    """ResNet-18 (GroupNorm) for 28×28 single-channel images."""
    return ResNet18GN(num_classes=num_classes, variant="emnist", **kw)


def resnet18_224(num_classes: int, **kw: Any) -> ResNet18GN:
    """ResNet-18 (GroupNorm) for 224×224 RGB images (``pretrained=PATH``: see
    :func:`load_pretrained`)."""
    return ResNet18GN(num_classes=num_classes, variant="224", **kw)


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@torch.no_grad()
def load_pretrained(
    model: nn.Module,
    path: str | Path,
    exclude: Sequence[str] = ("fc",),
    strict: bool = True,
) -> list[str]:
    """Copy weights from a torch ``state_dict`` file into ``model``; returns the names loaded.

    The file is read with ``torch.load(path, map_location="cpu", weights_only=True)``; a dict
    with a ``"state_dict"`` entry is unwrapped. BatchNorm running statistics
    (``running_mean``, ``running_var``, ``num_batches_tracked``) are ignored, so a torchvision
    ResNet-18 checkpoint loads into :class:`ResNet18GN` the way Pillutla et al. do it (conv
    weights and the norm layers' affine weight / bias). Parameters under the module prefixes in
    ``exclude`` (by default the classifier ``fc``, whose size differs between data sets) keep
    their fresh initialisation. With ``strict`` every other model parameter must be in the file
    and every file entry must be used; shapes must always match.

    Raises FileNotFoundError for a missing file and :class:`PretrainedWeightsError` for an
    unreadable file or mismatched keys / shapes (the message lists them).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights file {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for corrupt / foreign files
        raise PretrainedWeightsError(
            f"{path} is not a readable torch state_dict file (corrupt, or not saved with "
            f"torch.save): {type(e).__name__}: {e}"
        ) from e
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
    ):
        raise PretrainedWeightsError(
            f"{path} does not hold a state_dict (a dict of name -> tensor), got "
            f"{type(state).__name__}"
        )
    state = {k: v for k, v in state.items()
             if k.rsplit(".", 1)[-1] not in _BN_BUFFERS and not _under(k, exclude)}
    params = {k: v for k, v in model.named_parameters() if not _under(k, exclude)}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if strict and (missing or unexpected):
        raise PretrainedWeightsError(
            f"{path} does not match {type(model).__name__}: missing {len(missing)} key(s) "
            f"{missing[:8]}, unexpected {len(unexpected)} key(s) {unexpected[:8]} "
            f"(excluded prefixes: {list(exclude)}; pass strict=False to load the overlap)"
        )
    shared = sorted(set(params) & set(state))
    bad = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(params[k].shape)}"
           for k in shared if state[k].shape != params[k].shape]
    if bad:
        raise PretrainedWeightsError(
            f"{path}: {len(bad)} shape mismatch(es): {'; '.join(bad[:8])}"
        )
    if not shared:
        raise PretrainedWeightsError(f"{path} shares no parameter names with the model")
    for k in shared:
        params[k].copy_(state[k].to(params[k].dtype))
    return shared


@dataclass(frozen=True)
class ResNetOptions:
    """Input channels and pre-trained weights of a ResNet-18."""

    in_channels: int | None = option(None, "input channels (None: the variant's)")
    pretrained: str | None = option(None, "a state_dict file (safetensors) to start from")


@register("model", "resnet18_emnist", options=ResNetOptions)
def _resnet18_emnist(opts: ResNetOptions, ctx: ModelContext) -> ResNet18GN:
    """ResNet-18 (GroupNorm) for 28×28 single-channel images."""
    return seeded(resnet18_emnist, ctx.num_classes, ctx.seed, in_channels=opts.in_channels,
                  pretrained=opts.pretrained)


@register("model", "resnet18_224", options=ResNetOptions)
def _resnet18_224(opts: ResNetOptions, ctx: ModelContext) -> ResNet18GN:
    """ResNet-18 (GroupNorm) for 224×224 RGB images (``pretrained``: a state_dict file)."""
    return seeded(resnet18_224, ctx.num_classes, ctx.seed, in_channels=opts.in_channels,
                  pretrained=opts.pretrained)
