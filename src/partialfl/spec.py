"""The run specification: every run partialfl makes, as frozen dataclasses read from TOML.

One schema for the three kinds of run, validated on load by :func:`partialfl.config.from_dict`
(an unknown key or a bad value names the dotted key, the value and what is allowed; the
allowed names come from the one registry, :data:`partialfl.build.REGISTRY`):

* :class:`ClosedFormConfig` — ``partialfl run``: least squares / GLM with FFGG, Local GD,
  Scaffold or L2GD (tables ``[problem]``, ``[algorithm]``, ``[server]``, ``[run]``);
* :class:`PipelineConfig` — the three-stage pipeline of a neural model (pre-train →
  personalize → fine-tune), used by the reproductions;
* :class:`TrainSpec` — ``partialfl train``: a pipeline plus the model, the data (and its
  partitioning), the stages to run, device, precision and logging.

:func:`partialfl.build.build` turns any of them into objects.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from partialfl.build import names, parse_lr
from partialfl.config import ConfigError, check_choice, from_dict, to_dict
from partialfl.devices import DEVICES, PRECISIONS
from partialfl.experiments.stopping import FinetuneGrid, StopConfig, ValidationConfig
from partialfl.local.sgd import SGDConfig


# ----------------------------------------------------------------------------- optimizers
@dataclass(frozen=True)
class ClientConfig:
    """Client SGD: stepsize, epochs (or exact steps), minibatch size, gradient clipping."""

    lr: float = 0.01
    epochs: int = 1
    batch_size: int = 32
    steps: int | None = None
    clip_norm: float | None = None

    def __post_init__(self) -> None:
        try:
            self.sgd()
        except ValueError as e:
            raise ConfigError(f"client: {e}") from None

    def sgd(self, **over) -> SGDConfig:
        kw = dict(lr=self.lr, epochs=self.epochs, batch_size=self.batch_size, steps=self.steps,
                  clip_norm=self.clip_norm)
        kw.update(over)
        return SGDConfig(**kw)


@dataclass(frozen=True)
class ServerConfig:
    """Server optimizer on the aggregated pseudo-gradient, its schedule and optional clipping.

    ``lr``: a number, ``"c/L"`` (problems with a smoothness constant L) or ``"auto"`` = 1/L
    for FFGG on a closed-form problem (Theorem 1) and 1 otherwise (with a delta method, SGD
    lr 1 is FedAvg's plain averaging; ``adam`` is FedAdam)."""

    optimizer: str = "sgd"
    lr: float | str = "auto"
    momentum: float = 0.0
    schedule: str = "constant"
    warmup: int = 0
    halve_every: int = 0
    clip_norm: float | None = None

    def __post_init__(self) -> None:
        check_choice("server.optimizer", self.optimizer, names("optimizer"))
        check_choice("server.schedule", self.schedule, names("schedule"))
        if self.lr != "auto":
            parse_lr(self.lr, 1.0)
        if self.optimizer != "sgd" and self.momentum:
            raise ConfigError("server.momentum applies to optimizer 'sgd' only")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"server.momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"server.clip_norm must be None or > 0, got {self.clip_norm}")

    @property
    def is_default(self) -> bool:
        return self == ServerConfig()

    def build(self, rounds: int, L: float | None = None, auto_lr: float = 1.0):
        """The optimizer (see :func:`partialfl.build.build_server_opt`)."""
        from partialfl.build import build_server_opt

        return build_server_opt(self, rounds, L, auto_lr)


# ----------------------------------------------------------------------------- closed form
#: the largest closed-form problem a config may ask for (data and per-client matrices)
MAX_PROBLEM_BYTES = 8 * 2**30
#: what a run's name (its output file name) may look like
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"

@dataclass(frozen=True)
class ProblemConfig:
    kind: str = "least-squares"
    num_clients: int = 32
    n: int = 10_000
    d_theta: int = 100
    d_w: int = 50
    seed: int = 0
    basis: str = "eigen"          # least squares: personal coordinates (see LeastSquaresProblem)
    psi: str = "logcosh"          # glm only
    ridge: float = 1e-3           # glm only
    huber_delta: float = 1.0      # glm only

    def __post_init__(self) -> None:
        check_choice("problem.kind", self.kind, names("problem"))
        check_choice("problem.basis", self.basis, ("eigen", "standard"))
        for key in ("num_clients", "n", "d_theta", "d_w"):
            if getattr(self, key) < 1:
                raise ConfigError(f"problem.{key}: {key} must be a positive integer, got "
                                  f"{getattr(self, key)}")
        d = self.d_theta + self.d_w
        need = 8 * self.num_clients * (self.n * d + d * d)
        if need > MAX_PROBLEM_BYTES:
            raise ConfigError(
                f"problem: num_clients={self.num_clients}, n={self.n}, d_theta+d_w={d} need "
                f"about {need / 2**30:.3g} GiB of data; the limit is "
                f"{MAX_PROBLEM_BYTES / 2**30:.3g} GiB (partialfl.spec.MAX_PROBLEM_BYTES)")


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "ffgg"
    solver: str = "cg"            # ffgg: gd | cg | exact
    tau: int = 40                 # local steps (fine-tuning steps for FFGG)
    local_lr: float | None = None  # default: 1/L of the local problem
    init: str = "zero"            # ffgg: fresh w each round from zero or random
    lam: float = 0.1              # l2gd
    p: float | None = None        # l2gd: communication probability (default 1/tau)

    def __post_init__(self) -> None:
        check_choice("algorithm.name", self.name, names("closed-form-algorithm"))
        check_choice("algorithm.solver", self.solver, names("solver"))
        check_choice("algorithm.init", self.init, ("zero", "random"))
        if self.tau < 1:
            raise ConfigError(f"algorithm.tau must be >= 1, got {self.tau}")
        for key in ("local_lr", "p"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ConfigError(f"algorithm.{key} must be > 0, got {v}")


@dataclass(frozen=True)
class RunConfig:
    rounds: int = 3000
    clients_per_round: int | None = None
    seed: int = 0
    eval_every: int = 10
    backend: str = "batched"

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ConfigError(f"run.rounds must be >= 0, got {self.rounds}")
        if self.eval_every < 1:
            raise ConfigError(f"run.eval_every must be >= 1, got {self.eval_every}")
        check_choice("run.backend", self.backend, [b for b in names("backend") if b != "vmap"])


@dataclass(frozen=True)
class ClosedFormConfig:
    """``partialfl run``: the server table applies to every algorithm (FFGG's ``auto`` lr is
    1/L; Local GD / Scaffold / L2GD's is 1, plain averaging)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    name: str = "run"

    def __post_init__(self) -> None:
        if not re.fullmatch(NAME_PATTERN, self.name):
            raise ConfigError(f"name: {self.name!r} is not allowed; a run's name is a plain "
                              "file name (letters, digits, '.', '_', '-'; no folders)")


# ----------------------------------------------------------------------------- pipeline
@dataclass(frozen=True)
class StageConfig:
    """One federated training stage: rounds, clients per round, client and server optimizers,
    evaluation every ``eval_every`` rounds (0: only before the first and after the last).
    ``stop``: a plateau rule on validation data (:mod:`partialfl.experiments.stopping`);
    ``rounds`` is then the cap."""

    rounds: int = 0
    clients_per_round: int | None = 10
    client: ClientConfig = field(default_factory=ClientConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    eval_every: int = 0
    stop: StopConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, int) or self.rounds < 0:
            raise ConfigError(f"rounds must be a non-negative integer, got {self.rounds!r}")
        if self.clients_per_round is not None and self.clients_per_round < 1:
            raise ConfigError(f"clients_per_round must be >= 1, got {self.clients_per_round}")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.stop is not None and self.eval_every < 1:
            raise ConfigError("stop: the plateau rule needs eval_every >= 1 (it reads the "
                              "evaluations)")


#: methods that train a fully personal model per client (split "none", no stage 3)
FULL_PERSONAL = ("ditto", "local")


@dataclass(frozen=True)
class MethodConfig:
    """The stage-2 method and its split.

    ``algorithm``: a model algorithm or a named preset of :data:`partialfl.build.REGISTRY`.
    ``local_steps``: Local FFGG's K alternating steps (None: ``client.epochs`` passes).
    ``finetune_split``: FedAvg only — the split whose w stage 3 fine-tunes (e.g. ``output``:
    "FedAvg + fine-tuning"); None: FedAvg is evaluated as is.
    ``lam``: Ditto's λ ≥ 0 (``inf`` allowed).
    """

    algorithm: str = "ffgg"
    split: str = "output"
    split_options: dict[str, Any] = field(default_factory=dict)
    w_init: str = "pretrained"
    stateless: bool = False
    local_steps: int | None = None
    finetune_split: str | None = None
    weighting: str = "uniform"
    label: str = ""
    lam: float | None = None

    def __post_init__(self) -> None:
        check_choice("method.algorithm", self.algorithm, names("algorithm"))
        if (self.lam is None) != (self.algorithm != "ditto") or (
                self.lam is not None and not float(self.lam) >= 0):
            raise ConfigError(f"method.lam: Ditto needs lam >= 0 and other algorithms none; "
                              f"got lam={self.lam!r} for {self.algorithm!r}")
        if self.algorithm in FULL_PERSONAL and self.split != "none":
            raise ConfigError(f"method.split: {self.algorithm} keeps a full personal model; use "
                              f"'none', got {self.split!r}")
        if self.algorithm in names("preset"):  # a preset brings its own split
            if self.split not in ("output", f"preset:{self.algorithm}"):
                raise ConfigError(f"method.split: preset {self.algorithm!r} defines its own "
                                  f"split; leave method.split out, got {self.split!r}")
            object.__setattr__(self, "split", f"preset:{self.algorithm}")
        splits = names("split")
        check_choice("method.split", self.split, splits)
        check_choice("method.w_init", self.w_init, ("pretrained", "zero", "random"))
        check_choice("method.weighting", self.weighting, ("uniform", "examples"))
        if self.algorithm == "fedavg" and self.split != "none":
            raise ConfigError(f"method.split: FedAvg trains every parameter globally; use "
                              f"'none' (and finetune_split for stage 3), got {self.split!r}")
        if self.algorithm not in ("fedavg", *FULL_PERSONAL) and self.split == "none":
            raise ConfigError(f"method.split: {self.algorithm} needs personal parameters; "
                              f"allowed: {', '.join(k for k in splits if k != 'none')}")
        if self.finetune_split is not None:
            if self.algorithm != "fedavg":
                raise ConfigError("method.finetune_split applies to algorithm 'fedavg' only")
            check_choice("method.finetune_split", self.finetune_split,
                         [k for k in splits if k not in ("none", "adapter")
                          and not k.startswith("preset:")])
        if self.stateless and self.algorithm not in ("fedalt", "fedsim"):
            raise ConfigError("method.stateless applies to 'fedalt' and 'fedsim' only")
        if self.local_steps is not None and (self.algorithm != "local-ffgg"
                                             or self.local_steps < 1):
            raise ConfigError("method.local_steps must be >= 1 and applies to 'local-ffgg' only")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        s = self.algorithm + ("" if self.split == "none" else f"-{self.split}")
        return s + ("-stateless" if self.stateless else "")


#: a pipeline's backends (the registry's; "batched" is the closed-form name of "vmap")
BACKENDS = tuple(b for b in names("backend") if b != "batched")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps|auto")


@dataclass(frozen=True)
class PipelineConfig:
    """Everything one pipeline run needs besides the task.

    ``seed`` drives stages 2 and 3 (sampling, minibatches, adapter initialisation);
    ``pretrain_seed`` (default ``seed``) drives stage 1 and the model initialisation, so several
    seeds can share one pre-training. ``backend``: ``vmap`` (clients batched with
    torch.func.vmap), ``sequential`` (one client at a time) or ``processes`` (the cohort's
    clients over worker processes, :mod:`partialfl.runtime.cohort_pool`); all give the same θ.
    ``device`` (cpu, cuda, cuda:N, mps, auto) is where the model runs: it is not part of a
    run's identity, so a run started on one device resumes on another (same steps, results
    equal up to floating-point rounding). ``precision``: fp32, bf16 or fp16 (autocast).
    ``validation``: carve a validation split from each client's training data (seed
    ``stage1_seed``); the stages then train on the rest and log validation curves
    (``val_*``), the stages' ``stop`` rules and ``finetune_grid`` (stage 3's epochs and lr,
    replacing ``finetune``'s) read it, and only the final model is evaluated on test.
    """

    method: MethodConfig = field(default_factory=MethodConfig)
    pretrain: StageConfig = field(default_factory=StageConfig)
    personalize: StageConfig = field(default_factory=StageConfig)
    finetune: ClientConfig = field(default_factory=lambda: ClientConfig(lr=0.01, epochs=5))
    seed: int = 0
    pretrain_seed: int | None = None
    backend: str = "sequential"
    checkpoint_every: int = 10
    device: str = "cpu"
    precision: str = "fp32"
    validation: ValidationConfig | None = None
    finetune_grid: FinetuneGrid | None = None

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, BACKENDS)
        for key, used in (("pretrain.stop", self.pretrain.stop),
                          ("personalize.stop", self.personalize.stop),
                          ("finetune_grid", self.finetune_grid)):
            if used is not None and self.validation is None:
                raise ConfigError(f"{key} reads validation data: set validation (e.g. "
                                  "validation = {fraction = 0.1, min_examples = 2})")
        check_choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device: {self.device!r} is not allowed; allowed: "
                              f"{', '.join(DEVICES)}")
        if self.backend == "processes" and self.device != "cpu":
            raise ConfigError(f"backend 'processes' runs clients in CPU worker processes; "
                              f"device must be 'cpu', got {self.device!r}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")

    @property
    def stage1_seed(self) -> int:
        return self.seed if self.pretrain_seed is None else self.pretrain_seed

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Validated config from a (TOML) dict; errors name the key and the allowed values."""
        return from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain dict (written to ``config.json``); the validation
        settings appear only when set, so runs without them keep their identity."""
        return drop_unset(to_dict(self))


_OPTIONAL_KEYS = ("stop", "validation", "finetune_grid")


def drop_unset(d: dict) -> dict:
    """``d`` without the optional validation keys that are None (recursively)."""
    return {k: (drop_unset(v) if isinstance(v, dict) else v) for k, v in d.items()
            if not (k in _OPTIONAL_KEYS and v is None)}


# ----------------------------------------------------------------------------- train
STAGES = ("pretrain", "personalize", "finetune")


@dataclass(frozen=True)
class ModelSpec:
    """``name``: a registry model (``partialfl.build.names("model")``) or
    ``package.module:callable`` returning an ``nn.Module``; ``options`` are its keyword
    arguments (``num_classes`` is passed when the callable accepts it and it is not given)."""

    name: str = "emnist_cnn"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if ":" not in self.name:
            check_choice("model.name", self.name.replace("-", "_"),
                         [n.replace("-", "_") for n in names("model")])


@dataclass(frozen=True)
class PartitionSpec:
    """How to split data with no natural client key into clients (``flwr-datasets``
    partitioners, extra ``partialfl[partition]``): ``iid``, ``dirichlet`` (label proportions
    ~ Dir(alpha) per class), ``pathological`` (``classes_per_client`` labels each),
    ``shard`` (sorted-by-label shards, ``shards_per_client`` each); ``none`` = use the data's
    client key."""

    kind: str = "none"
    num_clients: int = 10
    alpha: float = 0.5
    classes_per_client: int = 2
    shards_per_client: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("data.partition.kind", self.kind, ("none", *names("partitioner")))
        if self.num_clients < 1:
            raise ConfigError(f"data.partition.num_clients must be >= 1, got {self.num_clients}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError(f"data.partition.alpha must be > 0, got {self.alpha}")
        if self.classes_per_client < 1 or self.shards_per_client < 1:
            raise ConfigError("data.partition.classes_per_client and shards_per_client must "
                              "be >= 1")


@dataclass(frozen=True)
class DataSpec:
    """``source``: a registry loader (``femnist``, ``shakespeare``), ``folder`` (one
    ``CLIENT.npz`` per client with ``train_x, train_y, test_x, test_y`` or ``x, y``) or
    ``hf-disk`` (a Hugging Face ``datasets`` dataset written by ``save_to_disk``).

    ``path``: the data folder (loaders: where their file lives, '' = the default), the
    per-client folder, or the saved dataset. ``options``: the loader's keyword arguments.
    ``num_clients``: keep a seeded random subset of the clients; ``holdout``: clients kept
    out of training as *new clients* for the evaluation. ``hf-disk`` / ``folder`` with
    ``x, y`` only: ``test_fraction`` of each client's examples are its test set;
    ``input_key`` / ``label_key`` / ``client_key`` are the dataset's columns (``client_key``
    '' = partition with ``partition``)."""

    source: str = "femnist"
    path: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    num_clients: int | None = None
    holdout: int = 0
    seed: int = 0
    input_key: str = "image"
    label_key: str = "label"
    client_key: str = ""
    test_fraction: float = 0.2
    partition: PartitionSpec = field(default_factory=PartitionSpec)

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, names("dataset"))
        if self.num_clients is not None and self.num_clients < 1:
            raise ConfigError(f"data.num_clients must be >= 1, got {self.num_clients}")
        if self.holdout < 0:
            raise ConfigError(f"data.holdout must be >= 0, got {self.holdout}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"data.test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.source in ("folder", "hf-disk") and not self.path:
            raise ConfigError(f"data.path: source {self.source!r} needs the folder")
        if self.partition.kind != "none" and self.source != "hf-disk":
            raise ConfigError(f"data.partition applies to source 'hf-disk' only, got "
                              f"{self.source!r} (its clients are natural)")
        if self.source == "hf-disk" and not self.client_key and self.partition.kind == "none":
            raise ConfigError("data: an hf-disk dataset needs client_key (its client column) "
                              "or a partition.kind: "
                              + ", ".join(names("partitioner")))


@dataclass(frozen=True)
class LoggingSpec:
    """JSONL metrics are always written; ``tensorboard`` adds event files (extra
    ``partialfl[tensorboard]``); ``progress`` shows tqdm bars."""

    tensorboard: bool = False
    progress: bool = True


@dataclass(frozen=True)
class TrainSpec(PipelineConfig):
    """``partialfl train CONFIG.toml``: a :class:`PipelineConfig` (tables ``[method]``,
    ``[pretrain]``, ``[personalize]``, ``[finetune]``) plus ``[model]``, ``[data]``,
    ``[logging]``, the ``stages`` to run (any subset of pretrain → personalize → finetune, in
    that order), ``device``, ``precision`` and the ``loss`` / ``metric`` (``auto``: token
    cross-entropy / next-word accuracy for text data, else cross-entropy / accuracy)."""

    name: str = "train"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    stages: tuple[str, ...] = STAGES
    loss: str = "auto"
    metric: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        for s in self.stages:
            check_choice("stages", s, STAGES)
        if list(self.stages) != [s for s in STAGES if s in self.stages]:
            raise ConfigError(f"stages: {list(self.stages)} must be distinct and in the order "
                              f"{', '.join(STAGES)}")
        check_choice("loss", self.loss, ("auto", *names("loss")))
        check_choice("metric", self.metric, ("auto", *names("metric")))

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline's config: a stage left out of ``stages`` runs 0 rounds (pre-training)
        or 0 epochs (fine-tuning); left-out personalization keeps θ of stage 1."""
        pre = self.pretrain if "pretrain" in self.stages else dataclasses.replace(
            self.pretrain, rounds=0)
        pers = self.personalize if "personalize" in self.stages else dataclasses.replace(
            self.personalize, rounds=0)
        ft = self.finetune if "finetune" in self.stages else dataclasses.replace(
            self.finetune, epochs=0, steps=None)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(PipelineConfig)}
        kw.update(pretrain=pre, personalize=pers, finetune=ft)
        return PipelineConfig(**kw)


def load_spec(cls, data: Mapping[str, Any], where: str = ""):
    """A validated spec of type ``cls`` from a (TOML) mapping."""
    return from_dict(cls, data, where)


__all__ = ["AlgorithmConfig", "ClientConfig", "ClosedFormConfig", "DataSpec", "LoggingSpec",
           "MethodConfig", "ModelSpec", "PartitionSpec", "PipelineConfig", "ProblemConfig",
           "RunConfig", "STAGES", "ServerConfig", "StageConfig", "TrainSpec", "load_spec",
           "parse_lr"]
