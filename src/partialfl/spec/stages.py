"""The stages of a run: budgets on validation data, the server optimizer, a federated
stage, stage-3 fine-tuning."""


from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from partialfl.config import ConfigError, check_choice
from partialfl.registry import Component, component, option
from partialfl.spec.base import _Spec, comp


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
        if not isinstance(self.rounds, int) or not 0 <= self.rounds < 2 ** 63:  # built in code
            raise ConfigError(f"rounds must be a non-negative integer below 2^63, got "
                              f"{self.rounds!r}")
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
        self.sgd()  # validated by the registry's SGD entry

    def sgd(self, **over):
        """The :class:`~partialfl.local.sgd.SGDConfig` of these settings (with ``over``; the
        registry's ``sgd`` entry, so the spec imports no trainer)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return component("local", {"name": "sgd", **fields, **over}, "finetune").options


