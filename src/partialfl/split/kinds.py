"""Which parameters of a model are global (θ, shared, trained by the server) and which are
personal (w_m, private to client m, never sent anywhere).

A :class:`Split` partitions the parameter names of one torch ``nn.Module`` into two disjoint
sets that together cover every parameter. Kinds (:func:`make_split`):

* ``none`` — every parameter global (non-personalized training, e.g. FedAvg pre-training).
* ``input`` — the first ``layers`` layer(s) personal (a *layer* is a module that owns
  parameters directly; a normalization layer right after a chosen layer goes with it). A
  model that declares ``INPUT_LAYERS`` / ``OUTPUT_LAYERS`` (module names, as the models in
  :mod:`partialfl.models` do) gets those for ``layers=1``.
* ``output`` — the last ``layers`` layer(s) personal (e.g. the classification head).
* ``adapter`` — small residual adapters are inserted after every adapted module and are
  personal; the base model stays global. For a module with output z:
  ``Linear``:  z ↦ z + U(V z),  V ∈ R^{r×d} (default init), U ∈ R^{d×r} zero-initialised
  (rank r);  ``Conv2d`` / ``Conv1d``:  z ↦ z + A * z with A a 1×1 convolution,
  zero-initialised.
  Zero-initialised outputs make the adapted model compute exactly the base model at start.
* ``norm`` — the parameters of normalization layers (GroupNorm, LayerNorm, BatchNorm, …).
  BatchNorm running statistics are buffers, not parameters: under every split they are
  personal client state (:class:`partialfl.problems.model.ModelProblem`).
* ``pattern`` — regular expressions on parameter names (``re.search``): ``personal`` (and
  optionally ``global_``); with both, every name must match exactly one side.

``input``, ``output`` and ``adapter`` also take ``modules``: explicit module-name regexes
(``re.fullmatch``) that replace the automatic choice — e.g. ``modules=[r"blocks\\.0"]`` for
"the first transformer block is personal", or ``modules=[r"blocks\\.\\d+\\.mlp\\.fc2"]`` for
adapters in every block.

Every split is validated: each parameter is on exactly one side, otherwise a
:class:`SplitError` names the parameters that match no side or both. ``split.counts()`` and
:func:`split_report` give the number of global and personal parameters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialfl import registry
from partialfl.registry import option, register
from partialfl.rng import torch_seed
from partialfl.split.adapters import insert_adapters
from partialfl.split.base import (
    ADAPTER_CHILD,
    NORM_TYPES,
    Split,
    SplitError,
    _abbrev,
    _compile,
    _from_personal,
    _layer_groups,
    _match_modules,
    _params_of_modules,
    validate_partition,
)


# ----------------------------------------------------------------------------- factory
def make_split(
    model: nn.Module,
    kind: str,
    *,
    layers: int = 1,
    modules: Sequence[str] | None = None,
    rank: int = 8,
    personal: Sequence[str] | None = None,
    global_: Sequence[str] | None = None,
    example_input: Tensor | tuple | None = None,
    allow_empty: bool = False,
    seed: int | None = None,
) -> Split:
    """Build and validate a split of ``model``'s parameters (see the module docstring).

    Args:
        model: any ``nn.Module``; only ``adapter`` copies it (the original is untouched).
        kind: a registered split (``none``, ``input``, ``output``, ``adapter``, ``norm``,
            ``pattern``).
        layers: number of layers made personal by ``input`` / ``output``.
        modules: module-name regexes (full match) replacing the automatic choice of
            ``input`` / ``output`` layers, or of the modules that get adapters.
        rank: rank of the low-rank adapters of ``Linear`` modules (capped at their width).
        personal, global_: parameter-name regexes (``re.search``) for ``pattern``.
        example_input: an input batch; if given, ``input``/``output`` follow the order in
            which layers run in ``forward`` instead of their registration order.
        allow_empty: accept a split with no personal (or no global) parameter.
        seed: seeds the initialisation of inserted adapters (from
            ``partialfl.rng.torch_seed(seed, "adapters")``, the global torch RNG untouched);
            None draws it from the global torch RNG.
    """
    if kind not in registry.names("split"):
        raise SplitError(f"unknown split kind {kind!r}; allowed: "
                         f"{', '.join(registry.names('split'))}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_split needs a torch nn.Module, got {type(model).__name__}")
    if kind != "pattern" and (personal is not None or global_ is not None):
        raise SplitError(f"personal=/global_= patterns only apply to kind 'pattern', not {kind!r}")
    if kind == "none":
        return _from_personal(model, kind, set(), allow_empty)
    if kind in ("input", "output"):
        declared = getattr(model, "INPUT_LAYERS" if kind == "input" else "OUTPUT_LAYERS", ())
        if modules is not None:
            chosen = _match_modules(model, modules, kind)
        elif declared and layers == 1 and example_input is None:
            # the model names its own input/output layer modules (partialfl.models)
            chosen = _match_modules(model, [re.escape(m) for m in declared], kind)
        else:
            if not isinstance(layers, int) or layers < 1:
                raise SplitError(f"layers must be a positive integer, got {layers!r}")
            groups = _layer_groups(model, example_input)
            if layers >= len(groups) and not allow_empty:
                raise SplitError(f"split {kind!r} with layers={layers} would make all "
                                 f"{len(groups)} layers personal")
            sel = groups[:layers] if kind == "input" else groups[-layers:]
            chosen = [m for g in sel for m in g]
        return _from_personal(model, kind, _params_of_modules(model, chosen), allow_empty)
    if kind == "adapter":
        if seed is None:
            adapted, targets = insert_adapters(model, modules, rank)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(torch_seed(seed, "adapters"))
                adapted, targets = insert_adapters(model, modules, rank)
        pers = _params_of_modules(adapted, [f"{t}.{ADAPTER_CHILD}" if t else ADAPTER_CHILD
                                            for t in targets])
        return _from_personal(adapted, kind, pers, allow_empty)
    if kind == "norm":
        norms = [n for n, m in model.named_modules() if isinstance(m, NORM_TYPES)]
        pers = _params_of_modules(model, norms)
        return _from_personal(model, kind, pers, allow_empty,
                              why_empty="it has no normalization layer with parameters")
    # pattern
    if not personal:
        raise SplitError("split 'pattern' needs personal=[regex, ...] (and optionally "
                         "global_=[regex, ...])")
    pp = [_compile(p, "personal") for p in personal]
    names = [n for n, _ in model.named_parameters()]
    pers = [n for n in names if any(p.search(n) for p in pp)]
    dead = [p.pattern for p in pp if not any(p.search(n) for n in names)]
    if dead:
        raise SplitError(f"personal pattern(s) {dead} match no parameter; parameters are e.g. "
                         f"{names[:10]}")
    if global_ is None:
        return _from_personal(model, kind, set(pers), allow_empty)
    gp = [_compile(p, "global_") for p in global_]
    glob = [n for n in names if any(p.search(n) for p in gp)]
    validate_partition(names, glob, pers)
    return Split(model, kind, tuple(glob), tuple(pers))


def split_report(model: nn.Module, kinds: Sequence[str] | None = None,
                 options: Mapping[str, Mapping] | None = None) -> str:
    """A markdown table of #global / #personal parameters for each split kind of ``model``
    (kinds that do not apply to the model are listed with the reason)."""
    kinds = kinds or [k for k in registry.names("split") if k != "pattern"]
    options = options or {}
    rows = ["| split | global params | personal params | personal % | personal tensors |",
            "| --- | ---: | ---: | ---: | --- |"]
    for k in kinds:
        try:
            s = make_split(model, k, **dict(options.get(k, {})))
        except SplitError as e:
            rows.append(f"| {k} | – | – | – | n/a: {e} |")
            continue
        c = s.counts()
        tot = c["global_params"] + c["personal_params"]
        rows.append(f"| {k} | {c['global_params']:,} | {c['personal_params']:,} | "
                    f"{100 * c['personal_params'] / max(tot, 1):.2f} | "
                    f"{_abbrev(s.personal_names, 4)} |")
    return "\n".join(rows)



# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class SplitContext:
    """What a split entry is built with: the model, an example input batch (layers then
    follow their order in ``forward``) and the adapters' seed (None: the global torch RNG).
    A model with its own splits (a method ``partialfl_split(kind, options)``, e.g. the
    transformer's bottleneck adapters) builds them itself."""

    model: Any
    example_input: Any = None
    seed: int | None = None


def _build(kind: str, opts: Any, ctx: SplitContext) -> Split:
    own = getattr(ctx.model, "partialfl_split", None)
    if own is not None:
        return own(kind, opts)
    kw = {} if opts is None else {f: getattr(opts, f) for f in opts.__dataclass_fields__}
    kw = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()}
    kw.pop("adapter_dim", None)
    return make_split(ctx.model, kind, example_input=ctx.example_input, seed=ctx.seed, **kw)


@register("split", "none")
def _none(opts: None, ctx: SplitContext) -> Split:
    """Every parameter global (non-personalized training)."""
    return _build("none", opts, ctx)


@dataclass(frozen=True)
class LayerOptions:
    """Which layers: the first / last ``layers``, or explicit module-name regexes."""

    layers: int = option(1, "number of layers made personal")
    modules: tuple[str, ...] | None = option(None, "module-name regexes (full match) instead "
                                             "of the automatic choice")


@register("split", "input", options=LayerOptions, advise=True)
def _input(opts: LayerOptions, ctx: SplitContext) -> Split:
    """The first ``layers`` layer(s) personal."""
    return _build("input", opts, ctx)


@register("split", "output", options=LayerOptions, advise=True)
def _output(opts: LayerOptions, ctx: SplitContext) -> Split:
    """The last ``layers`` layer(s) personal (e.g. the classification head)."""
    return _build("output", opts, ctx)


@dataclass(frozen=True)
class AdapterOptions:
    """The inserted adapters."""

    rank: int = option(8, "rank of the low-rank adapters of Linear modules")
    modules: tuple[str, ...] | None = option(None, "module-name regexes of the adapted "
                                             "modules (None: every Linear/Conv)")
    adapter_dim: int | None = option(None, "models with their own bottleneck adapters "
                                     "(transformer): the bottleneck (None: d_model/16)")


@register("split", "adapter", options=AdapterOptions, adds_parameters=True, advise=True)
def _adapter(opts: AdapterOptions, ctx: SplitContext) -> Split:
    """Zero-initialised residual adapters inserted and personal; the base model global."""
    return _build("adapter", opts, ctx)


@register("split", "norm", advise=True)
def _norm(opts: None, ctx: SplitContext) -> Split:
    """The normalization layers' parameters personal."""
    return _build("norm", opts, ctx)


@dataclass(frozen=True)
class PatternOptions:
    """Regular expressions on parameter names (``re.search``)."""

    personal: tuple[str, ...] = option((), "names matching any of these are personal")
    global_: tuple[str, ...] | None = option(None, "names matching these are global (with "
                                             "both, every name must match exactly one side)")


@register("split", "pattern", options=PatternOptions)
def _pattern(opts: PatternOptions, ctx: SplitContext) -> Split:
    """Personal parameters named by regular expressions."""
    return _build("pattern", opts, ctx)


def build_split(model, kind: str, options: Mapping[str, Any] | None = None, *,
                example_input=None) -> Split:
    """The registered split ``kind`` of ``model`` with ``options`` (its entry's options)."""
    from partialfl.registry import component

    c = component("split", {"name": kind, **dict(options or {})}, "method.split")
    return c.build(SplitContext(model, example_input))
