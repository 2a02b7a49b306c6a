"""The run specification: every run partialfl makes, as ONE frozen dataclass read from TOML
(:mod:`~partialfl.spec.run`; its tables in :mod:`~partialfl.spec.stages`,
:mod:`~partialfl.spec.method`, :mod:`~partialfl.spec.data`).

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

from partialfl.spec.base import (
    DEVICE_PATTERN,
    DEVICES,
    MEMORY_FORMATS,
    NAME_PATTERN,
    PRECISIONS,
    STAGES,
    W_INITS,
    WEIGHTINGS,
    comp,
)
from partialfl.spec.data import AsyncSpec, DataSpec, LoggingSpec, ModelSpec
from partialfl.spec.method import MethodConfig
from partialfl.spec.run import RunSpec, drop_unset, load_spec
from partialfl.spec.stages import (
    FinetuneConfig,
    FinetuneGrid,
    ServerConfig,
    StageConfig,
    StopConfig,
    ValidationConfig,
    parse_lr,
)

__all__ = ["DEVICES", "DEVICE_PATTERN", "MEMORY_FORMATS", "NAME_PATTERN", "PRECISIONS", "STAGES",
           "W_INITS", "WEIGHTINGS", "AsyncSpec", "DataSpec", "FinetuneConfig", "FinetuneGrid",
           "LoggingSpec", "MethodConfig", "ModelSpec", "RunSpec", "ServerConfig", "StageConfig",
           "StopConfig", "ValidationConfig", "comp", "drop_unset", "load_spec", "parse_lr"]
