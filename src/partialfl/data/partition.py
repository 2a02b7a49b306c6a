"""Splitting centralised data into clients with ``flwr-datasets`` partitioners (extra
``partialfl[partition]``): registry entries of kind ``partitioner``, built with a
:class:`PartitionContext` (the label column). Used by data sources without a client column
(``hf-disk`` with ``[data.partition]``)."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

from partialfl.config import ConfigError
from partialfl.registry import option, register


@dataclass(frozen=True)
class PartitionContext:
    """The label column the partitioner groups by."""

    label_key: str = "label"


def _flwr(cls_name: str, **kw: Any):
    try:
        mod = importlib.import_module("flwr_datasets.partitioner")
    except ModuleNotFoundError:
        raise ConfigError("data.partition needs flwr-datasets: pip install "
                          "'partialfl[partition]'") from None
    return getattr(mod, cls_name)(**kw)


def _positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class IidOptions:
    """Uniformly random clients."""

    num_clients: int = option(10, "clients to make")
    seed: int = option(0, "seed of the partition")

    def __post_init__(self) -> None:
        _positive("num_clients", self.num_clients)


@register("partitioner", "iid", options=IidOptions)
def _iid(opts: IidOptions, ctx: PartitionContext):
    """Every example to a uniformly random client (equal sizes)."""
    return _flwr("IidPartitioner", num_partitions=opts.num_clients)


@dataclass(frozen=True)
class DirichletOptions:
    """Label proportions per client drawn from Dir(α)."""

    num_clients: int = option(10, "clients to make")
    alpha: float = option(0.5, "concentration α > 0 (small: few labels per client)")
    seed: int = option(0, "seed of the partition")

    def __post_init__(self) -> None:
        _positive("num_clients", self.num_clients)
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be > 0, got {self.alpha}")


@register("partitioner", "dirichlet", options=DirichletOptions)
def _dirichlet(opts: DirichletOptions, ctx: PartitionContext):
    """Each class split over the clients with proportions ~ Dir(α) (Hsu et al. 2019)."""
    return _flwr("DirichletPartitioner", num_partitions=opts.num_clients, alpha=opts.alpha,
                 min_partition_size=0, partition_by=ctx.label_key, seed=opts.seed)


@dataclass(frozen=True)
class PathologicalOptions:
    """A few labels per client."""

    num_clients: int = option(10, "clients to make")
    classes_per_client: int = option(2, "labels each client holds")
    seed: int = option(0, "seed of the partition")

    def __post_init__(self) -> None:
        _positive("num_clients", self.num_clients)
        _positive("classes_per_client", self.classes_per_client)


@register("partitioner", "pathological", options=PathologicalOptions)
def _pathological(opts: PathologicalOptions, ctx: PartitionContext):
    """Each client holds ``classes_per_client`` labels (McMahan et al. 2017)."""
    return _flwr("PathologicalPartitioner", num_partitions=opts.num_clients,
                 num_classes_per_partition=opts.classes_per_client,
                 partition_by=ctx.label_key, seed=opts.seed)


@dataclass(frozen=True)
class ShardOptions:
    """Sorted-by-label shards."""

    num_clients: int = option(10, "clients to make")
    shards_per_client: int = option(2, "shards each client gets")
    seed: int = option(0, "seed of the partition")

    def __post_init__(self) -> None:
        _positive("num_clients", self.num_clients)
        _positive("shards_per_client", self.shards_per_client)


@register("partitioner", "shard", options=ShardOptions)
def _shard(opts: ShardOptions, ctx: PartitionContext):
    """The data sorted by label, cut into shards, ``shards_per_client`` to each client."""
    return _flwr("ShardPartitioner", num_partitions=opts.num_clients,
                 num_shards_per_partition=opts.shards_per_client,
                 partition_by=ctx.label_key, seed=opts.seed)
