"""Components by name for the Python API: ``make_model("emnist_cnn", 62)``,
``make_aggregator("krum", delta=0.2)``, … (each a registry lookup)."""


from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partialfl.config import ConfigError
from partialfl.registry import Component, entry


# ----------------------------------------------------------------------------- by name
def make_aggregator(name: str, **options: Any):
    """An aggregation rule by name with its options, e.g. ``make_aggregator("krum",
    delta=0.2, bucketing=2)``."""
    from partialfl.aggregation.compose import AggregatorContext

    seed = options.pop("seed", 0)
    return _by_name("aggregator", name, options).build(AggregatorContext(seed=seed))


def make_attack(name: str, **options: Any):
    """A Byzantine attack by name with its options (:mod:`partialfl.attacks`)."""
    return _by_name("attack", name, options).build()


def make_solver(name: str, tau: int = 1, lr: float | None = None, init: str = "zero"):
    """FFGG's fine-tuning solver by name (``gd`` = Algorithm 2, ``cg``, ``exact``)."""
    fields = {f.name for f in dataclasses.fields(entry("local", name).options or _NoOptions)}
    opts = {k: v for k, v in (("tau", tau), ("lr", lr)) if k in fields}
    return _by_name("local", name, opts).build().finetuner(init)


@dataclass(frozen=True)
class _NoOptions:
    pass


def make_optimizer(name: str, lr: float, schedule=None, **options: Any):
    """A server optimizer by name (``sgd``, ``adam``) with stepsize ``lr``."""
    from partialfl.server import Constant, OptimizerContext

    return _by_name("optimizer", name, options).build(
        OptimizerContext(lr, schedule or Constant()))


def make_backend(name: str, **options: Any):
    """How a cohort's clients run, by name (``sequential``, ``vmap``, ``processes``)."""
    return _by_name("executor", name, options).build()


def _by_name(kind: str, name: str, options: Mapping[str, Any]) -> Component:
    try:
        e = entry(kind, name, kind)
        return Component(kind, e.name, e.parse(options, kind))
    except ConfigError as e:
        raise ValueError(str(e)) from None


def convert_data(fmt: str, inp, out, **kw) -> Path:
    """``partialfl data convert``: read ``inp`` in format ``fmt`` and write an on-disk client
    store at ``out`` (:func:`partialfl.data.convert.convert`)."""
    from partialfl.data.convert import convert

    return convert(fmt, inp, out, **kw)
