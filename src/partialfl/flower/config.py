"""The run configuration of the Flower app: Flower's own keys, and the run specification.

``flwr run APP -c key=value`` overrides keys of ``[tool.flwr.app.config]`` in the app's
``pyproject.toml``; Flower hands the fused flat dict to the ServerApp and every ClientApp as
``context.run_config``. The run itself — closed-form problem or model and data, algorithm and
its ``[aggregation]`` / ``[attack]`` / ``[privacy]`` / ``[faults]`` / ``[asynchronous]``
blocks, stages, seeds — is ONE :class:`~partialfl.spec.RunSpec`, carried whole by the key
``spec`` (TOML text, a JSON object, or ``b64:`` + base64 JSON as partialfl's commands send it)
with optional ``set`` overrides (``'personalize.rounds=20; seed=1'``, like ``--set``).
``stage`` picks the spec's federated stage (a closed-form spec has one, ``personalize``);
``init-from`` holds stage 1's θ (``.npz``) for stage 2 of a model run. Every other key is
Flower's own: transport, the nodes' evaluation floor, output and checkpoints, SecAgg+ and
fault injection (testing). :data:`FIELDS` is the one table of those keys, from which
:class:`FlowerConfig` and the app's ``pyproject.toml`` are generated.

:func:`parse_run_config` validates the dict once (an error names the key, the value and what
is allowed) into a frozen :class:`FlowerConfig` whose ``spec`` is the validated spec in its
canonical form (``b64:`` JSON), so the server and every SuperNode decode the same spec. What
the run builds from it is :mod:`partialfl.flower.stage` (through :mod:`partialfl.build`).

This module does not import ``flwr`` nor torch: configs are checked without the extra.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, make_dataclass
from dataclasses import field as dc_field
from typing import Any

import numpy as np

from partialfl.config import ConfigError as CoreConfigError
from partialfl.spec import STAGES, RunSpec, StageConfig

#: the stages of a spec that train federatedly (stage 3, fine-tuning, is client-local)
FEDERATED_STAGES = STAGES[:2]


class ConfigError(CoreConfigError):
    """A run-config key or value that partialfl cannot use (the message names it)."""


@dataclass(frozen=True)
class Field:
    """One run-config key: its type, default, allowed values (or a check) and help text."""

    key: str
    type: type | tuple[type, ...]
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    requirement: str = ""

    @property
    def attr(self) -> str:
        """The key as a Python attribute name (dashes to underscores)."""
        return self.key.replace("-", "_")


def _pos(v) -> bool:
    return v > 0 and math.isfinite(v)


def _nonneg(v) -> bool:
    return v >= 0 and math.isfinite(v)


#: Every key of the app's run config. Order = order in the generated pyproject.toml.
FIELDS: tuple[Field, ...] = (
    # -- what to run: the run specification --------------------------------------------
    Field("spec", str, "", "the run specification (partialfl.spec.RunSpec): TOML text, a JSON "
          "object, or b64:BASE64-JSON (what `partialfl run|train --engine flower*` sends); '' = "
          "the spec's defaults"),
    Field("set", str, "", "overrides of spec keys, ';'-separated: 'personalize.rounds=20; "
          "seed=1' (as partialfl's --set)"),
    Field("stage", str, "personalize", "the spec's federated stage this run trains: pretrain "
          "(FedAvg on every parameter) or personalize (the method; a closed-form spec's only "
          "stage)", choices=FEDERATED_STAGES),
    Field("init-from", str, "", "stage personalize of a model run: .npz of stage 1's parameters "
          "on every SuperNode ('' = the seeded initialisation, as without pre-training)"),
    # -- transport ------------------------------------------------------------------------
    Field("round-timeout", float, 300.0, "seconds to wait for a round's replies (async: for "
          "one task); late or missing replies count as failures", check=_pos,
          requirement="a number > 0"),
    Field("poll-interval", float, 0.05, "seconds between pulls of replies", check=_pos,
          requirement="a number > 0"),
    Field("min-nodes", int, 1, "SuperNodes to wait for before training", check=_pos,
          requirement="an integer >= 1"),
    Field("node-wait-timeout", float, 120.0, "seconds to wait for min-nodes SuperNodes and for "
          "their first answer (ClientApp start-up)", check=_pos, requirement="a number > 0"),
    # -- privacy of the nodes' replies ---------------------------------------------------
    Field("eval-min-clients", int, 2, "a SuperNode sends evaluation sums over at least this "
          "many clients, or nothing (a SuperNode may raise it in its node config)",
          check=_pos, requirement="an integer >= 1"),
    Field("secagg", bool, False, "aggregate the θ updates with Flower's SecAgg+ (the server "
          "learns only their sum; needs mean aggregation and `secaggplus_mod` on the "
          "ClientApps, which partialfl's ClientApp has)"),
    Field("secagg-shares", int, 3, "SecAgg+: shares of each client's secrets (>= 3; the "
          "cohort is one SecAgg+ group per node)", check=lambda v: v >= 3,
          requirement="an integer >= 3"),
    Field("secagg-threshold", int, 2, "SecAgg+: shares needed to reconstruct (>= 2, < "
          "secagg-shares)", check=lambda v: v >= 2, requirement="an integer >= 2"),
    Field("secagg-clip", float, 8.0, "SecAgg+: each update coordinate is clipped to "
          "[-c, c] before quantisation", check=_pos, requirement="a number > 0"),
    Field("secagg-bits", int, 22, "SecAgg+: quantisation levels 2^bits over [-c, c] (the "
          "error is about c / 2^bits per coordinate; N nodes need N·2^bits < 2^32)",
          check=lambda v: 8 <= v <= 24, requirement="an integer in [8, 24]"),
    # -- output and checkpoints -------------------------------------------------------------
    Field("out-dir", str, "", "server: write result.json, metrics.jsonl and theta.npz here "
          "('' = do not write)"),
    Field("audit-dir", str, "", "server: also write every message it receives, as Flower "
          "serialised it, to this folder (an audit of what the server learns; '' = no)"),
    Field("checkpoint-every", int, 0, "server: write a checkpoint (safetensors + JSON, atomic) "
          "to out-dir every k rounds (async: server steps; 0 = never)", check=_nonneg,
          requirement="an integer >= 0"),
    Field("resume", bool, False, "server: continue from the checkpoint in out-dir (refused "
          "when it was written by another configuration)"),
    # -- testing ------------------------------------------------------------------------------
    Field("fault-injection", str, "", "testing only: make ClientApps fail, e.g. "
          "'crash:partition=1,round=1; slow:partition=0,round=2,seconds=5; "
          "nan:partition=0,round=1' (non-finite weights; dtype: vectors in another dtype, "
          "extra: an undeclared record), or the server stop after a round: "
          "'stop:round=2'"),
)

_BY_KEY = {f.key: f for f in FIELDS}
_SPECS: dict[tuple[str, str], RunSpec] = {}  # decoded specs by (text, overrides)
_EFFECTIVE: dict[tuple[str, str], RunSpec] = {}  # and as the pipeline runs them


class _FlowerConfigMethods:
    def to_run_config(self) -> dict[str, Any]:
        """The flat kebab-case dict Flower carries (inverse of :func:`parse_run_config`)."""
        return {f.key: getattr(self, f.attr) for f in FIELDS}

    def replace(self, **changes: Any) -> FlowerConfig:
        """A copy with ``changes`` (kebab or snake keys), validated again."""
        cfg = self.to_run_config()
        cfg.update({k.replace("_", "-"): v for k, v in changes.items()})
        return parse_run_config(cfg)

    # -- what the spec says about this stage -------------------------------------------------
    @property
    def run(self) -> RunSpec:
        """The run specification as the pipeline runs it (:meth:`RunSpec.effective`)."""
        key = (self.spec, self.set)
        if key not in _EFFECTIVE:
            while len(_EFFECTIVE) >= 8:
                _EFFECTIVE.pop(next(iter(_EFFECTIVE)))
            _EFFECTIVE[key] = _spec(self.spec, self.set).effective()
        return _EFFECTIVE[key]

    @property
    def closed_form(self) -> bool:
        """Whether the spec trains a closed-form problem."""
        return self.run.closed_form

    @property
    def stage_config(self) -> StageConfig:
        """The stage this run trains (``[pretrain]`` or ``[personalize]``)."""
        return getattr(self.run, self.stage)

    @property
    def rounds(self) -> int:
        """Rounds of the stage (asynchronous: server steps)."""
        return self.stage_config.rounds

    @property
    def clients_per_round(self) -> int | None:
        """Clients sampled per round (None: all)."""
        return self.stage_config.clients_per_round

    @property
    def seed(self) -> int:
        """The stage's seed (stage 1: ``pretrain_seed``, else ``seed``)."""
        run = self.run
        return run.stage1_seed if self.stage == "pretrain" else run.seed

    @property
    def eval_every(self) -> int:
        """The stage's evaluation period (0: before the first and after the last round)."""
        return self.stage_config.eval_every

    @property
    def max_failure_fraction(self) -> float:
        """Abort past this fraction of failed client updates (the spec's)."""
        return self.run.max_failure_fraction

    @property
    def asynchronous(self):
        """The spec's ``[asynchronous]`` block (None: synchronous rounds)."""
        return self.run.asynchronous

    @property
    def buffer_size(self) -> int:
        """Arriving updates per server step (FedBuff's ``buffer`` K; 1 otherwise)."""
        a = self.asynchronous
        return 1 if a is None else int(a.rule.get("buffer", 1))

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must match: the spec's identity (dotted keys) and this
        config's keys but the volatile ones (:data:`VOLATILE`)."""
        out = {k: v for k, v in self.to_run_config().items()
               if k not in VOLATILE and k not in ("spec", "set")}
        out.update(_flatten(self.run.identity()))
        return json.loads(json.dumps(out))  # as read back from a checkpoint


#: run-config keys that may differ between an interrupted run and its resumption
VOLATILE = ("out-dir", "resume", "checkpoint-every", "fault-injection", "round-timeout",
            "poll-interval", "min-nodes", "node-wait-timeout", "audit-dir")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


#: The validated run config: one attribute per key of :data:`FIELDS` (``-`` → ``_``), with
#: the table's defaults (generated from it, so the two cannot disagree).
FlowerConfig = make_dataclass(
    "FlowerConfig",
    [(f.attr, Any, dc_field(default=f.default)) for f in FIELDS],
    bases=(_FlowerConfigMethods,), frozen=True)
FlowerConfig.__module__ = __name__


# -- the spec -------------------------------------------------------------------------------
def encode_spec(spec: RunSpec) -> str:
    """The spec as one run-config string: ``b64:`` + base64 of its compact JSON (``flwr run
    -c`` splits its argument at spaces and quotes, which JSON is full of)."""
    text = json.dumps(spec.to_dict(), separators=(",", ":"), sort_keys=True)
    return "b64:" + base64.urlsafe_b64encode(text.encode()).decode()


def decode_spec(text: str, overrides: str = "") -> dict[str, Any]:
    """The spec's plain dict from its run-config text (``b64:`` JSON, a JSON object or TOML)
    with ``overrides`` (``'key=value; key=value'``) applied; nothing is imported or built
    (:func:`partialfl.flower.node.check_code` reads it before anything is)."""
    from partialfl.config import apply_overrides

    text = text.strip()
    try:
        if text.startswith("b64:"):
            data = json.loads(base64.urlsafe_b64decode(text[4:].encode()).decode())
        elif text.startswith("{"):
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, binascii.Error, UnicodeDecodeError,
            ValueError, RecursionError) as e:
        raise ConfigError(f"run-config key 'spec': neither TOML, a JSON object nor b64:JSON "
                          f"({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"run-config key 'spec': expected a table of spec keys, got "
                          f"{type(data).__name__}")
    sets = [s.strip() for s in overrides.split(";") if s.strip()]
    try:
        return apply_overrides(copy.deepcopy(data), sets)
    except CoreConfigError as e:
        raise ConfigError(f"run-config key 'set': {e}") from None


def _spec(text: str, overrides: str = "") -> RunSpec:
    """The validated spec of ``text`` (cached). Plugins named by the spec are imported only
    where code from configs is allowed (:func:`partialfl.build.allow_code`)."""
    key = (text, overrides)
    if key not in _SPECS:
        from partialfl.build import load_spec_plugins
        from partialfl.config import from_dict

        data = decode_spec(text, overrides)
        try:
            load_spec_plugins(data.get("plugins", []))
            spec = from_dict(RunSpec, data)
        except CoreConfigError as e:
            raise ConfigError(f"run-config key 'spec': {e}") from None
        while len(_SPECS) >= 8:
            _SPECS.pop(next(iter(_SPECS)))
        _SPECS[key] = spec
    return _SPECS[key]


# -- parsing --------------------------------------------------------------------------------
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
        raise ConfigError(f"run-config key {f.key!r}: got {value!r} ({type(value).__name__}); "
                          f"expected {f.requirement or _type_names(types)}")
    return value


def _type_names(types) -> str:
    return " or ".join(t.__name__ for t in types)


def parse_run_config(run_config: Mapping[str, Any] | None = None, **overrides: Any
                     ) -> FlowerConfig:
    """Validate Flower's ``context.run_config`` (plus keyword ``overrides``) into a config.

    ``spec`` may also be a :class:`RunSpec` or a dict (Python use). Unknown keys, wrong types,
    values outside the allowed set, a spec that does not validate and combinations the app
    cannot run raise :class:`ConfigError` naming the key, the value and what is allowed. The
    result's ``spec`` is the validated spec, canonically encoded (``set`` applied, then '')."""
    raw = dict(run_config or {})
    raw.update({k.replace("_", "-"): v for k, v in overrides.items()})
    if isinstance(raw.get("spec"), RunSpec):
        raw["spec"] = encode_spec(raw["spec"])
    elif isinstance(raw.get("spec"), Mapping):
        raw["spec"] = json.dumps(raw["spec"])
    unknown = sorted(set(raw) - set(_BY_KEY))
    if unknown:
        from partialfl.config import did_you_mean

        raise ConfigError(f"unknown run-config key(s) {', '.join(map(repr, unknown))}"
                          f"{did_you_mean(unknown[0], list(_BY_KEY))}; allowed keys: "
                          f"{', '.join(_BY_KEY)} (the run itself is the spec: "
                          "-c set='\"key=value\"')")
    values = {}
    for f in FIELDS:
        v = _coerce(f, raw[f.key]) if f.key in raw else f.default
        if isinstance(v, str) and f.key != "spec":
            v = v.strip()
        if f.choices is not None and v not in f.choices:
            raise ConfigError(f"run-config key {f.key!r}: unknown value {v!r}; allowed: "
                              f"{', '.join(map(str, f.choices))}")
        if f.check is not None and not f.check(v):
            raise ConfigError(f"run-config key {f.key!r}: got {v!r}; expected {f.requirement}")
        values[f.attr] = v
    spec = _spec(values["spec"], values["set"])
    values["spec"], values["set"] = encode_spec(spec), ""
    _SPECS.setdefault((values["spec"], ""), spec)
    cfg = FlowerConfig(**values)
    _check_combinations(cfg)
    parse_fault_injection(cfg.fault_injection)
    return cfg


#: why an algorithm that keeps client state is refused (before Flower starts, and by a
#: ClientApp)
STATEFUL = ("keeps per-client state between rounds (APFL's v_m and α_m, Ditto's v_m, "
            "Scaffold's c_m, stateful FedAlt/FedSim's w_m), and a Flower SuperNode keeps none: "
            "run it in process (no --engine), or choose a stateless method (FedAvg, FedProx, "
            "FFGG, Local FFGG, FedAlt/FedSim with stateless = true)")


def _check_combinations(cfg: FlowerConfig) -> None:
    run = cfg.run
    if run.closed_form and cfg.stage != "personalize":
        raise ConfigError(f"run-config key 'stage': a closed-form spec has one stage, "
                          f"personalize; got {cfg.stage!r}")
    if cfg.init_from and (run.closed_form or cfg.stage != "personalize"):
        raise ConfigError("run-config key 'init-from' applies to stage personalize of a model "
                          "run (stage 1's parameters)")
    if (cfg.checkpoint_every or cfg.resume) and not cfg.out_dir:
        raise ConfigError("run-config keys 'checkpoint-every' / 'resume' need 'out-dir' (where "
                          "the checkpoint lives)")
    for key, st in (("pretrain", run.pretrain), ("personalize", run.personalize)):
        if st.stop is not None:
            raise ConfigError(f"spec {key}.stop: the plateau rule reads per-client validation "
                              "metrics, which SuperNodes do not send; give a fixed number of "
                              "rounds on Flower")
    if cfg.secagg_threshold >= cfg.secagg_shares:
        raise ConfigError(f"run-config key 'secagg-threshold': {cfg.secagg_threshold} must be "
                          f"less than secagg-shares ({cfg.secagg_shares})")
    if cfg.secagg:  # SecAgg+ gives the server the sum of a round's updates only
        # ([privacy]: DP's server step needs the sum and the count, checked on its algorithm
        # by partialfl.flower.secagg.check_algorithm)
        for key, block in (("aggregation", run.aggregation), ("attack", run.attack),
                           ("asynchronous", run.asynchronous)):
            if block is not None:
                raise ConfigError(f"secagg: the spec's [{key}] block needs each client's "
                                  "update (or a client at a time); SecAgg+ gives the server "
                                  "only the sum of a round's updates: remove it or set "
                                  "secagg = false")


# -- fault injection (testing the failure handling) ------------------------------------
FAULT_KINDS = ("crash", "slow", "nan", "dtype", "extra", "stop")
#: the kinds a ClientApp applies to its reply (a hostile node: the server must refuse it)
REPLY_FAULTS = ("nan", "dtype", "extra")


@dataclass(frozen=True)
class Fault:
    """Make the ClientApp of SuperNode ``partition`` misbehave in ``round`` (-1 = every
    round): ``crash`` raises, ``slow`` sleeps ``seconds`` before working, ``nan`` sends NaN
    weights, ``dtype`` its vectors in another float dtype, ``extra`` an undeclared record;
    or (``stop``, no partition) make the ServerApp stop after ``round`` as a killed server
    would (after that round's checkpoint; async mode: after server step ``round`` + 1)."""

    kind: str
    partition: int = -1
    round: int = -1
    seconds: float = 0.0

    def applies(self, partition: int, round_: int) -> bool:
        """Whether the fault fires on ``partition`` in round ``round_`` (round −1: every round)."""
        return self.partition == partition and self.round in (-1, round_)


def inject_faults(spec: str, partition: int, round_: int) -> None:
    """On a ClientApp: raise (``crash``) or sleep (``slow``) as ``spec`` says for this
    ``partition`` and round (:data:`REPLY_FAULTS` are applied to the reply by the caller)."""
    import time

    for f in parse_fault_injection(spec):
        if f.kind in ("crash", "slow") and f.applies(partition, round_):
            if f.kind == "crash":
                raise RuntimeError(f"injected crash: partition {partition}, round {round_}")
            time.sleep(f.seconds)


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
                    "allowed: partition=INT, round=INT (-1 = every round), seconds=FLOAT")
            try:
                kw[k] = float(v) if k == "seconds" else int(v)
            except ValueError:
                raise ConfigError(f"run-config key 'fault-injection': {k}={v!r} in {part!r} "
                                  "is not a number") from None
        if kind == "stop" and ("partition" in kw or kw.get("round", -1) < 0):
            raise ConfigError(f"run-config key 'fault-injection': {part!r}: a server stop "
                              "takes round=INT >= 0 and no partition")
        if kind != "stop" and "partition" not in kw:
            raise ConfigError(f"run-config key 'fault-injection': {part!r} needs partition=INT")
        if kind == "slow" and not 0 < kw.get("seconds", 0) <= 86400:  # a day; NaN: False
            raise ConfigError(f"run-config key 'fault-injection': {part!r}: 0 < seconds <= 86400")
        out.append(Fault(kind, **kw))
    return tuple(out)


# -- partitions: which clients each SuperNode holds ------------------------------------
def partition_clients(num_clients: int, num_partitions: int, partition_id: int) -> np.ndarray:
    """The client ids node ``partition_id`` holds: ``np.array_split(0..M-1, P)``'s block,
    computed alone (a node may claim millions of partitions); each client on one node."""
    if not isinstance(num_partitions, int | np.integer) or num_partitions < 1:
        raise ConfigError(f"node-config 'num-partitions' must be an integer >= 1, got "
                          f"{num_partitions!r}")
    if not isinstance(partition_id, int | np.integer) or not 0 <= partition_id < num_partitions:
        raise ConfigError(f"node-config 'partition-id' must be in [0, {num_partitions}), got "
                          f"{partition_id!r}")
    if num_partitions > num_clients:
        raise ConfigError(f"node-config 'num-partitions' ({num_partitions}) exceeds the number "
                          f"of clients ({num_clients}): some SuperNode would hold no client")
    (q, extra), p = divmod(int(num_clients), int(num_partitions)), int(partition_id)
    return np.arange(p * q + min(p, extra), p * q + min(p, extra) + q + (p < extra))


def node_partition(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a SuperNode's ``--node-config``."""
    missing = [k for k in ("partition-id", "num-partitions") if k not in node_config]
    if missing:
        raise ConfigError(f"SuperNode node-config lacks {', '.join(missing)}: start it with "
                          "--node-config 'partition-id=P num-partitions=N' (simulation sets "
                          "both)")
    out = [str(node_config[k]).strip() for k in ("partition-id", "num-partitions")]
    for k, text in zip(("partition-id", "num-partitions"), out):
        v = node_config[k]  # an int, or its digits (never a bool, a float or other digits)
        if isinstance(v, bool) or not isinstance(v, int | str) or not (
                text.isascii() and text.lstrip("-").isdigit()):
            raise ConfigError(f"node-config {k!r}: got {v!r}; expected an integer")
    return int(out[0]), int(out[1])
