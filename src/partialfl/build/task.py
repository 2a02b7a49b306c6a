"""A model run's pieces: the model (registered or the user's own code), its split, the
loss and metric, the data, and the :class:`Task` the pipeline trains on."""


from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialfl.build.code import _check_code
from partialfl.config import ConfigError
from partialfl.registry import Component, component, entry, import_module
from partialfl.spec import RunSpec


# ----------------------------------------------------------------------------- models
def import_callable(ref: str, key: str = "model.name") -> Callable:
    """``package.module:attr`` → the object (a clear error if either part is missing), only
    where code from configs is allowed (:func:`allow_code`)."""
    _check_code(key, ref)
    mod_name, _, attr = ref.partition(":")
    mod = import_module(mod_name, key, "model module")  # config's and working folder searched
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {ref!r} is not callable")
    return obj


def build_model(model_spec, num_classes: int, seed: int, data=None):
    """A fresh model of a :class:`~partialfl.spec.ModelSpec`, seeded from (seed, model init)
    (the global torch RNG is left untouched)."""
    import torch
    from torch import nn

    from partialfl.models.base import ModelContext
    from partialfl.rng import torch_seed

    opts = dict(model_spec.options)
    if ":" in model_spec.name:
        fn = import_callable(model_spec.name)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "num_classes" in params and "num_classes" not in opts:
            opts["num_classes"] = num_classes
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed(seed, "model_init"))
            try:
                model = fn(**opts)
            except TypeError as e:
                raise ConfigError(f"model.options: {model_spec.name}: {e}") from None
            except RuntimeError as e:
                raise _no_memory(model_spec.name, e) from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name: {model_spec.name!r} returned "
                              f"{type(model).__name__}, not a torch.nn.Module")
        return model
    c = component("model", {"name": model_spec.name.replace("-", "_"), **opts}, "model")
    try:
        return c.build(ModelContext(int(num_classes), seed, data))
    except (TypeError, ValueError, ArithmeticError) as e:  # e.g. groups=0: a division by 0
        raise ConfigError(f"model.options: {e}") from None
    except RuntimeError as e:
        raise _no_memory(model_spec.name, e) from None


def _no_memory(name: str, e: RuntimeError) -> Exception:
    """A model whose parameters the allocator refused (``model.options`` with a width of
    10^12 ended in torch's RuntimeError traceback) as a one-line MemoryError; any other
    RuntimeError torch raised building it (a negative width) as a ConfigError naming it."""
    import torch

    if not (isinstance(e, torch.OutOfMemoryError) or "allocate" in str(e)):
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return ConfigError(f"model.options: {name}: {first}")
    return MemoryError(f"model {name!r}: its parameters do not fit in memory "
                       f"({str(e).splitlines()[0][:160]}); check model.options")


def make_model(name: str, num_classes: int, *, seed: int | None = None, **options: Any):
    """Registered model ``name`` with ``num_classes`` outputs and its ``options`` (names may
    use hyphens for underscores). With ``seed`` the initial weights come from
    ``torch_seed(seed, "model_init")`` (the global torch RNG untouched)."""
    from partialfl.models.base import ModelContext

    c = component("model", {"name": name.replace("-", "_"), **options}, "model")
    return c.build(ModelContext(int(num_classes), seed))


def build_split(model, kind: str, options: Mapping[str, Any] | None = None, *,
                example_input=None):
    """Which parameters of ``model`` are personal: a registered split, or ``preset:NAME`` (a
    preset algorithm's own split with the preset's options)."""
    if kind.startswith("preset:"):
        from partialfl.algorithms.presets import preset_split

        return preset_split(kind[len("preset:"):], model, dict(options or {}), example_input)
    from partialfl.split import build_split as split_of

    return split_of(model, kind, options, example_input=example_input)


def split_of(method, finetune: bool = False) -> tuple[str, dict[str, Any]]:
    """``(kind, options)`` of a method's split for :func:`build_split` (``finetune``: its
    ``finetune_split``, stage 3 after a shared-model algorithm; a preset: ``preset:NAME``
    with the preset's options)."""
    if finetune:
        return method.finetune_split.name, _options(method.finetune_split)
    if method.entry.trait("split") == "preset":
        o = method.options
        return (f"preset:{method.algorithm}",
                {} if o is None else {f.name: getattr(o, f.name) for f in dataclasses.fields(o)})
    return method.split_kind, _options(method.split)


def _options(c: Component | None) -> dict[str, Any]:
    return {} if c is None else {k: v for k, v in c.to_dict().items() if k != "name"}


def build_loss_metric(spec: RunSpec, text: bool):
    """``(loss_fn, metric)`` of a model run (``auto``: by the data's kind)."""
    loss = spec.loss if spec.loss != "auto" else (
        "token-cross-entropy" if text else "cross-entropy")
    metric = spec.metric if spec.metric != "auto" else (
        "next-word-accuracy" if text else "accuracy")
    return entry("loss", loss).create(), entry("metric", metric).create()


def build_data(spec: RunSpec, base: Path | None = None):
    """The ``(training clients, new clients or None)`` of ``spec.data``."""
    from partialfl.data.federated import DataFormatError
    from partialfl.data.partition import PartitionContext
    from partialfl.data.paths import DataNotFoundError
    from partialfl.data.sources import DataContext

    d = spec.data

    def partitioner(label_key: str):
        return d.partition.build(PartitionContext(label_key))

    try:
        return component("dataset", {"name": d.source, **d.options}, "data").build(
            DataContext(d, partitioner))
    except DataNotFoundError as e:
        raise ConfigError(f"data.path: {e}") from None
    except DataFormatError as e:
        raise ConfigError(f"data: {e}") from None


class SeededModelFn:
    """``model_fn(seed)`` run with the global torch RNG seeded from ``torch_seed(seed,
    "model_init")`` (and restored after): a user's factory that ignores its seed (the
    README's ``my_net(seed)``) still initialises the same weights in every process; one that
    seeds itself is unchanged. Picklable when ``fn`` is (worker processes)."""

    def __init__(self, fn: Callable[[int], Any]) -> None:
        self.fn = fn

    def __call__(self, seed: int):
        import torch

        from partialfl.rng import torch_seed

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed(int(seed), "model_init"))
            return self.fn(seed)


@dataclass(frozen=True)
class Task:
    """What the pipeline trains on: model factory, data, loss, metric and split builder.

    ``model_fn(seed)`` returns a freshly initialised model (called with the global torch RNG
    seeded from ``seed``: :class:`SeededModelFn`); ``split_fn(model, kind,
    options)`` builds a :class:`~partialfl.split.Split` (default :func:`build_split`).
    """

    data: Any
    model_fn: Callable[[int], Any]
    loss_fn: Callable | None = None
    metric: Callable | None = None
    split_fn: Callable[[Any, str, Mapping[str, Any]], Any] | None = None
    name: str = "task"

    def __post_init__(self) -> None:
        if not isinstance(self.model_fn, SeededModelFn):
            object.__setattr__(self, "model_fn", SeededModelFn(self.model_fn))
        if self.loss_fn is None or self.metric is None:
            from partialfl.problems.model import accuracy, cross_entropy

            if self.loss_fn is None:
                object.__setattr__(self, "loss_fn", cross_entropy)
            if self.metric is None:
                object.__setattr__(self, "metric", accuracy)

    def make_split(self, model, kind: str, options: Mapping[str, Any] | None = None):
        """The split of ``model`` of kind ``kind`` with ``options`` (``split_fn`` or
        :func:`build_split`)."""
        if self.split_fn is not None:
            return self.split_fn(model, kind, dict(options or {}))
        return build_split(model, kind, options)
