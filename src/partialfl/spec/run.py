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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partialfl.config import ConfigError, check_choice, from_dict, to_dict
from partialfl.registry import Component, component, entry, option
from partialfl.spec.base import (
    DEVICE_PATTERN,
    DEVICES,
    MEMORY_FORMATS,
    NAME_PATTERN,
    PRECISIONS,
    STAGES,
    _Spec,
    comp,
)
from partialfl.spec.data import AsyncSpec, DataSpec, LoggingSpec, ModelSpec
from partialfl.spec.method import MethodConfig
from partialfl.spec.stages import (
    FinetuneConfig,
    FinetuneGrid,
    StageConfig,
    ValidationConfig,
)

#: the most torch/BLAS threads a run may ask for (more overflows the C int of the pools)
MAX_THREADS = 1024


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
    memory_format: str = option("contiguous", "contiguous or channels_last (conv models: "
                                "one client's steps run channels-last, faster on CPU)")
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
    attack: Component | None = comp("wrapper", "byzantine", "Byzantine clients (Algorithm 5): "
                                    "{fraction, attack = {name = …}}", optional=True)
    privacy: Component | None = comp("wrapper", "dp", "client-level differential privacy of "
                                     "θ: {clip_norm, noise_multiplier or target_epsilon, …}",
                                     optional=True)
    faults: Component | None = comp("wrapper", "faults", "fault injection (testing): {rate, "
                                    "kinds}", optional=True)
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
        for key in ("seed", "pretrain_seed"):  # numpy seeds are integers >= 0
            v = getattr(self, key)
            if v is not None and not (isinstance(v, int) and v >= 0):
                raise ConfigError(f"{key} must be an integer >= 0, got {v!r}")
        if not (isinstance(self.threads, int) and 1 <= self.threads <= MAX_THREADS):
            raise ConfigError(f"threads must be an integer in [1, {MAX_THREADS}], got "
                              f"{self.threads!r}")
        for key, used in (("pretrain.stop", self.pretrain.stop),
                          ("personalize.stop", self.personalize.stop),
                          ("finetune_grid", self.finetune_grid)):
            if used is not None and self.validation is None:
                raise ConfigError(f"{key} reads validation data: set validation (e.g. "
                                  "validation = {fraction = 0.1, min_examples = 2})")
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("memory_format", self.memory_format, MEMORY_FORMATS)
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
        if self.privacy is not None and self.asynchronous is not None:
            raise ConfigError("privacy: DP adds noise to one sum per synchronous round; it "
                              "cannot run with [asynchronous] (remove one of them)")
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

    def shown(self) -> dict[str, Any]:
        """:meth:`to_dict` without the keys this run never reads (a closed form has one stage
        and no model: no pretrain/finetune stages, device, precision, loss or metric): what a
        summary prints as the configuration run."""
        d = self.to_dict()
        if self.closed_form:
            for k in ("stages", "pretrain_seed", "device", "precision", "pretrain", "finetune",
                      "validation", "finetune_grid", "loss", "metric"):
                d.pop(k, None)
        return d

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


__all__ = ["RunSpec", "drop_unset", "load_spec"]
