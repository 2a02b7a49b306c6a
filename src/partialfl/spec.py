"""The run specification: every run partialfl makes, as ONE frozen dataclass read from TOML.

:class:`RunSpec` is what ``partialfl run`` / ``partialfl train``, the pipeline, the
reproductions and the Flower app read. A run trains either a closed-form problem
(``[problem]``: least squares, GLM — one stage, ``[personalize]``) or a neural model on
federated data (``[model]``, ``[data]``: the three-stage pipeline pre-train → personalize →
fine-tune). Components are named by the registry (:mod:`partialfl.registry`): ``"name"`` or
``{name = "…", …options}``, validated by each entry's ``Options``; the algorithm's options sit
in the ``[method]`` table itself (``algorithm = "ditto"``, ``lam = 0.1``). Optional blocks wrap
the algorithm: ``[aggregation]`` (the server's aggregation rule), ``[attack]`` (Byzantine
clients), ``[privacy]`` (client-level DP of θ), ``[faults]`` (fault injection),
``[asynchronous]`` (the asynchronous runtime).

Validation happens on load (:func:`partialfl.config.from_dict`): an unknown key or a bad value
names the dotted key, the value and what is allowed. :func:`partialfl.build.build` turns a spec
into the objects that run it. Importing this module loads no array library.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from partialfl.config import ConfigError, check_choice, from_dict, to_dict, unknown_key_error
from partialfl.registry import Component, component, entry, option

#: what a device name may look like (checked against the machine when a run is built)
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?|mps|auto")
DEVICES = ("cpu", "cuda", "cuda:N", "mps", "auto")
PRECISIONS = ("fp32", "bf16", "fp16")
#: what a run's name (its output file name) may look like
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
STAGES = ("pretrain", "personalize", "finetune")
W_INITS = ("pretrained", "zero", "random")
WEIGHTINGS = ("uniform", "examples")


def comp(kind: str, default: str | None, doc: str) -> Any:
    """A spec field naming a component of ``kind`` (``default``: its name, or None for an
    optional block; a table without ``name`` means ``default``)."""
    def parse(value, key):
        return None if value is None else component(kind, value, key, default)

    meta = {"kind": kind, "doc": doc, "default_name": default, "parse": parse}
    if default is None:
        return field(default=None, metadata=meta)
    return field(default_factory=lambda: component(kind, default), metadata=meta)


class _Spec:
    """Mixin: component fields given as a name or a dict (Python) become :class:`Component` s,
    and ``ValueError`` s of ``__post_init__`` checks read as :class:`ConfigError`."""

    def _components(self, where: str) -> None:
        for f in dataclasses.fields(self):
            kind = f.metadata.get("kind")
            v = getattr(self, f.name)
            if kind and v is not None and not (isinstance(v, Component) and v.kind == kind):
                key = f"{where}.{f.name}" if where else f.name
                object.__setattr__(self, f.name, component(kind, v, key,
                                                           f.metadata.get("default_name")))


# ----------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class StopConfig:
    """The plateau rule of one stage (:func:`partialfl.pipeline.stopping.plateaued`): stop
    when the last ``window`` evaluations improved the best ``metric`` by less than
    ``min_delta``; the stage's ``rounds`` is then the cap."""

    metric: str = option("val_acc", "a validation metric (val_acc, val_loss, …)")
    mode: str = option("max", "max or min: which direction is better")
    min_delta: float = option(0.001, "smallest improvement that counts, >= 0")
    window: int = option(3, "evaluations without improvement before stopping, >= 1")

    def __post_init__(self) -> None:
        check_choice("stop.mode", self.mode, ("max", "min"))
        if not self.metric.startswith("val_"):
            raise ConfigError(f"stop.metric must be a validation metric (val_acc, val_loss, "
                              f"...), got {self.metric!r}")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ConfigError(f"stop.window must be an integer >= 1, got {self.window!r}")
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ConfigError(f"stop.min_delta must be finite and >= 0, got {self.min_delta}")


@dataclass(frozen=True)
class ValidationConfig:
    """A validation split carved from each client's training data (seeded): ``fraction`` of
    it, at least ``min_examples``; the stages' stopping rules and stage 3's grid read it."""

    fraction: float = option(0.1, "fraction of each client's training data, in (0, 1)")
    min_examples: int = option(2, "at least this many validation examples per client")

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ConfigError(f"validation.fraction must be in (0, 1), got {self.fraction}")
        if not (isinstance(self.min_examples, int) and self.min_examples >= 0):
            raise ConfigError(f"validation.min_examples must be an integer >= 0, got "
                              f"{self.min_examples!r}")


@dataclass(frozen=True)
class FinetuneGrid:
    """Stage 3's grid: fine-tuning ``epochs`` × ``lr`` chosen on validation ``metric`` (ties:
    fewer epochs, then the smaller lr)."""

    epochs: tuple[int, ...] = option((0, 1, 3, 5), "fine-tuning epochs to try (0: none)")
    lr: tuple[float, ...] = option((0.003, 0.01, 0.03), "stepsizes to try")
    metric: str = option("val_acc", "val_acc or val_loss")

    def __post_init__(self) -> None:
        if not self.epochs or any(not isinstance(e, int) or e < 0 for e in self.epochs):
            raise ConfigError(f"finetune_grid.epochs must be integers >= 0, got {self.epochs}")
        if not self.lr or any(not (math.isfinite(v) and v > 0) for v in self.lr):
            raise ConfigError(f"finetune_grid.lr must be finite and > 0, got {self.lr}")
        check_choice("finetune_grid.metric", self.metric, ("val_acc", "val_loss"))

    def settings(self) -> list[tuple[int, float]]:
        """(epochs, lr) in grid order; epochs 0 once (the lr does not matter)."""
        out = [(0, float(self.lr[0]))] if 0 in self.epochs else []
        return out + [(e, float(v)) for e in sorted(set(self.epochs)) if e > 0 for v in self.lr]


# ----------------------------------------------------------------------------- optimizers
@dataclass(frozen=True)
class ServerConfig(_Spec):
    """The server optimizer on the aggregated pseudo-gradient, its schedule and clipping.

    ``lr``: a number, ``"c/L"`` (problems with a smoothness constant L) or ``"auto"`` = 1/L
    for algorithms that send θ-gradients on a closed-form problem (Theorem 1) and 1
    otherwise (with a delta method, SGD lr 1 is FedAvg's plain averaging; ``adam`` is
    FedAdam)."""

    optimizer: Component = comp("optimizer", "sgd", "server optimizer: sgd {momentum} or "
                                "adam {beta1, beta2, eps}")
    lr: float | str = option("auto", "stepsize: a number, 'c/L' or 'auto'")
    schedule: Component = comp("schedule", "constant", "stepsize schedule over the stage's "
                               "rounds: constant, warmup-linear {warmup}, exponential "
                               "{halve_every}")
    clip_norm: float | None = option(None, "clip the pseudo-gradient to this norm")

    def __post_init__(self) -> None:
        self._components("server")
        if self.lr != "auto":
            parse_lr(self.lr, 1.0)
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"server.clip_norm must be None or > 0, got {self.clip_norm}")


def parse_lr(lr: float | str, L: float | None, key: str = "server.lr") -> float:
    """A stepsize given as a number or as ``"c/L"`` (e.g. ``"1/L"``, ``"0.5/L"``) with ``L``
    the problem's smoothness constant."""
    if isinstance(lr, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*/\s*L\s*", lr)
        if not m:
            raise ConfigError(f"{key}: {lr!r} is neither a number, 'auto' nor of the form 'c/L'")
        if L is None:
            raise ConfigError(f"{key}: {lr!r} needs a problem with a known smoothness constant "
                              "L (least squares, GLM); give a number")
        value = float(m.group(1)) / L
    else:
        value = float(lr)
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be positive, got {lr!r}")
    return value


# ----------------------------------------------------------------------------- stages
@dataclass(frozen=True)
class StageConfig(_Spec):
    """One federated training stage: rounds, clients per round, the client optimizer
    (``client``: SGD epochs on a model; GD / CG / exact fine-tuning on a closed form), the
    server optimizer, evaluation every ``eval_every`` rounds (0: only before the first and
    after the last). ``stop``: a plateau rule on validation data; ``rounds`` is then the
    cap."""

    rounds: int = option(0, "rounds (the cap with a stop rule)")
    clients_per_round: int | None = option(None, "clients sampled per round (None or 0: all)")
    client: Component = comp("local", "sgd", "client optimizer or fine-tuning solver: sgd "
                             "{lr, epochs, batch_size, steps, clip_norm}, gd {tau, lr}, cg "
                             "{tau}, exact")
    server: ServerConfig = option(factory=ServerConfig, doc="the server optimizer")
    eval_every: int = option(0, "evaluate every this many rounds (0: first and last only)")
    stop: StopConfig | None = option(None, "a plateau rule on validation data")

    def __post_init__(self) -> None:
        self._components("")
        if not isinstance(self.rounds, int) or self.rounds < 0:
            raise ConfigError(f"rounds must be a non-negative integer, got {self.rounds!r}")
        if self.clients_per_round is not None and self.clients_per_round < 0:
            raise ConfigError(f"clients_per_round must be >= 0 (0: all), got "
                              f"{self.clients_per_round}")
        if self.clients_per_round == 0:
            object.__setattr__(self, "clients_per_round", None)
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.stop is not None and self.eval_every < 1:
            raise ConfigError("stop: the plateau rule needs eval_every >= 1 (it reads the "
                              "evaluations)")


@dataclass(frozen=True)
class FinetuneConfig:
    """Stage 3: every client fine-tunes its personal parameters with θ fixed (SGD)."""

    lr: float = option(0.01, "stepsize")
    epochs: int = option(5, "passes over the client's data (0: no fine-tuning)")
    batch_size: int = option(32, "minibatch size")
    steps: int | None = option(None, "exact number of steps instead of epochs")
    clip_norm: float | None = option(None, "clip each step's gradient to this norm")

    def __post_init__(self) -> None:
        try:
            self.sgd()
        except ValueError as e:
            raise ConfigError(f"finetune: {e}") from None

    def sgd(self, **over):
        """The :class:`~partialfl.local.sgd.SGDConfig` of these settings (with ``over``)."""
        from partialfl.local.sgd import SGDConfig

        return SGDConfig(**{**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(self)}, **over})


# ----------------------------------------------------------------------------- method
@dataclass(frozen=True)
class MethodConfig(_Spec):
    """The method and its split. ``algorithm``: a registered algorithm; its own options are
    keys of this table too (validated by the algorithm's entry; in Python:
    ``options={...}``). ``split``: which parameters are personal (model runs; default
    ``output`` for algorithms that need a personal part, ``none`` for those that train one
    shared model; closed-form problems define their own). ``finetune_split``: for an
    algorithm that trains one shared model (FedAvg, Scaffold), the part stage 3 fine-tunes
    per client ("FedAvg + fine-tuning"); None: evaluated as is."""

    __options_of__ = ("algorithm", "algorithm")

    algorithm: str = option("ffgg", "a registered algorithm")
    split: Component | None = comp("split", None, "personal parameters: none, input, output "
                                   "{layers, modules}, adapter {rank, modules}, norm, pattern "
                                   "{personal, global_}")
    w_init: str = option("pretrained", "where personal parameters start: pretrained, zero, "
                         "random")
    weighting: str = option("uniform", "aggregation weights: uniform or examples")
    finetune_split: Component | None = comp("split", None, "the part stage 3 fine-tunes after "
                                            "a shared-model algorithm")
    label: str = option("", "the method's name in tables (default: algorithm-split)")
    options: Any = option(None, "the algorithm's options (TOML: keys of this table)")

    def __post_init__(self) -> None:
        self._components("method")
        e = entry("algorithm", self.algorithm, "method.algorithm")
        object.__setattr__(self, "algorithm", e.name)
        opts = self.options
        if opts is None or isinstance(opts, Mapping):
            own = [f.name for f in dataclasses.fields(e.options)] if e.options else []
            bad = sorted(set(opts or {}) - set(own))
            if bad:
                keys = [f.name for f in dataclasses.fields(self) if f.name != "options"]
                raise unknown_key_error(bad[0], [*keys, *own], "method")
            object.__setattr__(self, "options", e.parse(opts, "method"))
        elif e.options is None or not isinstance(opts, e.options):
            raise ConfigError(f"method.options: expected {e.options} for {e.name!r}, got "
                              f"{type(opts).__name__}")
        check_choice("method.w_init", self.w_init, W_INITS)
        check_choice("method.weighting", self.weighting, WEIGHTINGS)
        kind = e.trait("split", "personal")
        s = self.split.name if self.split is not None else None
        if kind in ("none", "full") and s not in (None, "none"):
            what = ("trains one shared model" if kind == "none"
                    else "keeps a full personal model")
            raise ConfigError(f"method.split: {e.name} {what}; use 'none' (or leave it out), "
                              f"got {s!r}")
        if kind == "personal" and s == "none":
            raise ConfigError(f"method.split: {e.name} needs personal parameters; give a split "
                              "other than 'none'")
        if kind == "preset" and self.split is not None:
            raise ConfigError(f"method.split: {e.name} defines its own split; leave it out")
        if self.finetune_split is not None:
            if kind != "none":
                raise ConfigError(f"method.finetune_split applies to algorithms that train one "
                                  f"shared model (split 'none'), not {e.name!r}")
            if self.finetune_split.name == "none":
                raise ConfigError("method.finetune_split: give the part to fine-tune, not "
                                  "'none'")

    @property
    def entry(self):
        """The algorithm's registry entry."""
        return entry("algorithm", self.algorithm)

    @property
    def split_kind(self) -> str:
        """The split's name (a model run's default when none is given)."""
        if self.split is not None:
            return self.split.name
        kind = self.entry.trait("split", "personal")
        return {"personal": "output", "preset": f"preset:{self.algorithm}"}.get(kind, "none")

    def option(self, key: str, default: Any = None) -> Any:
        """One of the algorithm's options (``default`` if it has no such option)."""
        return getattr(self.options, key, default)

    @property
    def name(self) -> str:
        """The method's label: ``label``, else ``algorithm-split`` (``-stateless``)."""
        if self.label:
            return self.label
        s = self.split_kind
        base = self.algorithm + ("" if s == "none" or s.startswith("preset:") else f"-{s}")
        return base + ("-stateless" if self.option("stateless") else "")


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


@dataclass(frozen=True)
class DataSpec(_Spec):
    """``source``: a registered data source (``femnist``, ``shakespeare``, ``har``, ``folder``,
    ``hf-disk``, …); ``path``: its folder or file (relative to the config file's folder);
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
    ``partialfl[tensorboard]``); ``progress`` shows progress bars."""

    tensorboard: bool = option(False, "also write TensorBoard event files")
    progress: bool = option(True, "show progress bars")


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
    ``rounds`` of the stage count applied updates."""

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


# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class RunSpec(_Spec):
    """One run (see the module docstring). ``seed`` drives stages 2 and 3 (sampling,
    minibatches, adapter initialisation); ``pretrain_seed`` (default ``seed``) drives stage 1
    and the model initialisation, so several seeds can share one pre-training. ``backend``:
    how a cohort's clients run (``sequential``, ``vmap``, ``processes``; all give the same
    θ). ``threads``: torch and BLAS threads of this process (recorded with the run; a run
    repeats exactly at the same thread count). ``device`` is where the model runs (not part
    of a run's identity: a run started on one device resumes on another)."""

    name: str = option("run", "the run's name (its output folder or file)")
    seed: int = option(0, "seed of stages 2 and 3 (a closed-form run: its only seed)")
    pretrain_seed: int | None = option(None, "seed of stage 1 and the model (default seed)")
    stages: tuple[str, ...] = option(STAGES, "the stages to run, in order")
    threads: int = option(1, "torch/BLAS threads of this process")
    device: str = option("cpu", "cpu, cuda, cuda:N, mps or auto")
    precision: str = option("fp32", "fp32, bf16 or fp16 (autocast)")
    backend: Component | None = comp("executor", None, "how a cohort's clients run: "
                                     "sequential, vmap {max_examples}, processes {workers} "
                                     "(default: vmap on a closed form, sequential on a model)")
    checkpoint_every: int = option(10, "checkpoint every this many rounds")
    plugins: tuple[str, ...] = option((), "modules that register components (code: needs "
                                      "--allow-code)")
    problem: Component | None = comp("problem", None, "a closed-form problem (instead of "
                                     "model and data)")
    model: ModelSpec | None = option(None, "the model (a model run; default emnist_cnn)")
    data: DataSpec | None = option(None, "the federated data (a model run; default femnist)")
    method: MethodConfig = option(factory=MethodConfig, doc="the method and its split")
    pretrain: StageConfig = option(factory=StageConfig, doc="stage 1: FedAvg on every "
                                   "parameter")
    personalize: StageConfig = option(factory=StageConfig, doc="stage 2: the method (a "
                                      "closed-form run's only stage)")
    finetune: FinetuneConfig = option(factory=FinetuneConfig, doc="stage 3: fine-tuning")
    validation: ValidationConfig | None = option(None, "carve a validation split")
    finetune_grid: FinetuneGrid | None = option(None, "choose stage 3 on validation data")
    aggregation: Component | None = comp("aggregator", None, "the server's aggregation rule "
                                         "(default: the mean)")
    attack: Component | None = comp("wrapper", None, "Byzantine clients: byzantine "
                                    "{fraction, attack, …}")
    privacy: Component | None = comp("wrapper", None, "client-level differential privacy "
                                     "of θ: dp {…}")
    faults: Component | None = comp("wrapper", None, "fault injection: faults {rate, kinds}")
    asynchronous: AsyncSpec | None = option(None, "run asynchronously (Algorithm 3)")
    logging: LoggingSpec = option(factory=LoggingSpec, doc="metrics files and progress")
    loss: str = option("auto", "training loss (auto: by the data's kind)")
    metric: str = option("auto", "evaluation metric (auto: by the data's kind)")
    max_failure_fraction: float = option(0.5, "abort when more client computations than "
                                         "this fraction fail")

    def __post_init__(self) -> None:
        self._components("")
        if self.backend is None:
            object.__setattr__(self, "backend", component(
                "executor", "vmap" if self.closed_form else "sequential"))
        if not re.fullmatch(NAME_PATTERN, self.name):
            raise ConfigError(f"name: {self.name!r} is not allowed; a run's name is a plain "
                              "file name (letters, digits, '.', '_', '-'; no folders)")
        for s in self.stages:
            check_choice("stages", s, STAGES)
        if list(self.stages) != [s for s in STAGES if s in self.stages]:
            raise ConfigError(f"stages: {list(self.stages)} must be distinct and in the order "
                              f"{', '.join(STAGES)}")
        if not (isinstance(self.threads, int) and self.threads >= 1):
            raise ConfigError(f"threads must be an integer >= 1, got {self.threads!r}")
        for key, used in (("pretrain.stop", self.pretrain.stop),
                          ("personalize.stop", self.personalize.stop),
                          ("finetune_grid", self.finetune_grid)):
            if used is not None and self.validation is None:
                raise ConfigError(f"{key} reads validation data: set validation (e.g. "
                                  "validation = {fraction = 0.1, min_examples = 2})")
        check_choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device: {self.device!r} is not allowed; allowed: "
                              f"{', '.join(DEVICES)}")
        if self.backend.entry.trait("cpu_only") and self.device != "cpu":
            raise ConfigError(f"backend {self.backend.name!r} runs clients in CPU worker "
                              f"processes; device must be 'cpu', got {self.device!r}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if not 0 <= self.max_failure_fraction <= 1:
            raise ConfigError(f"max_failure_fraction must be in [0, 1], got "
                              f"{self.max_failure_fraction}")
        for key, c, want in (("attack", self.attack, "byzantine"),
                             ("privacy", self.privacy, "privacy"),
                             ("faults", self.faults, "faults")):
            if c is not None and c.entry.trait("block") != want:
                raise ConfigError(f"{key}: {c.name!r} is not allowed here; allowed: "
                                  f"{', '.join(_block_names(want))}")
        if self.closed_form and self.method.split is not None:
            raise ConfigError("method.split: a closed-form problem defines its own personal "
                              "coordinates; leave split out")
        if self.closed_form and (self.model is not None or self.data is not None):
            raise ConfigError("problem: a closed-form run has no model or data; give either "
                              "[problem] or [model] and [data]")
        for key, name in (("loss", self.loss), ("metric", self.metric)):
            if name != "auto":
                entry(key, name, key)

    @property
    def closed_form(self) -> bool:
        """Whether this run trains a closed-form problem (one stage, no model or data)."""
        return self.problem is not None

    @property
    def stage1_seed(self) -> int:
        """The seed of stage 1 and of the model's initialisation."""
        return self.seed if self.pretrain_seed is None else self.pretrain_seed

    def effective(self) -> RunSpec:
        """The spec as the pipeline runs it: a stage left out of ``stages`` runs 0 rounds
        (pre-training, personalization) or 0 epochs (fine-tuning)."""
        over: dict[str, Any] = {}
        if "pretrain" not in self.stages:
            over["pretrain"] = dataclasses.replace(self.pretrain, rounds=0)
        if "personalize" not in self.stages:
            over["personalize"] = dataclasses.replace(self.personalize, rounds=0)
        if "finetune" not in self.stages:
            over["finetune"] = dataclasses.replace(self.finetune, epochs=0, steps=None)
        return dataclasses.replace(self, **over) if over else self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> RunSpec:
        """Validated spec from a (TOML) dict; errors name the key and the allowed values."""
        return from_dict(cls, data, where)

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain dict (``spec.json``; :meth:`from_dict` reads it back); unset
        optional blocks are left out, so runs without them keep their identity."""
        return drop_unset(to_dict(self))

    def identity(self) -> dict[str, Any]:
        """What a resumed run must match: the spec without what does not change results
        (device, logging, progress)."""
        d = self.to_dict()
        for k in ("device", "logging", "name"):
            d.pop(k, None)
        return d


def _block_names(block: str) -> list[str]:
    from partialfl.registry import with_trait

    return list(with_trait("wrapper", "block", block))


_OPTIONAL_KEYS = ("stop", "validation", "finetune_grid", "problem", "aggregation", "attack",
                  "privacy", "faults", "asynchronous", "split", "finetune_split",
                  "pretrain_seed", "partition", "model", "data")


def drop_unset(d: dict) -> dict:
    """``d`` without the optional keys that are None (recursively)."""
    return {k: (drop_unset(v) if isinstance(v, dict) else v) for k, v in d.items()
            if not (k in _OPTIONAL_KEYS and v is None)}


def load_spec(data: Mapping[str, Any], where: str = "") -> RunSpec:
    """A validated :class:`RunSpec` from a (TOML) mapping."""
    return from_dict(RunSpec, data, where)


__all__ = ["AsyncSpec", "DataSpec", "FinetuneConfig", "FinetuneGrid", "LoggingSpec",
           "MethodConfig", "ModelSpec", "RunSpec", "STAGES", "ServerConfig", "StageConfig",
           "StopConfig", "ValidationConfig", "drop_unset", "load_spec", "parse_lr"]
