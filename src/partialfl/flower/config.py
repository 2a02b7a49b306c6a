"""The run configuration of the Flower app, mapped onto partialfl's own objects.

``flwr run APP -c key=value`` overrides keys of ``[tool.flwr.app.config]`` in the app's
``pyproject.toml``; Flower hands the fused flat dict to both the ServerApp and every ClientApp
as ``context.run_config``. :func:`parse_run_config` validates that dict once (every error names
the bad key, the bad value and what is allowed) into a frozen :class:`FlowerConfig`, and the
builders below turn it into the *same* partialfl objects the in-process simulator uses:
:func:`build_problem`, :func:`build_algorithm` (FFGG, BR-FFGG, Local FFGG, FedAvg with the
server optimizer, schedule and aggregator), :func:`partition_clients`.

This module does not import ``flwr``, so configs can be checked without the optional extra.
Keys use Flower's kebab-case; :data:`FIELDS` is the single table of keys, types, defaults and
allowed values from which :class:`FlowerConfig` and the app's ``pyproject.toml`` are generated
(:func:`partialfl.flower.project.app_pyproject`). A key that mirrors a field of the run
specification (:func:`from_spec`, e.g. ``server-lr`` = ``ServerConfig.lr``, ``ls-n`` =
``ProblemConfig.n``, ``model`` = ``ModelSpec.name``) takes its type, default and validation
(registry names included) from :mod:`partialfl.spec`, so the app's defaults are the config's;
the rest are Flower's own (transport, robustness, output). Problem ``train`` carries a whole
:class:`~partialfl.spec.TrainSpec` (key ``train-spec``), so any model and data a train config
names runs on Flower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, make_dataclass
from dataclasses import field as dc_field
from typing import Any

import numpy as np

from partialfl.build import names
from partialfl.config import ConfigError as CoreConfigError
from partialfl.spec import (
    AlgorithmConfig,
    ClientConfig,
    DataSpec,
    MethodConfig,
    ModelSpec,
    ProblemConfig,
    ServerConfig,
)

ALGORITHMS = ("ffgg", "br-ffgg", "local-ffgg", "fedavg")
PROBLEMS = ("least-squares", "femnist", "train")
TRAIN_STAGES = ("pretrain", "personalize")
MODES = ("sync", "async")


@dataclass(frozen=True)
class Field:
    """One run-config key: its type, default, allowed values (or a check) and help text;
    ``spec``: the run-specification field it mirrors (``Class.attr`` of :mod:`partialfl.spec`),
    which gives its type, default and validation."""

    key: str
    type: type | tuple[type, ...]
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    requirement: str = ""
    spec: str = ""

    @property
    def attr(self) -> str:
        """The key as a Python attribute name (dashes to underscores)."""
        return self.key.replace("-", "_")


_SCALARS = (bool, int, float, str)


def _flat_type(tp) -> tuple[type, ...]:
    """The run-config types of a spec field's annotation (``X | None`` → X; Flower carries
    no None)."""
    import types
    import typing

    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) \
        else (tp,)
    out = tuple(a for a in args if a in _SCALARS)
    if not out or len(out) != len([a for a in args if a is not type(None)]):
        raise TypeError(f"spec field type {tp} has no run-config form")
    return out


def from_spec(key: str, cls: type, attr: str, help: str, *, none: Any = None) -> Field:
    """The run-config key ``key`` mirroring the spec field ``cls.attr``: type, default and
    validation are the spec's (its ``__post_init__``: registry names, ranges); ``none`` is
    the run-config value that stands for the spec's None (Flower carries no None)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    (f,) = [f for f in dataclasses.fields(cls) if f.name == attr]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    types_ = _flat_type(hints[attr])
    if default is None:
        if none is None:
            raise TypeError(f"{cls.__name__}.{attr}: give the run-config value for None")
        default = none

    def check(v) -> bool:
        cls(**{attr: None if none is not None and v == none else v})
        return True

    where = f"{cls.__name__}.{attr}"
    return Field(key, types_[0] if len(types_) == 1 else types_, default,
                 f"{help} (= partialfl.spec.{where})", check=check, spec=where)


def _pos(v) -> bool:
    return v > 0 and math.isfinite(v)


def _nonneg(v) -> bool:
    return v >= 0 and math.isfinite(v)


#: Every key of the app's run config. Order = order in the generated pyproject.toml.
FIELDS: tuple[Field, ...] = (
    # -- what to run ------------------------------------------------------------------
    Field("algorithm", str, "ffgg", "FFGG (Alg. 1), BR-FFGG (Alg. 5), Local FFGG (Alg. 4), "
          "FedAvg", choices=ALGORITHMS),
    Field("problem", str, "least-squares", "the federated problem", choices=PROBLEMS),
    Field("num-rounds", int, 10, "server steps (sync: rounds; async: applied buffers)",
          check=_nonneg, requirement="an integer >= 0"),
    Field("clients-per-round", int, 0, "clients sampled per round (0 = all)", check=_nonneg,
          requirement="an integer >= 0 (0 = all clients)"),
    Field("seed", int, 0, "run seed: cohorts, initialisation, local randomness",
          check=_nonneg, requirement="an integer >= 0"),
    Field("mode", str, "sync", "sync rounds, or async (server applies updates as they arrive)",
          choices=MODES),
    Field("buffer-size", int, 1, "async: updates per server step (FedBuff K; 1 = Algorithm 3)",
          check=_pos, requirement="an integer >= 1"),
    Field("concurrency", int, 0, "async: client updates in flight (0 = number of SuperNodes)",
          check=_nonneg, requirement="an integer >= 0"),
    # -- robustness of the transport ---------------------------------------------------
    Field("round-timeout", float, 300.0, "seconds to wait for a round's replies (async: for "
          "one task); late or missing replies count as failures", check=_pos,
          requirement="a number > 0"),
    Field("poll-interval", float, 0.05, "seconds between pulls of replies", check=_pos,
          requirement="a number > 0"),
    Field("min-nodes", int, 1, "SuperNodes to wait for before training", check=_pos,
          requirement="an integer >= 1"),
    Field("node-wait-timeout", float, 120.0, "seconds to wait for min-nodes SuperNodes and for "
          "their first answer (ClientApp start-up)", check=_pos,
          requirement="a number > 0"),
    Field("max-failure-fraction", float, 0.5, "abort the run (non-zero exit, result.json "
          "records why) once more than this fraction of the requested client updates failed "
          "(lost SuperNode, crash, timeout, invalid or non-finite reply); below it failing "
          "nodes are skipped and counted", check=lambda v: 0 <= v <= 1,
          requirement="a number in [0, 1]"),
    # -- server optimizer --------------------------------------------------------------
    from_spec("server-opt", ServerConfig, "optimizer",
              "server optimizer on the aggregated θ-(pseudo-)gradient"),
    from_spec("server-lr", ServerConfig, "lr", "server stepsize: a number, 'c/L' (least "
              "squares), or 'auto' = 1/L for the least-squares FFGG family (Theorem 1), 1.0 "
              "otherwise"),
    from_spec("server-momentum", ServerConfig, "momentum", "SGD heavy-ball momentum"),
    from_spec("server-clip", ServerConfig, "clip_norm", "clip the aggregated pseudo-gradient "
              "to this norm before the server step (0 = no clipping)", none=0.0),
    from_spec("schedule", ServerConfig, "schedule", "server learning-rate schedule"),
    from_spec("warmup-rounds", ServerConfig, "warmup",
              "warmup-linear: warm-up rounds (decay to 0 at num-rounds)"),
    from_spec("halve-every", ServerConfig, "halve_every",
              "exponential: halve the stepsize every k rounds"),
    # -- aggregation (BR-FFGG) ---------------------------------------------------------
    Field("aggregator", str, "mean", "aggregation rule of the θ-vectors: mean, or a robust rule "
          "for BR-FFGG (partialfl.build.make_aggregator: "
          f"{', '.join(a for a in names('aggregator') if a != 'mean')})",
          check=lambda v: bool(v.strip()), requirement="a non-empty aggregator name"),
    Field("aggregator-delta", float, 0.0, "robust rules: assumed fraction δ of Byzantine "
          "clients (0 = the rule's default δ; bucketing and nnm derive theirs from it, nnm "
          "refuses a rule without δ unless this is > 0)", check=lambda v: 0 <= v < 0.5,
          requirement="a number in [0, 0.5)"),
    Field("bucket-size", int, 1, "bucketing of the robust rule (s >= 2 buckets; 1 = none)",
          check=_pos, requirement="an integer >= 1"),
    Field("nnm", bool, False, "nearest-neighbour mixing before the robust rule"),
    Field("byzantine-fraction", float, 0.0, "fraction of clients that are Byzantine (their "
          "updates are replaced by the attack on the server, as an omniscient adversary)",
          check=lambda v: 0 <= v < 0.5, requirement="a number in [0, 0.5)"),
    Field("attack", str, "none", "what Byzantine clients send (partialfl.build.make_attack: "
          f"{', '.join(names('attack'))})",
          check=lambda v: bool(v.strip()), requirement="a non-empty attack name"),
    from_spec("weighting", MethodConfig, "weighting",
              "aggregation weights: uniform or number of examples"),
    # -- local work ---------------------------------------------------------------------
    from_spec("solver", AlgorithmConfig, "solver",
              "least squares: fine-tuner of w (gd = Algorithm 2, cg, exact)"),
    Field("local-steps", int, 10, "local steps τ (fine-tuning steps; FedAvg local steps)",
          check=_pos, requirement="an integer >= 1"),
    from_spec("local-lr", AlgorithmConfig, "local_lr", "local stepsize (0 = 1/L per client on "
              "least squares; model problems need a number > 0)", none=0.0),
    from_spec("local-epochs", ClientConfig, "epochs",
              "model problems: epochs of fine-tuning / local training"),
    from_spec("batch-size", ClientConfig, "batch_size", "model problems: minibatch size"),
    Field("w-init", str, "auto", "how w is re-initialised on every client at every round: "
          "zero, random, pretrained (model problems); auto = zero for least squares, "
          "pretrained for model problems", choices=("auto", "zero", "random", "pretrained")),
    # -- least-squares problem (the paper's Example 1) ---------------------------------
    from_spec("ls-clients", ProblemConfig, "num_clients", "least squares: number of clients M"),
    from_spec("ls-n", ProblemConfig, "n", "least squares: rows per client"),
    from_spec("ls-d-theta", ProblemConfig, "d_theta", "least squares: dim θ"),
    from_spec("ls-d-w", ProblemConfig, "d_w", "least squares: dim w"),
    from_spec("ls-seed", ProblemConfig, "seed", "least squares: data seed"),
    # -- FEMNIST ------------------------------------------------------------------------
    Field("data-file", str, "femnist_leaf_subset.npz", "FEMNIST: data file name or path "
          "(resolved with partialfl.data.paths.resolve_data_file)",
          check=lambda v: bool(v.strip()), requirement="a non-empty file name"),
    from_spec("data-dir", DataSpec, "path", "FEMNIST: data folder ('' = partialfl's default)"),
    from_spec("model", ModelSpec, "name", "FEMNIST: architecture (a registry model or "
              "package.module:callable)"),
    from_spec("split", MethodConfig, "split", "FEMNIST: which parameters are personal "
              "(FedAvg always uses none)"),
    Field("init-from", str, "", "FEMNIST: start from this .npz of all model parameters (e.g. "
          "theta.npz of a FedAvg run: the pipeline's stage 1); '' = the seeded initialisation"),
    # -- any `partialfl train` config (problem 'train') -----------------------------------
    Field("train-spec", str, "", "problem 'train': a partialfl TrainSpec as JSON or "
          "b64:BASE64-JSON (set by `partialfl train --engine flower-sim|flower`: model, data, "
          "method and stage "
          "settings all come from it, not from the keys above)"),
    Field("train-stage", str, "personalize", "problem 'train': which federated stage of the "
          "spec runs (pretrain: FedAvg on every parameter; personalize: the method, from "
          "init-from)", choices=TRAIN_STAGES),
    # -- output and testing -------------------------------------------------------------
    Field("eval-every", int, 1, "evaluate on the SuperNodes every k server steps (0 = never)",
          check=_nonneg, requirement="an integer >= 0"),
    Field("eval-min-clients", int, 2, "privacy: a SuperNode sends evaluation sums over at least "
          "this many clients, or nothing (a SuperNode may raise it in its node config)",
          check=_pos, requirement="an integer >= 1"),
    Field("out-dir", str, "", "server: write result.json, metrics.jsonl and theta.npz here "
          "('' = do not write)"),
    Field("checkpoint-every", int, 0, "server: write a checkpoint (safetensors + JSON, "
          "atomic) to out-dir every k rounds (async: server steps; 0 = never)", check=_nonneg,
          requirement="an integer >= 0"),
    Field("resume", bool, False, "server: continue from the checkpoint in out-dir (refused "
          "when it was written by another configuration)"),
    Field("fault-injection", str, "", "testing only: make ClientApps fail, e.g. "
          "'crash:partition=1,round=1; slow:partition=0,round=2,seconds=5; "
          "nan:partition=0,round=1' (non-finite weights), or the server stop after a round: "
          "'stop:round=2'"),
)

_BY_KEY = {f.key: f for f in FIELDS}


class _FlowerConfigMethods:
    def to_run_config(self) -> dict[str, Any]:
        """The flat kebab-case dict Flower carries (inverse of :func:`parse_run_config`)."""
        return {f.key: getattr(self, f.attr) for f in FIELDS}

    def replace(self, **changes: Any) -> FlowerConfig:
        """A copy with ``changes`` (kebab or snake keys), validated again."""
        cfg = self.to_run_config()
        cfg.update({k.replace("_", "-"): v for k, v in changes.items()})
        return parse_run_config(cfg)


#: The validated run config: one attribute per key of :data:`FIELDS` (``-`` → ``_``), with
#: the table's defaults (generated from it, so the two cannot disagree).
FlowerConfig = make_dataclass(
    "FlowerConfig",
    [(f.attr, Any, dc_field(default=f.default)) for f in FIELDS],
    bases=(_FlowerConfigMethods,), frozen=True)
FlowerConfig.__module__ = __name__


class ConfigError(CoreConfigError):
    """A run-config key or value that partialfl cannot use (the message names it)."""


def _coerce(f: Field, value: Any) -> Any:
    types = f.type if isinstance(f.type, tuple) else (f.type,)
    if isinstance(value, bool):  # bool is an int subclass: never accept it for numbers
        if bool not in types:
            raise ConfigError(f"run-config key {f.key!r}: got {value!r}; expected "
                              f"{f.requirement or _type_names(types)}")
        return value
    if float in types and isinstance(value, int):
        return float(value)
    if int in types and isinstance(value, float) and value.is_integer() and float not in types:
        return int(value)
    if not isinstance(value, types):
        raise ConfigError(
            f"run-config key {f.key!r}: got {value!r} ({type(value).__name__}); expected "
            f"{f.requirement or _type_names(types)}"
        )
    return value


def _type_names(types) -> str:
    return " or ".join(t.__name__ for t in types)


def parse_run_config(run_config: Mapping[str, Any] | None = None, **overrides: Any
                     ) -> FlowerConfig:
    """Validate Flower's ``context.run_config`` (plus keyword ``overrides``) into a config.

    Unknown keys, wrong types, values outside the allowed set and inconsistent combinations
    raise :class:`ConfigError` naming the key, the value and what is allowed.
    """
    raw = dict(run_config or {})
    raw.update({k.replace("_", "-"): v for k, v in overrides.items()})
    unknown = sorted(set(raw) - set(_BY_KEY))
    if unknown:
        raise ConfigError(
            f"unknown run-config key(s) {', '.join(map(repr, unknown))}; allowed keys: "
            f"{', '.join(_BY_KEY)}"
        )
    values = {}
    for f in FIELDS:
        v = _coerce(f, raw[f.key]) if f.key in raw else f.default
        if isinstance(v, str):
            v = v.strip()
        if f.choices is not None and v not in f.choices:
            raise ConfigError(
                f"run-config key {f.key!r}: unknown value {v!r}; allowed: "
                f"{', '.join(map(str, f.choices))}"
            )
        if f.spec:
            try:
                f.check(v)
            except (CoreConfigError, ValueError, TypeError) as e:
                raise ConfigError(f"run-config key {f.key!r}: got {v!r}; {e}") from None
        elif f.check is not None and not f.check(v):
            raise ConfigError(f"run-config key {f.key!r}: got {v!r}; expected {f.requirement}")
        values[f.attr] = v
    cfg = FlowerConfig(**values)
    _check_combinations(cfg)
    parse_fault_injection(cfg.fault_injection)
    return cfg


def _check_combinations(cfg: FlowerConfig) -> None:
    if cfg.schedule == "warmup-linear" and not cfg.warmup_rounds < max(cfg.num_rounds, 1):
        raise ConfigError(
            f"run-config key 'warmup-rounds': {cfg.warmup_rounds} must be < num-rounds "
            f"({cfg.num_rounds}) for schedule 'warmup-linear'"
        )
    if cfg.server_opt != "sgd" and cfg.server_momentum:
        raise ConfigError("run-config key 'server-momentum' applies to server-opt 'sgd' only")
    if cfg.schedule == "exponential" and cfg.halve_every < 1:
        raise ConfigError("run-config key 'halve-every' must be >= 1 for schedule 'exponential'")
    if cfg.problem == "least-squares":
        if cfg.ls_n < cfg.ls_d_w:
            raise ConfigError(
                f"run-config keys 'ls-n' ({cfg.ls_n}) < 'ls-d-w' ({cfg.ls_d_w}): every client "
                "needs at least d_w rows (else w*(θ) is not unique)"
            )
        if cfg.w_init not in ("auto", "zero", "random"):
            raise ConfigError(
                f"run-config key 'w-init': unknown value {cfg.w_init!r} for least squares; "
                "allowed: auto, zero, random"
            )
        if cfg.clients_per_round > cfg.ls_clients:
            raise ConfigError(
                f"run-config key 'clients-per-round': {cfg.clients_per_round} > ls-clients "
                f"({cfg.ls_clients})"
            )
    elif cfg.problem == "train" or cfg.train_spec:
        if not (cfg.problem == "train" and cfg.train_spec):
            raise ConfigError("run-config keys 'problem' = 'train' and 'train-spec' go "
                              "together (set by `partialfl train --engine flower-sim`)")
    elif cfg.local_lr == 0:
        raise ConfigError(
            f"run-config key 'local-lr': problem {cfg.problem!r} needs an explicit local "
            "stepsize > 0 (0 = 1/L only exists for least squares)"
        )
    if cfg.algorithm == "br-ffgg" and cfg.aggregator == "mean":
        raise ConfigError(
            "run-config key 'aggregator': BR-FFGG needs a robust aggregator "
            f"({', '.join(a for a in names('aggregator') if a != 'mean')}), got 'mean'; use "
            "algorithm 'ffgg' for mean aggregation"
        )
    if cfg.aggregator != "mean" or cfg.bucket_size > 1 or cfg.nnm:
        build_aggregator(cfg)  # δ derivation and every option checked now, not at round 0
    if (cfg.checkpoint_every or cfg.resume) and not cfg.out_dir:
        raise ConfigError("run-config keys 'checkpoint-every' / 'resume' need 'out-dir' (where "
                          "the checkpoint lives)")
    if cfg.byzantine_fraction == 0 and cfg.attack != "none":
        raise ConfigError(f"run-config key 'attack': {cfg.attack!r} needs byzantine-fraction > 0")


# -- fault injection (testing the failure handling) ------------------------------------
FAULT_KINDS = ("crash", "slow", "nan", "stop")


@dataclass(frozen=True)
class Fault:
    """Make the ClientApp of SuperNode ``partition`` misbehave in ``round`` (-1 = every
    round): ``crash`` raises, ``slow`` sleeps ``seconds`` before working, ``nan`` sends NaN
    weights; or (``stop``, no partition) make the ServerApp stop after ``round`` as a killed
    server would (after that round's checkpoint; async mode: after server step
    ``round`` + 1)."""

    kind: str
    partition: int = -1
    round: int = -1
    seconds: float = 0.0

    def applies(self, partition: int, round_: int) -> bool:
        """Whether the fault fires on ``partition`` in round ``round_`` (round −1: every round)."""
        return self.partition == partition and self.round in (-1, round_)


def parse_fault_injection(spec: str) -> tuple[Fault, ...]:
    """``'crash:partition=1,round=1; slow:partition=0,round=2,seconds=5'`` → faults."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, rest = part.partition(":")
        kind = kind.strip()
        if kind not in FAULT_KINDS:
            raise ConfigError(f"run-config key 'fault-injection': unknown fault {kind!r} in "
                              f"{part!r}; allowed: {', '.join(FAULT_KINDS)}")
        kw: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            k, eq, v = item.partition("=")
            k = k.strip()
            if not eq or k not in ("partition", "round", "seconds"):
                raise ConfigError(
                    f"run-config key 'fault-injection': bad item {item!r} in {part!r}; "
                    "allowed: partition=INT, round=INT (-1 = every round), seconds=FLOAT"
                )
            try:
                kw[k] = float(v) if k == "seconds" else int(v)
            except ValueError:
                raise ConfigError(
                    f"run-config key 'fault-injection': {k}={v!r} in {part!r} is not a number"
                ) from None
        if kind == "stop" and ("partition" in kw or kw.get("round", -1) < 0):
            raise ConfigError(f"run-config key 'fault-injection': {part!r}: a server stop "
                              "takes round=INT >= 0 and no partition")
        if kind != "stop" and "partition" not in kw:
            raise ConfigError(f"run-config key 'fault-injection': {part!r} needs partition=INT")
        if kind == "slow" and kw.get("seconds", 0) <= 0:
            raise ConfigError(f"run-config key 'fault-injection': {part!r} needs seconds > 0")
        out.append(Fault(kind, **kw))
    return tuple(out)


# -- partitions: which clients each SuperNode holds ------------------------------------
def partition_clients(num_clients: int, num_partitions: int, partition_id: int) -> np.ndarray:
    """The client ids SuperNode ``partition_id`` holds: contiguous, near-equal blocks
    (``np.array_split`` of ``0..M-1``), so every client lives on exactly one node."""
    if not isinstance(num_partitions, int | np.integer) or num_partitions < 1:
        raise ConfigError(f"node-config 'num-partitions' must be an integer >= 1, got "
                          f"{num_partitions!r}")
    if not isinstance(partition_id, int | np.integer) or not 0 <= partition_id < num_partitions:
        raise ConfigError(f"node-config 'partition-id' must be in [0, {num_partitions}), got "
                          f"{partition_id!r}")
    if num_partitions > num_clients:
        raise ConfigError(f"node-config 'num-partitions' ({num_partitions}) exceeds the number "
                          f"of clients ({num_clients}): some SuperNode would hold no client")
    return np.array_split(np.arange(num_clients), num_partitions)[int(partition_id)]


def node_partition(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a SuperNode's ``--node-config``."""
    missing = [k for k in ("partition-id", "num-partitions") if k not in node_config]
    if missing:
        raise ConfigError(
            f"SuperNode node-config lacks {', '.join(missing)}: start it with "
            "--node-config 'partition-id=P num-partitions=N' (simulation sets both)"
        )
    return int(node_config["partition-id"]), int(node_config["num-partitions"])


def w_init(cfg: FlowerConfig) -> str:
    """The personal initialisation: ``auto`` = zero (least squares) / pretrained (models)."""
    if cfg.w_init != "auto":
        return cfg.w_init
    return "zero" if cfg.problem == "least-squares" else "pretrained"


def build_aggregator(cfg: FlowerConfig, seed: int | None = None):
    """The aggregation rule: :func:`partialfl.build.make_aggregator` (issue 5) with the
    configured δ, bucketing and nearest-neighbour mixing."""
    from partialfl.aggregation import Mean
    from partialfl.build import make_aggregator

    if cfg.aggregator == "mean" and cfg.bucket_size == 1 and not cfg.nnm:
        return Mean(weighted=cfg.weighting == "examples")
    kw: dict[str, Any] = {"bucketing": cfg.bucket_size, "nnm": cfg.nnm,
                          "seed": cfg.seed if seed is None else seed}
    if cfg.aggregator_delta:
        kw["delta"] = cfg.aggregator_delta
    try:
        return make_aggregator(cfg.aggregator, **kw)
    except (ValueError, TypeError) as e:
        hint = ""
        if cfg.nnm and not cfg.aggregator_delta:
            hint = " (run-config keys 'nnm' = true and 'aggregator-delta' = 0: set " \
                   "aggregator-delta > 0)"
        raise ConfigError(f"run-config key 'aggregator': {e}{hint}") from None
