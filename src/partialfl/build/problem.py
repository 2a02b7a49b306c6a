"""The closed-form problem of a run (``[problem]``), cached."""


from __future__ import annotations

from partialfl.config import ConfigError
from partialfl.registry import Component
from partialfl.spec import RunSpec

# ----------------------------------------------------------------------------- closed form
_CACHE: dict = {}


def build_problem(problem: Component, shared_w: bool = False, progress: bool = False):
    """The closed-form problem of a ``[problem]`` component (the two most recent are cached:
    building least squares reads n×d data; ``progress`` shows a bar over its clients);
    ``shared_w``: the algorithm shares w, so least squares uses its standard basis."""
    from partialfl.problems.base import ProblemContext

    key = (problem, bool(shared_w))
    if key not in _CACHE:
        try:
            built = problem.build(ProblemContext(progress, shared_w))
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"problem: {e}") from e
        while len(_CACHE) >= 2:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = built
    return _CACHE[key]


def problem_of(spec: RunSpec, progress: bool = False):
    """The closed-form problem of ``spec`` as its algorithm needs it."""
    return build_problem(spec.problem, bool(spec.method.entry.trait("shared_w")), progress)


def executor_of(spec: RunSpec):
    """The run's one :class:`~partialfl.batching.Executor`, chosen once: the spec's
    ``backend`` (built once) on its ``device`` (a closed form computes on the CPU). The
    problem is built on ``executor.device`` and every loop of the run takes the executor."""
    from partialfl.batching import Executor

    device = "cpu"
    if not spec.closed_form:
        from partialfl.devices import resolve_device

        try:
            device = str(resolve_device(spec.device))
        except ValueError as err:
            raise ConfigError(f"device: {err}") from None
    return Executor(spec.backend.build(), device)
