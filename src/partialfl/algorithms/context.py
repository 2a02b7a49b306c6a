"""What an algorithm's registry entry is built from (``build(options, ctx)`` of kind
``algorithm``): the run's choices that are not the algorithm's own options.

The same context serves closed-form problems and model problems: the client optimizer is the
stage's ``local`` component (SGD epochs on a model; GD steps, CG or an exact solve on a closed
form), so one entry builds one algorithm for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partialfl.config import ConfigError


@dataclass(frozen=True)
class AlgorithmContext:
    """``local``: the stage's local component (``trainer(**over)``: the client optimizer,
    ``finetuner(w_init)``: FFGG's fine-tuner); ``server_opt``, ``aggregator`` (None: the
    mean), ``weighting`` (uniform or examples), ``w_init`` (where personal parameters
    start), ``name`` (the algorithm's registered name, for messages)."""

    local: Any
    server_opt: Any = None
    aggregator: Any = None
    weighting: str = "uniform"
    w_init: str = "pretrained"
    name: str = "algorithm"

    def trainer(self, **over: Any) -> Any:
        """The client optimizer (a :class:`~partialfl.local.base.LocalTrainer`), with some
        settings replaced (``steps=K``, ``epochs=1``)."""
        make = getattr(self.local, "trainer", None)
        if make is None:
            raise ConfigError(f"{self.name} trains on the clients and needs a client optimizer "
                              f"(client = sgd or gd); the stage's client is a fine-tuning "
                              f"solver only")
        return make(**over)

    def warmup(self) -> Any:
        """One pass of w fine-tuning (Local FFGG's start): one SGD epoch, or the GD steps."""
        return self.trainer(epochs=1, steps=None)

    def finetuner(self) -> Any:
        """FFGG's fine-tuner: the local component's solver from ``w_init``."""
        return self.local.finetuner(self.w_init)

    def common(self) -> dict[str, Any]:
        """The keyword arguments every algorithm class takes: server optimizer, aggregator,
        weighting."""
        return {"server_opt": self.server_opt, "aggregator": self.aggregator,
                "weighting": self.weighting}


@dataclass(frozen=True)
class WrapperContext:
    """What a wrapper's entry (kind ``wrapper``) is built from: the algorithm it wraps, the
    run's seed, the number of clients and the cohort size (None: all), the aggregation rule
    the run configured (None: the mean) and the stage's rounds."""

    base: Any
    seed: int = 0
    num_clients: int | None = None
    clients_per_round: int | None = None
    aggregator: Any = None
    rounds: int | None = None
