"""An aggregation rule with its wrappers: :func:`compose`. Every rule is a registry entry of
kind ``aggregator`` (registered in its module with :func:`register_rule`) whose options are
the wrappers' (:class:`AggregatorOptions`) plus the rule's own; by name:
:func:`partialfl.build.make_aggregator`, or ``[aggregation] name = "krum"`` in a run spec.

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

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar

import numpy as np

from partialfl.aggregation.common import check_delta
from partialfl.aggregation.wrappers import ARC, Bucketing, NearestNeighborMixing, StaticClipping
from partialfl.registry import option, register

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


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class AggregatorContext:
    """What an aggregator entry is built with: the seed of randomized wrappers (bucketing)."""

    seed: int = 0


@dataclass(frozen=True)
class AggregatorOptions:
    """The options every aggregation rule takes: the Byzantine fraction and the wrappers
    (see the module docstring). A rule's own options extend these."""

    #: the rule class and the keyword defaults its entry gives it (set by :func:`register_rule`)
    rule: ClassVar[type | None] = None
    defaults: ClassVar[dict[str, Any]] = {}

    delta: float | None = option(None, "fraction of Byzantine clients (None: the rule's own "
                                 "default; rules without δ ignore it)")
    bucketing: int = option(1, "bucket size s (>= 2: aggregate bucket means; 1: none)")
    nnm: bool = option(False, "nearest-neighbour mixing before the rule")
    arc: bool = option(False, "adaptive robust clipping of the inputs")
    clip: float | None = option(None, "static clipping of each input to this norm")
    allow_unprotected: bool = option(False, "warn instead of refusing a cohort the rule "
                                     "cannot protect (⌊δk⌋ = 0 or k below its bound)")

    def own(self) -> dict[str, Any]:
        """The rule's own options (not the wrappers')."""
        base = {f.name for f in dataclasses.fields(AggregatorOptions)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in base}

    def build(self, name: str, seed: int = 0):
        """The rule with its wrappers (:func:`compose`)."""
        wrappers = {f.name: getattr(self, f.name)
                    for f in dataclasses.fields(AggregatorOptions)}
        if wrappers["delta"] is None:
            wrappers.pop("delta")
        own = self.own()
        return compose(name, type(self).rule, tuple(own), dict(type(self).defaults),
                       seed=seed, **wrappers, **own)

    def __post_init__(self) -> None:
        if type(self).rule is not None:
            self.build("aggregator")  # validates every option now, naming the bad one


def register_rule(name: str, rule: type, options: type = AggregatorOptions, *,
                  aliases: tuple[str, ...] = (), doc: str | None = None,
                  **defaults: Any) -> Callable[[AggregatorOptions, Any], Any]:
    """Register aggregation rule ``rule`` as ``name``: its options class (a subclass of
    :class:`AggregatorOptions` adding the rule's own options) is specialised to the rule."""
    opts = type(f"{rule.__name__}{name.title().replace('-', '')}Options", (options,),
                {"rule": rule, "defaults": dict(defaults), "__doc__": options.__doc__,
                 "__module__": rule.__module__, "__annotations__": {}})
    opts = dataclass(frozen=True)(opts)

    def build(o: AggregatorOptions, ctx: AggregatorContext | None = None):
        return o.build(name, 0 if ctx is None else ctx.seed)

    build.__doc__ = doc or rule.__doc__
    build.__module__ = rule.__module__
    register("aggregator", name, options=opts, aliases=aliases, robust=name != "mean")(build)
    return build
