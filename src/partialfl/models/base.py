"""Layer naming shared by all partialfl models.

API note: every model class declares which *modules* form its input and output layers, and
exposes the corresponding *parameter names* (as in ``model.named_parameters()``)::

    model.input_layer_names()   # e.g. ["conv1.weight", "conv1.bias"]
    model.output_layer_names()  # e.g. ["fc.weight", "fc.bias"]
    model.norm_layer_names()    # affine parameters of GroupNorm / LayerNorm / BatchNorm modules
    type(model).INPUT_LAYERS, type(model).OUTPUT_LAYERS   # module prefixes, e.g. ("conv1",)

Splits (``partialfl.split``) use these to make the first / last layer personal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

_NORM_TYPES = (nn.GroupNorm, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm2d)


class NamedLayersMixin:
    """Adds ``input_layer_names`` / ``output_layer_names`` / ``norm_layer_names`` to a module."""

    INPUT_LAYERS: tuple[str, ...] = ()
    OUTPUT_LAYERS: tuple[str, ...] = ()

    def _params_under(self, prefixes: tuple[str, ...]) -> list[str]:
        assert isinstance(self, nn.Module)
        names = [n for n, _ in self.named_parameters()
                 if any(n == p or n.startswith(p + ".") for p in prefixes)]
        if not names:
            raise ValueError(f"{type(self).__name__} has no parameters under {prefixes}")
        return names

    def input_layer_names(self) -> list[str]:
        """Parameter names of the input layer(s) (the ``INPUT_LAYERS`` modules)."""
        return self._params_under(self.INPUT_LAYERS)

    def output_layer_names(self) -> list[str]:
        """Parameter names of the output layer(s) (the ``OUTPUT_LAYERS`` modules)."""
        return self._params_under(self.OUTPUT_LAYERS)

    def norm_layer_names(self) -> list[str]:
        """Parameter names of every normalization module (empty if the model has none)."""
        assert isinstance(self, nn.Module)
        out: list[str] = []
        for mname, mod in self.named_modules():
            if isinstance(mod, _NORM_TYPES):
                out += [f"{mname}.{p}" if mname else p for p, _ in mod.named_parameters()]
        return out


@dataclass(frozen=True)
class ModelContext:
    """What a model entry is built with: the number of classes, the seed of its initial
    weights (None: the global torch RNG) and the data (a model may read shapes from it)."""

    num_classes: int
    seed: int | None = None
    data: Any = None


def seeded(factory: Callable[..., nn.Module], num_classes: int, seed: int | None = None,
           **kw: Any) -> nn.Module:
    """``factory(num_classes=num_classes, **kw)`` with its initial weights drawn from
    ``partialfl.rng.torch_seed(seed, "model_init")`` inside ``torch.random.fork_rng`` (the
    global torch RNG is left untouched); ``seed`` None: from the global torch RNG."""
    import torch

    from partialfl.rng import torch_seed

    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if seed is None:
        return factory(num_classes=int(num_classes), **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, "model_init"))
        return factory(num_classes=int(num_classes), **kw)
