"""How many Byzantine inputs a rule tolerates among the k it is given, and refusing the settings
where a robust rule would silently tolerate none.

A rule built with a Byzantine fraction δ tolerates f = ⌊δk⌋ of k inputs (:func:`count`). Below
k = ⌈1/δ⌉ inputs that is f = 0: the rule then averages whatever it is sent, and one client
sending 1e30 moves the result to ~1e29. Each rule also has its own bound on k (k ≥ 2f + 1 for
most; Krum k ≥ 2f + 3), stated in its docstring. :func:`check` refuses both with an
:class:`UnprotectedError` naming the rule, k, δ, f and what is allowed, unless the rule was
built with ``allow_unprotected=True``: then it warns once per (rule, k, δ) and runs.

Every rule with a δ checks itself when called; :func:`tolerated` asks a rule (or a chain of
wrappers) how many Byzantine *clients* it tolerates among k without running it, so a server can
refuse a cohort before it aggregates. :func:`check_fraction` compares a configured Byzantine
fraction with the aggregator's δ.

Inside :func:`cohort_checked` (f) every rule tolerates at least f Byzantine inputs, whatever
⌊δk⌋ is: a server that planned a cohort the rule protects (f = its tolerance there) and then
lost d clients (failed, or non-finite rows dropped) hands the rule k − d inputs, possibly fewer
than ⌈1/δ⌉. Keeping f protects those inputs whichever clients were lost (honest or Byzantine);
where the rule's own bound (k ≥ 2f + 1, Krum k ≥ 2f + 3) no longer holds it is refused, and the
server skips the step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from contextvars import ContextVar

from partialfl.aggregation.common import count, inner_delta

_CHECKED: ContextVar[int | None] = ContextVar("partialfl_cohort_checked", default=None)
_WARNED: set[tuple] = set()


class UnprotectedError(ValueError):
    """A robust rule would tolerate fewer Byzantine inputs than it was configured for."""


class UnprotectedWarning(UserWarning):
    """The same, run anyway because the rule was built with ``allow_unprotected=True``."""


@contextlib.contextmanager
def cohort_checked(f: int):
    """Rules with δ > 0 called inside tolerate at least ``f`` Byzantine inputs (the planned
    cohort's f; see the module docstring)."""
    token = _CHECKED.set(int(f))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def min_inputs(delta: float) -> int | float:
    """The smallest k with ⌊δk⌋ ≥ 1 (δ > 0; ∞ when 1/δ is beyond any cohort, δ < 1e-15)."""
    if delta < 1e-15:
        return math.inf
    k = max(1, math.floor(1.0 / delta) - 1)
    while count(delta, k) < 1:
        k += 1
    return k


def check(name: str, delta: float, k: int, allow_unprotected: bool, extra: int = 1) -> int:
    """f = ⌊δk⌋ (at least the planned f inside :func:`cohort_checked`) after checking that the
    rule ``name`` protects anything at k: refuses δ > 0 with f = 0, and k < 2f + ``extra``
    (the rule's own bound), with an
    :class:`UnprotectedError` (a warning, once, when ``allow_unprotected``)."""
    f = count(delta, k)
    planned = _CHECKED.get()
    if planned is not None and delta > 0:
        f = max(f, planned)
    if delta > 0 and f == 0:
        problem = (f"{name}: with delta = {delta:g} and k = {k} inputs, f = ⌊δk⌋ = 0: the rule "
                   f"tolerates no Byzantine input (one huge input passes through); it needs "
                   f"k ≥ {min_inputs(delta)} inputs for delta = {delta:g}")
    elif k < 2 * f + extra:
        problem = (f"{name}: f = ⌊δk⌋ = {f} Byzantine inputs among k = {k} (delta = "
                   f"{delta:g}) needs k ≥ 2f + {extra} = {2 * f + extra}")
    else:
        return f
    if not allow_unprotected:
        raise UnprotectedError(f"{problem}; use more clients per round or another delta, or "
                               "pass allow_unprotected=True to run unprotected with a warning")
    warn_once(f"{problem}; running unprotected (allow_unprotected=True)", (name, k, delta))
    return f


def majority(name: str, k: int) -> int:
    """⌊(k − 1)/2⌋, the Byzantine inputs a median-type rule tolerates among k; refused inside
    :func:`cohort_checked` when that is below the planned f."""
    f = (k - 1) // 2
    planned = _CHECKED.get()
    if planned is not None and planned > f:
        raise UnprotectedError(f"{name}: k = {k} inputs tolerate ⌊(k − 1)/2⌋ = {f} Byzantine "
                               f"inputs, fewer than the planned f = {planned}")
    return f


def warn_once(message: str, key: tuple) -> None:
    """An :class:`UnprotectedWarning`, once per ``key`` (e.g. (rule, k, δ)) in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UnprotectedWarning, stacklevel=4)


def check_flag(value, name: str) -> None:
    """A ValueError naming ``name`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def tolerated(agg, k: int) -> int | None:
    """How many Byzantine clients ``agg`` tolerates among k (checked as when it is called:
    refused where unprotected): ⌊δk⌋ for a rule with δ, the majority bound ⌊(k − 1)/2⌋ for
    CM, GM and centered clipping, None for the mean or a plain callable."""
    fn = getattr(agg, "tolerated", None)
    return None if fn is None else fn(k)


def check_fraction(agg, fraction: float, allow_unprotected: bool) -> None:
    """Refuse a configured fraction of Byzantine clients above the aggregator's δ (the
    fraction of Byzantine clients it was built to tolerate); rules without δ are not checked."""
    delta = inner_delta(agg)
    if delta is None or fraction <= delta + 1e-12:
        return
    problem = (f"{getattr(agg, 'name', type(agg).__name__)}: the Byzantine fraction of the run "
               f"({fraction:g}) exceeds the aggregator's delta = {delta:g}, the fraction it "
               "tolerates")
    if not allow_unprotected:
        raise UnprotectedError(f"{problem}; build the aggregator with delta ≥ {fraction:g} "
                               "(below 0.5), or pass allow_unprotected=True")
    warn_once(f"{problem}; running unprotected (allow_unprotected=True)",
              ("fraction", fraction, delta))
