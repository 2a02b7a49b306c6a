"""Zero-initialised residual adapters inserted after a model's modules (the ``adapter``
split): ``Linear``: z ↦ z + U(V z), U ∈ R^{d×r} zero-initialised; ``Conv``: z ↦ z + A * z with
A a zero-initialised 1×1 convolution, so the adapted model starts as the base model."""


from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import Tensor, nn

from partialfl.split.base import ADAPTER_CHILD, SplitError, _match_modules


# ----------------------------------------------------------------------------- adapters
class LowRankAdapter(nn.Module):
    """u(z) = U(V z): rank-r residual adapter for features of size ``dim`` (last axis).

    V (``down``) gets PyTorch's default Linear initialisation, U (``up``, with bias) is
    zero-initialised, so the adapter's output is 0 at initialisation."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """V (``down``): PyTorch's default Linear initialisation; U (``up``): zero, so the output
        is 0 at start."""
        self.down.reset_parameters()
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, z: Tensor) -> Tensor:
        """u(z) = U V z + bias (the adapted module's hook adds z)."""
        return self.up(self.down(z))


class ConvAdapter(nn.Module):
    """u(z) = A * z: a 1×1 convolution over the channels of a ``[N, C, H, W]`` feature map
    (``dims=1``: ``[N, C, L]``), zero-initialised (weight and bias), so the adapter's output is
    0 at initialisation."""

    def __init__(self, channels: int, dims: int = 2) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dims]
        self.conv = conv(channels, channels, kernel_size=1, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero weight and bias: output 0 at start."""
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, z: Tensor) -> Tensor:
        """u(z) = A * z, the 1×1 convolution (the adapted module's hook adds z)."""
        return self.conv(z)


def _adapter_hook(module: nn.Module, inputs, output: Tensor) -> Tensor:
    """Forward hook of an adapted module: z ↦ z + adapter(z)."""
    return output + getattr(module, ADAPTER_CHILD)(output)


def _make_adapter(name: str, module: nn.Module, rank: int) -> nn.Module:
    if isinstance(module, nn.Linear):
        d = module.out_features
        return LowRankAdapter(d, max(1, min(rank, d)))
    if isinstance(module, nn.Conv2d | nn.Conv1d):
        return ConvAdapter(module.out_channels, 1 if isinstance(module, nn.Conv1d) else 2)
    raise SplitError(
        f"cannot insert an adapter after module {name!r} of type {type(module).__name__}; "
        "supported: Linear (low-rank), Conv1d / Conv2d (1x1 convolution)"
    )


def insert_adapters(
    model: nn.Module, modules: Sequence[str] | None = None, rank: int = 8
) -> tuple[nn.Module, list[str]]:
    """A deep copy of ``model`` with residual adapters after the chosen modules.

    ``modules`` are module-name regexes (``re.fullmatch``); by default every ``Linear`` and
    ``Conv2d``. Returns the adapted copy and the names of the adapted modules. Parameter
    names of the base model are unchanged; adapters add ``<module>.adapter.*``.
    """
    if not isinstance(rank, int) or rank < 1:
        raise SplitError(f"adapter rank must be a positive integer, got {rank!r}")
    model = copy.deepcopy(model)
    if modules is None:
        targets = [n for n, m in model.named_modules()
                   if isinstance(m, nn.Linear | nn.Conv2d | nn.Conv1d)]
    else:
        targets = _match_modules(model, modules, "adapter")
    if not targets:
        raise SplitError("adapter split: the model has no Linear or Conv1d/Conv2d module to adapt; "
                         "pass modules=[...] naming the modules to adapt")
    mods = dict(model.named_modules())
    for name in targets:
        m = mods[name]
        if hasattr(m, ADAPTER_CHILD):
            raise SplitError(f"module {name!r} already has an attribute {ADAPTER_CHILD!r}")
        m.add_module(ADAPTER_CHILD, _make_adapter(name, m, rank))
        m.register_forward_hook(_adapter_hook)
    return model, targets


