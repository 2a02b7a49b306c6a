"""A split of a model's parameters into global θ and personal w (:class:`Split`), its
validation, and the layer helpers the split kinds use (see :mod:`partialfl.split`)."""


from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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


