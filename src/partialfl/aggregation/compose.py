"""An aggregation rule with its wrappers: :func:`compose` (by name:
:func:`partialfl.build.make_aggregator`; the names are in :data:`partialfl.build.REGISTRY`).

``delta`` is always the fraction of Byzantine *clients*. Every wrapper derives its own δ from
it (or, when no ``delta`` is given, from the rule's own default δ), so no wrapper silently
runs with δ = 0:

* the rule inside bucketing of size s sees s·δ of Byzantine bucket means (refused when
  s·δ ≥ 1/2: the rule could then be outvoted — choose a smaller s or δ);
* nearest-neighbour mixing uses the δ of the inputs it mixes and refuses δ = 0 (for cm, gm,
  cc, which have no δ, pass ``delta``);
* ARC clips with the client-level δ.

Order of application: static clipping / ARC on the raw inputs, then bucketing, then NNM, then
the rule.

``allow_unprotected=True`` goes to the rule and to NNM / ARC: they then warn (once) instead of
refusing a call where they tolerate no Byzantine input (:mod:`~partialfl.aggregation.protection`).
"""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any

import numpy as np

from partialfl.aggregation.common import check_delta
from partialfl.aggregation.wrappers import ARC, Bucketing, NearestNeighborMixing, StaticClipping

#: keyword arguments of compose that build wrappers (see the module docstring)
PRE_AGGREGATORS = ("bucketing", "nnm", "arc", "clip")
_WRAPPER_KW = (*PRE_AGGREGATORS, "seed", "allow_unprotected")


def default_delta(cls: type) -> float | None:
    """The rule's own default Byzantine fraction, or None when it has no δ."""
    f = getattr(cls, "__dataclass_fields__", {}).get("delta")
    return None if f is None or f.default is MISSING else f.default


def compose(key: str, cls: type, allowed: tuple[str, ...] = (),
            defaults: dict[str, Any] | None = None, **kw: Any):
    """Rule ``cls`` (named ``key`` in messages) with its wrappers, e.g. ``compose("krum", Krum,
    ("cap",), delta=0.2, bucketing=2)``. ``allowed``: the rule's keyword options besides
    ``delta``; ``defaults``: option values it gets unless given. Wrappers: ``bucketing=s``
    (s ≥ 2; 1 = none), ``nnm=True`` (nearest-neighbour mixing), ``arc=True`` (adaptive
    robust clipping), ``clip=c`` (static clipping to norm c), ``seed`` (bucketing randomness).
    ``delta``: the fraction of Byzantine clients (default: the rule's own default δ);
    ``allow_unprotected``: see the module docstring.
    """
    has_delta = default_delta(cls) is not None
    delta = kw.pop("delta", None)
    s = kw.pop("bucketing", 1)
    nnm = kw.pop("nnm", False)
    arc = kw.pop("arc", False)
    clip = kw.pop("clip", None)
    seed = kw.pop("seed", 0)
    loose = kw.pop("allow_unprotected", False)
    bad = sorted(set(kw) - set(allowed))
    if bad:
        raise ValueError(
            f"aggregator {key!r} got unknown option(s) {', '.join(bad)}; allowed: "
            f"{', '.join(sorted({*allowed, 'delta', *_WRAPPER_KW}))}"
        )
    if isinstance(s, bool) or not (isinstance(s, int | np.integer) and s >= 1):
        raise ValueError(f"bucketing size must be an integer >= 1, got {s!r}")
    for flag, value in (("nnm", nnm), ("arc", arc), ("allow_unprotected", loose)):
        if not isinstance(value, bool):
            raise ValueError(f"aggregator option {flag!r} must be True or False, got {value!r}")
    if delta is not None:
        check_delta(delta, f"aggregator {key!r}")
    elif has_delta:
        delta = default_delta(cls)
    inner = None if delta is None else s * delta
    if inner is not None and s > 1 and inner >= 0.5:
        raise ValueError(
            f"aggregator {key!r}: with bucketing s = {s} and delta = {delta:g}, up to "
            f"s·delta = {inner:g} of the bucket means may be Byzantine (must be < 0.5); use "
            f"s < {0.5 / delta:g} or a smaller delta"
        )
    if has_delta:
        kw["delta"] = inner
    for k, v in (defaults or {}).items():
        kw.setdefault(k, v)
    if "allow_unprotected" in getattr(cls, "__dataclass_fields__", {}):
        kw["allow_unprotected"] = loose
    agg = cls(**kw)
    if nnm:
        if not inner:
            raise ValueError(
                f"aggregator {key!r} with nnm=True: nearest-neighbour mixing needs the "
                f"Byzantine fraction delta > 0 (got {delta!r}; {key!r} has no δ of its own)"
            )
        agg = NearestNeighborMixing(agg, delta=inner, allow_unprotected=loose)
    if s > 1:
        agg = Bucketing(agg, s=int(s), seed=int(seed))
    if arc:
        if delta is None:
            raise ValueError(f"aggregator {key!r} with arc=True: ARC needs the Byzantine "
                             "fraction delta")
        agg = ARC(agg, delta=delta, allow_unprotected=loose)
    if clip is not None:
        agg = StaticClipping(agg, c=clip)
    return agg
