"""What a model run trains on and how: the model, the federated data, logging and the
asynchronous runtime."""


from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from partialfl.config import ConfigError
from partialfl.registry import Component, entry, option
from partialfl.spec.base import _Spec, comp


# ----------------------------------------------------------------------------- model, data
@dataclass(frozen=True)
class ModelSpec:
    """``name``: a registered model or ``package.module:callable`` returning an
    ``nn.Module`` (code named by a config runs only with ``--allow-code``);
    ``options``: its keyword arguments (``num_classes`` is passed when the callable accepts
    it and it is not given)."""

    name: str = option("emnist_cnn", "a registered model, or package.module:callable")
    options: dict[str, Any] = option(factory=dict, doc="the model's keyword arguments")

    def __post_init__(self) -> None:
        if ":" not in self.name:
            entry("model", self.name.replace("-", "_"), "model.name")
            if "name" in self.options:  # (it would replace the model the spec names)
                raise ConfigError(f"model.options: 'name' is not an option of a registered "
                                  f"model; the model is model.name ({self.name!r})")


@dataclass(frozen=True)
class DataSpec(_Spec):
    """``source``: a registered data source (``femnist``, ``shakespeare``, ``har``, ``folder``,
    ``hf-disk``, …); ``path``: its folder or file (in a config file: relative to the file's folder
    when it exists there; with ``--set``: relative to the working folder);
    ``options``: the source's keyword arguments. ``num_clients``: a seeded subset of the
    clients; ``holdout``: clients kept out of training as *new clients*. ``hf-disk`` /
    ``folder`` data with ``x, y`` only: ``test_fraction`` of each client's examples are its
    test set; ``input_key`` / ``label_key`` / ``client_key`` are the dataset's columns
    (``client_key`` '' = split with ``partition``)."""

    source: str = option("femnist", "a registered data source")
    path: str = option("", "the data folder or file ('' = the source's default)")
    options: dict[str, Any] = option(factory=dict, doc="the source's keyword arguments")
    num_clients: int | None = option(None, "keep a seeded subset of this many clients")
    holdout: int = option(0, "clients held out of training as new clients")
    seed: int = option(0, "seed of the subset, holdout and test splits")
    input_key: str = option("image", "hf-disk: the input column")
    label_key: str = option("label", "hf-disk: the label column")
    client_key: str = option("", "hf-disk: the client column ('' = partition)")
    test_fraction: float = option(0.2, "x/y-only data: each client's test fraction")
    partition: Component | None = comp("partitioner", None, "how to split data without a "
                                       "client column: iid, dirichlet {alpha}, pathological "
                                       "{classes_per_client}, shard {shards_per_client}; "
                                       "each with num_clients and seed")

    def __post_init__(self) -> None:
        self._components("data")
        e = entry("dataset", self.source, "data.source")
        object.__setattr__(self, "source", e.name)
        if "name" in self.options:  # (it would replace the source the spec names)
            raise ConfigError(f"data.options: 'name' is not an option of a source; the "
                              f"source is data.source ({self.source!r})")
        if self.num_clients is not None and self.num_clients < 1:
            raise ConfigError(f"data.num_clients must be >= 1, got {self.num_clients}")
        if self.holdout < 0:
            raise ConfigError(f"data.holdout must be >= 0, got {self.holdout}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"data.test_fraction must be in (0, 1), got {self.test_fraction}")
        if e.trait("needs_path") and not self.path:
            raise ConfigError(f"data.path: source {self.source!r} needs the folder")
        if self.partition is not None and not e.trait("partitionable"):
            raise ConfigError(f"data.partition applies to sources with centralised data "
                              f"(hf-disk), not {self.source!r} (its clients are natural)")
        if e.trait("partitionable") and not self.client_key and self.partition is None:
            raise ConfigError("data: this dataset needs client_key (its client column) or a "
                              "partition (iid, dirichlet, pathological, shard)")


@dataclass(frozen=True)
class LoggingSpec:
    """JSONL metrics are always written; ``tensorboard`` adds event files (extra
    ``partialfl[tensorboard]``), ``wandb`` / ``mlflow`` a run in those trackers (extras
    ``partialfl[wandb]`` / ``partialfl[mlflow]``), all derived from the JSONL when the run
    ends (:mod:`partialfl.pipeline.trackers`); ``progress`` shows progress bars."""

    tensorboard: bool = option(False, "also write TensorBoard event files")
    progress: bool = option(True, "show progress bars")
    wandb: dict[str, Any] | None = option(
        None, "also log to Weights & Biases: keywords of wandb.init, e.g. {project = 'my-study', "
        "mode = 'offline'} (extra partialfl[wandb])")
    mlflow: dict[str, Any] | None = option(
        None, "also log to MLflow: {tracking_uri = 'file:./mlruns', experiment = 'my-study'} "
        "(extra partialfl[mlflow])")

    def __post_init__(self) -> None:
        bad = sorted(set(self.mlflow or {}) - {"tracking_uri", "experiment"})
        if bad:
            raise ConfigError(f"logging.mlflow.{bad[0]}: unknown key; allowed: tracking_uri, "
                              "experiment")


# ----------------------------------------------------------------------------- wrappers
@dataclass(frozen=True)
class AsyncSpec(_Spec):
    """The asynchronous runtime (Algorithm 3): the server applies each client's update as it
    arrives. ``rule``: fedasync (staleness-weighted, one update per step; with FFGG and
    constant weights: Algorithm 3) or fedbuff (``buffer`` updates per step);
    ``concurrency``: client computations in flight; a computation of client m lasts
    X / speed_m simulated seconds, X drawn from ``duration`` (a registered distribution
    with its options: constant, exponential, half-normal {scale}, log-normal, pareto
    {scale, shape}), device speeds log-normal with ``speed_sigma`` (0: all equal);
    ``rounds`` of the stage count applied updates. A robust aggregation rule is checked at
    the updates one step aggregates (1 under fedasync, K under fedbuff), so fedasync
    refuses it unless ``allow_unprotected``; under fedbuff it counts clients: a client's
    updates in one buffer are averaged into one row, the K-update plan's f kept. Runs on
    closed forms in process and on model problems over Flower (an in-process model run
    refuses the block)."""

    rule: Component = comp("wrapper", "fedasync", "fedasync {staleness, a, b} or fedbuff "
                           "{buffer, staleness, a, b}")
    concurrency: int = option(4, "client computations in flight")
    duration: Component = comp("distribution", "exponential", "the distribution of a "
                               "computation's duration, seconds: constant, exponential, "
                               "half-normal {scale}, log-normal, pareto {scale, shape}")
    speed_sigma: float = option(0.0, "device speeds log-normal with this σ (0: equal)")

    def __post_init__(self) -> None:
        self._components("asynchronous")
        if not self.rule.entry.trait("asynchronous"):
            raise ConfigError(f"asynchronous.rule: {self.rule.name!r} is not an asynchronous "
                              f"rule")
        if self.concurrency < 1:
            raise ConfigError(f"asynchronous.concurrency must be >= 1, got {self.concurrency}")
        if not (math.isfinite(self.speed_sigma) and self.speed_sigma >= 0):
            raise ConfigError(f"asynchronous.speed_sigma must be >= 0, got {self.speed_sigma}")


