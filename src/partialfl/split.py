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

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialfl import registry
from partialfl.registry import option, register
from partialfl.rng import torch_seed
from partialfl.types import Params

#: module types whose parameters count as normalization parameters
NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t for t in (
        nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),
    ) if t is not None
)

#: name of the child module that holds an inserted adapter
ADAPTER_CHILD = "adapter"


class SplitError(ValueError):
    """A split that does not put every parameter on exactly one side, or a bad split option."""


# ----------------------------------------------------------------------------- the split
@dataclass(frozen=True, eq=False)
class Split:
    """A model and the partition of its parameter names into global θ and personal w.

    Attributes:
        model: the module to evaluate (for ``adapter``, a copy of the user's model with the
            adapters inserted; otherwise the user's model itself).
        kind: the split kind (one of :data:`SPLIT_KINDS`).
        global_names: names of the global parameters θ, in ``named_parameters`` order.
        personal_names: names of the personal parameters w, in ``named_parameters`` order.
    """

    model: nn.Module
    kind: str
    global_names: tuple[str, ...]
    personal_names: tuple[str, ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.model.named_parameters()]
        validate_partition(names, self.global_names, self.personal_names)

    # -- parameter trees ---------------------------------------------------------------
    def partition(self, params: Mapping[str, Tensor]) -> tuple[Params, Params]:
        """Split a full parameter dict into ``(θ, w)``; a clear error for missing names."""
        missing = [n for n in (*self.global_names, *self.personal_names) if n not in params]
        if missing:
            raise KeyError(f"parameters missing from the given dict: {missing[:8]}")
        return ({n: params[n] for n in self.global_names},
                {n: params[n] for n in self.personal_names})

    def params(self) -> tuple[Params, Params]:
        """The model's current ``(θ, w)`` as detached copies."""
        p = {n: v.detach().clone() for n, v in self.model.named_parameters()}
        return self.partition(p)

    # -- reporting -----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Numbers of global / personal scalars and tensors."""
        shapes = {n: p.numel() for n, p in self.model.named_parameters()}
        return {
            "global_params": sum(shapes[n] for n in self.global_names),
            "personal_params": sum(shapes[n] for n in self.personal_names),
            "global_tensors": len(self.global_names),
            "personal_tensors": len(self.personal_names),
        }

    def describe(self) -> str:
        """A one-line summary: the kind, the numbers of global and personal parameters, the share
        personal and the personal tensors' names."""
        c = self.counts()
        tot = c["global_params"] + c["personal_params"]
        return (f"split {self.kind!r}: {c['global_params']:,} global / "
                f"{c['personal_params']:,} personal parameters "
                f"({100 * c['personal_params'] / max(tot, 1):.2f}% personal); personal: "
                f"{_abbrev(self.personal_names)}")


def _abbrev(names: Sequence[str], k: int = 6) -> str:
    if not names:
        return "none"
    s = ", ".join(names[:k])
    return s + (f", … ({len(names)} tensors)" if len(names) > k else "")


def validate_partition(
    names: Iterable[str], global_names: Iterable[str], personal_names: Iterable[str]
) -> None:
    """Raise :class:`SplitError` unless every name in ``names`` is on exactly one side and
    both sides only name existing parameters."""
    names = list(names)
    g, p = list(global_names), list(personal_names)
    known = set(names)
    unknown = sorted({*g, *p} - known)
    if unknown:
        raise SplitError(f"the split names parameters the model does not have: {unknown[:8]}")
    for side, lst in (("global", g), ("personal", p)):
        if len(set(lst)) != len(lst):
            dup = sorted({n for n in lst if lst.count(n) > 1})
            raise SplitError(f"{side} side lists parameters twice: {dup[:8]}")
    gs, ps = set(g), set(p)
    both = [n for n in names if n in gs and n in ps]
    neither = [n for n in names if n not in gs and n not in ps]
    if both or neither:
        msg = []
        if neither:
            msg.append(f"{len(neither)} parameter(s) on neither side: {neither[:8]}")
        if both:
            msg.append(f"{len(both)} parameter(s) on both sides: {both[:8]}")
        raise SplitError("invalid split: every parameter must be either global or personal; "
                         + "; ".join(msg))


def _from_personal(model: nn.Module, kind: str, personal: set[str], allow_empty: bool,
                   why_empty: str = "") -> Split:
    names = [n for n, _ in model.named_parameters()]
    pers = tuple(n for n in names if n in personal)
    glob = tuple(n for n in names if n not in personal)
    if not allow_empty and kind != "none":
        if not pers:
            raise SplitError(f"split {kind!r} selects no personal parameter in this model"
                             + (f" ({why_empty})" if why_empty else "")
                             + "; pass allow_empty=True to accept that")
        if not glob:
            raise SplitError(f"split {kind!r} makes every parameter personal (nothing left to "
                             "train globally); pass allow_empty=True to accept that")
    return Split(model, kind, glob, pers)


# ----------------------------------------------------------------------------- layers
def _direct_params(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False)]


def parameterised_modules(
    model: nn.Module, example_input: Tensor | tuple | None = None
) -> list[str]:
    """Names of the modules that own parameters directly, in forward-execution order when
    ``example_input`` is given (recorded with hooks on a single forward pass), otherwise in
    registration order. Inserted adapters are excluded."""
    mods = {name: m for name, m in model.named_modules()
            if _direct_params(m) and ADAPTER_CHILD not in name.split(".")}
    if example_input is None:
        return list(mods)
    order: list[str] = []
    handles = []
    for name, m in mods.items():
        def hook(_m, _i, _o, name=name):
            if name not in order:
                order.append(name)
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            args = example_input if isinstance(example_input, tuple) else (example_input,)
            model(*args)
    finally:
        for h in handles:
            h.remove()
    # modules never called in forward (unused) keep their registration position at the end
    return order + [n for n in mods if n not in order]


def _layer_groups(model: nn.Module, example_input) -> list[list[str]]:
    """Layers as groups of module names: a non-norm layer followed by its norm layers."""
    names = parameterised_modules(model, example_input)
    mods = dict(model.named_modules())
    groups: list[list[str]] = []
    for n in names:
        if isinstance(mods[n], NORM_TYPES) and groups:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


def _params_of_modules(model: nn.Module, module_names: Iterable[str]) -> set[str]:
    """All parameter names under the given modules (recursively), as in named_parameters."""
    out = set()
    all_names = [n for n, _ in model.named_parameters()]
    for m in module_names:
        prefix = m + "." if m else ""
        out.update(n for n in all_names if n.startswith(prefix))
    return out


def _match_modules(model: nn.Module, patterns: Sequence[str], kind: str) -> list[str]:
    pats = [_compile(p, "modules") for p in patterns]
    names = [n for n, _ in model.named_modules() if n]
    hit = [n for n in names if any(p.fullmatch(n) for p in pats)]
    dead = [p.pattern for p in pats if not any(p.fullmatch(n) for n in names)]
    if dead:
        raise SplitError(
            f"split {kind!r}: module pattern(s) {dead} match no module; modules are e.g. "
            f"{names[:10]}"
        )
    return hit


def _compile(p: str, what: str) -> re.Pattern:
    try:
        return re.compile(p)
    except re.error as e:
        raise SplitError(f"invalid regular expression in {what}: {p!r} ({e})") from None


# ----------------------------------------------------------------------------- adapters
class LowRankAdapter(nn.Module):
    """u(z) = U(V z): rank-r residual adapter for features of size ``dim`` (last axis).

    V (``down``) gets PyTorch's default Linear initialisation, U (``up``, with bias) is
    zero-initialised, so the adapter's output is 0 at initialisation."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """V (``down``): PyTorch's default Linear initialisation; U (``up``): zero, so the output
        is 0 at start."""
        self.down.reset_parameters()
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, z: Tensor) -> Tensor:
        """u(z) = U V z + bias (the adapted module's hook adds z)."""
        return self.up(self.down(z))


class ConvAdapter(nn.Module):
    """u(z) = A * z: a 1×1 convolution over the channels of a ``[N, C, H, W]`` feature map
    (``dims=1``: ``[N, C, L]``), zero-initialised (weight and bias), so the adapter's output is
    0 at initialisation."""

    def __init__(self, channels: int, dims: int = 2) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dims]
        self.conv = conv(channels, channels, kernel_size=1, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero weight and bias: output 0 at start."""
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, z: Tensor) -> Tensor:
        """u(z) = A * z, the 1×1 convolution (the adapted module's hook adds z)."""
        return self.conv(z)


def _adapter_hook(module: nn.Module, inputs, output: Tensor) -> Tensor:
    """Forward hook of an adapted module: z ↦ z + adapter(z)."""
    return output + getattr(module, ADAPTER_CHILD)(output)


def _make_adapter(name: str, module: nn.Module, rank: int) -> nn.Module:
    if isinstance(module, nn.Linear):
        d = module.out_features
        return LowRankAdapter(d, max(1, min(rank, d)))
    if isinstance(module, nn.Conv2d | nn.Conv1d):
        return ConvAdapter(module.out_channels, 1 if isinstance(module, nn.Conv1d) else 2)
    raise SplitError(
        f"cannot insert an adapter after module {name!r} of type {type(module).__name__}; "
        "supported: Linear (low-rank), Conv1d / Conv2d (1x1 convolution)"
    )


def insert_adapters(
    model: nn.Module, modules: Sequence[str] | None = None, rank: int = 8
) -> tuple[nn.Module, list[str]]:
    """A deep copy of ``model`` with residual adapters after the chosen modules.

    ``modules`` are module-name regexes (``re.fullmatch``); by default every ``Linear`` and
    ``Conv2d``. Returns the adapted copy and the names of the adapted modules. Parameter
    names of the base model are unchanged; adapters add ``<module>.adapter.*``.
    """
    if not isinstance(rank, int) or rank < 1:
        raise SplitError(f"adapter rank must be a positive integer, got {rank!r}")
    model = copy.deepcopy(model)
    if modules is None:
        targets = [n for n, m in model.named_modules()
                   if isinstance(m, nn.Linear | nn.Conv2d | nn.Conv1d)]
    else:
        targets = _match_modules(model, modules, "adapter")
    if not targets:
        raise SplitError("adapter split: the model has no Linear or Conv1d/Conv2d module to adapt; "
                         "pass modules=[...] naming the modules to adapt")
    mods = dict(model.named_modules())
    for name in targets:
        m = mods[name]
        if hasattr(m, ADAPTER_CHILD):
            raise SplitError(f"module {name!r} already has an attribute {ADAPTER_CHILD!r}")
        m.add_module(ADAPTER_CHILD, _make_adapter(name, m, rank))
        m.register_forward_hook(_adapter_hook)
    return model, targets


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
