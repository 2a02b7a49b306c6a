"""The component registry: every named component of partialfl is one entry.

An entry is ``(kind, name, Options, build)``, registered in the module that defines the
component::

    @dataclass(frozen=True)
    class FedProxOptions:
        mu: float = option(0.01, "proximal strength μ ≥ 0")

    @register("algorithm", "fedprox", options=FedProxOptions)
    def _fedprox(opts: FedProxOptions, ctx) -> Algorithm: ...

``Options`` is a frozen dataclass: its fields are the component's options (type, default and a
one-line description, :func:`option`) and its ``__post_init__`` validates them; ``build(options,
ctx)`` makes the object (``ctx``: what the component needs from the run, see each kind).
``traits`` are facts about an entry that other layers ask instead of checking names (e.g. an
algorithm's ``split="none"``: it trains one shared model).

A run specification names a component as ``"name"`` or ``{name = "…", …options}``
(:class:`Component`); :func:`partialfl.config.from_dict` validates the name against this
registry and the options against the entry's ``Options``, so a bad option names the key, the
value and what is allowed. The spec, the builder, the CLI, the pipeline and Flower ask this
module; nothing else maps names to components.

Entries are registered when their provider package is imported (:data:`KINDS`), on the first
question about that kind. A user's module registers the same way: list it in a config's
``plugins``, or expose it as an entry point of the group ``partialfl.plugins``.

This module imports no array library, so reading a spec stays cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from partialfl.config import ConfigError, did_you_mean


@dataclass(frozen=True)
class Kind:
    """A kind of component: what it is, the packages whose import registers its entries,
    and what ``build(options, ctx)`` receives as ``ctx``."""

    name: str
    doc: str
    providers: tuple[str, ...]
    context: str = "nothing (None)"


#: every kind of component, with the packages that register its entries
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("problem", "closed-form federated problems (numpy)", ("partialfl.problems",)),
    Kind("algorithm", "federated algorithms: what a client sends, how the server steps",
         ("partialfl.algorithms",), "an AlgorithmContext (local trainer, fine-tuner, server "
         "optimizer, aggregator, weighting, w initialisation)"),
    Kind("wrapper", "algorithm wrappers: Byzantine robustness, buffering, staleness, faults, "
         "differential privacy", ("partialfl.algorithms", "partialfl.runtime.faults"),
         "a WrapperContext (the wrapped algorithm, seed, clients per round, number of "
         "clients, the aggregation rule, rounds)"),
    Kind("local", "client optimizers and fine-tuning solvers", ("partialfl.local",)),
    Kind("optimizer", "server optimizers", ("partialfl.server",)),
    Kind("schedule", "server learning-rate schedules", ("partialfl.server",),
         "a ScheduleContext (total rounds)"),
    Kind("aggregator", "aggregation rules (mean and robust rules)",
         ("partialfl.aggregation",)),
    Kind("attack", "what Byzantine clients send instead of their update (label flipping acts "
         "on the data: partialfl.attacks.flip_labels)", ("partialfl.attacks",)),
    Kind("split", "which parameters of a model are personal", ("partialfl.split",),
         "a SplitContext (the model)"),
    Kind("model", "neural network architectures", ("partialfl.models",),
         "a ModelContext (number of classes, seed, the data)"),
    Kind("dataset", "federated data sources", ("partialfl.data.sources",),
         "a DataContext (the data spec, the partitioner builder)"),
    Kind("partitioner", "splitting centralised data into clients (flwr-datasets)",
         ("partialfl.data.partition",), "a PartitionContext (number of clients, label column, "
         "seed)"),
    Kind("data-format", "input formats of `partialfl data convert`", ("partialfl.data.convert",)),
    Kind("executor", "how a cohort's clients run: vectorised, one by one, worker processes",
         ("partialfl.runtime",)),
    Kind("distribution", "durations of client computations in the asynchronous runtime",
         ("partialfl.runtime.asynchronous.timing",)),
    Kind("loss", "training losses of model problems", ("partialfl.problems.model.losses",
                                                       "partialfl.lm")),
    Kind("metric", "evaluation metrics of model problems", ("partialfl.problems.model.losses",
                                                            "partialfl.lm")),
    Kind("reproduction", "`partialfl reproduce NAME`: the paper's figures and our tables",
         ("partialfl.reproductions",)),
)}

PLUGIN_GROUP = "partialfl.plugins"


def option(default: Any = dataclasses.MISSING, doc: str = "", *,
           factory: Callable[[], Any] | None = None) -> Any:
    """A field of an ``Options`` dataclass with its one-line description (what the generated
    config reference prints)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def component_field(kind: str, default: str | None, doc: str, *, optional: bool = False) -> Any:
    """A dataclass field naming a component of ``kind`` (a spec table or an entry's option):
    ``default`` is its name (a table without ``name`` means it); ``optional``: the field is
    None unless given."""

    def parse(value, key):  # None given for a field with a default: the default (as omitted)
        if value is None:
            return None if default is None or optional else component(kind, default)
        return component(kind, value, key, default)

    meta = {"kind": kind, "doc": doc, "default_name": default, "parse": parse}
    if default is None or optional:
        return field(default=None, metadata=meta)
    return field(default_factory=lambda: component(kind, default), metadata=meta)


@dataclass(frozen=True)
class Entry:
    """One registered component (see the module docstring)."""

    kind: str
    name: str
    build: Callable[..., Any]
    options: type | None = None
    doc: str = ""
    aliases: tuple[str, ...] = ()
    traits: Mapping[str, Any] = field(default_factory=dict)
    module: str = ""

    def trait(self, key: str, default: Any = None) -> Any:
        """A fact about this entry (``default`` when it does not say)."""
        return self.traits.get(key, default)

    def parse(self, raw: Mapping[str, Any] | None, where: str = "") -> Any:
        """The validated ``Options`` of ``raw`` (the option keys of a component table)."""
        from partialfl.config import from_dict, unknown_key_error

        raw = dict(raw or {})
        if self.options is None:
            if raw:
                raise unknown_key_error(sorted(raw)[0], ["name"], where)
            return None
        return from_dict(self.options, raw, where)

    def create(self, options: Any = None, ctx: Any = None) -> Any:
        """``build(options, ctx)`` (default options when None)."""
        if options is None and self.options is not None:
            options = self.options()
        return self.build(options, ctx)


_ENTRIES: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
_ALIASES: dict[str, dict[str, str]] = {k: {} for k in KINDS}
_LOADED: set[str] = set()
_PLUGINS_LOADED = False


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; allowed: {', '.join(KINDS)}")


def register(kind: str, name: str, *, options: type | None = None,
             aliases: Iterable[str] = (), doc: str | None = None, **traits: Any
             ) -> Callable[[Callable], Callable]:
    """Decorator: register ``build(options, ctx)`` (a function or a class) as component
    ``name`` of ``kind``. ``doc`` defaults to the first paragraph of the builder's (or the
    options') docstring. Registering a name twice from another module is an error (a
    plugin cannot silently replace a built-in)."""
    _check_kind(kind)
    if options is not None and not (dataclasses.is_dataclass(options)
                                     and options.__dataclass_params__.frozen):
        raise TypeError(f"{kind} {name!r}: options must be a frozen dataclass, got {options!r}")

    def deco(build: Callable) -> Callable:
        text = doc if doc is not None else _first_paragraph(build.__doc__ or (
            options.__doc__ if options is not None else ""))
        e = Entry(kind, name, build, options, text, tuple(aliases), dict(traits),
                  getattr(build, "__module__", ""))
        for n in (name, *e.aliases):  # a name or alias of another module's entry: refused
            real = n if n in _ENTRIES[kind] else _ALIASES[kind].get(n)
            old = _ENTRIES[kind].get(real) if real is not None else None
            if old is not None and old.module != e.module:
                raise ValueError(f"{kind} {n!r} is registered twice: by {old.module} "
                                 f"({old.name}) and by {e.module} ({name})")
        _ENTRIES[kind][name] = e
        for a in e.aliases:
            _ALIASES[kind][a] = name
        return build

    return deco


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def _load(kind: str) -> None:
    """Import the provider packages of ``kind`` (once) and the installed plugins."""
    global _PLUGINS_LOADED
    _check_kind(kind)
    if kind not in _LOADED:
        _LOADED.add(kind)
        for mod in KINDS[kind].providers:
            importlib.import_module(mod)
    if not _PLUGINS_LOADED:
        _PLUGINS_LOADED = True
        for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
            try:
                ep.load()
            except Exception as e:  # a broken installed plugin: one line naming it
                raise ConfigError(f"installed plugin {ep.name!r} ({ep.value}, entry point "
                                  f"group {PLUGIN_GROUP}) failed to load: "
                                  f"{type(e).__name__}: {e}") from None


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def import_module(mod: Any, key: str = "plugins", what: str = "plugin module"):
    """Import a module a user's config names (``key``): a dotted name of identifiers (no
    relative or path-like name), and whatever its import raises (a missing module, an error
    in its code, a component registered wrongly) is one :class:`ConfigError` naming it."""
    if not isinstance(mod, str) or not _MODULE_NAME.fullmatch(mod):
        raise ConfigError(f"{key}: {mod!r} is not a module name (dotted identifiers, "
                          f"e.g. my_package.my_module)")
    try:
        return importlib.import_module(mod)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import {what} {mod!r}: {e}") from None
    except Exception as e:
        raise ConfigError(f"{key}: {what} {mod!r} failed at import: "
                          f"{type(e).__name__}: {e}") from None


def load_plugins(modules: Iterable[str], key: str = "plugins") -> None:
    """Import a user's modules that register components (a config's ``plugins``)."""
    for mod in modules:
        import_module(mod, key)


def names(kind: str, builtin: bool = False) -> tuple[str, ...]:
    """The registered names of ``kind`` (what a spec may say), aliases not included;
    ``builtin``: partialfl's own only (none of a loaded plugin's)."""
    return tuple(e.name for e in entries(kind, builtin))


def entries(kind: str, builtin: bool = False) -> list[Entry]:
    """Every entry of ``kind``, by name (``builtin``: partialfl's own only)."""
    _load(kind)
    return [e for n, e in sorted(_ENTRIES[kind].items())
            if not builtin or e.module.startswith("partialfl.")]


def canonical(kind: str, name: str) -> str | None:
    """The registered name ``name`` stands for (itself, or the target of an alias), or None."""
    _load(kind)
    if name in _ENTRIES[kind]:
        return name
    return _ALIASES[kind].get(name)


def entry(kind: str, name: str, key: str | None = None) -> Entry:
    """The entry ``name`` (or an alias of it) of ``kind``; a :class:`ConfigError` naming
    ``key``, the closest name and every allowed name otherwise."""
    real = canonical(kind, name) if isinstance(name, str) else None
    if real is None:
        allowed = names(kind)
        raise ConfigError(f"{key or kind}: {name!r} is not allowed"
                          f"{did_you_mean(name, [*allowed, *_ALIASES[kind]])}; allowed: "
                          f"{', '.join(allowed)}")
    return _ENTRIES[kind][real]


def with_trait(kind: str, key: str, value: Any = True) -> tuple[str, ...]:
    """The names of ``kind`` whose trait ``key`` equals ``value``."""
    return tuple(e.name for e in entries(kind) if e.trait(key) == value)


# ----------------------------------------------------------------------------- in a spec
@dataclass(frozen=True)
class Component:
    """A component named in a run specification: ``kind``, registered ``name`` and its
    validated ``options`` (the entry's ``Options``, or None). In TOML: ``"name"`` or
    ``{name = "…", …options}``; :meth:`to_dict` gives the latter back."""

    kind: str
    name: str
    options: Any = None

    @property
    def entry(self) -> Entry:
        """The registry entry."""
        return entry(self.kind, self.name)

    def build(self, ctx: Any = None) -> Any:
        """The component: ``build(options, ctx)`` of its entry."""
        return self.entry.create(self.options, ctx)

    def to_dict(self) -> dict[str, Any]:
        """``{"name": …, **options}`` (the TOML form)."""
        from partialfl.config import to_dict

        return {"name": self.name, **({} if self.options is None else to_dict(self.options))}

    def get(self, key: str, default: Any = None) -> Any:
        """An option's value (``default`` when the entry has no such option)."""
        return getattr(self.options, key, default) if self.options is not None else default

    def __getattr__(self, key: str) -> Any:
        """An option's value as an attribute (``stage.client.lr``)."""
        if key.startswith("_") or key in ("kind", "name", "options"):
            raise AttributeError(key)
        opts = self.__dict__.get("options")
        if opts is not None and key in getattr(opts, "__dataclass_fields__", {}):
            return getattr(opts, key)
        raise AttributeError(f"{self.__dict__.get('kind')} {self.__dict__.get('name')!r} has "
                             f"no option {key!r}")


def _plain(v: Any) -> Any:
    if isinstance(v, Component):
        return v.to_dict()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def component(kind: str, value: Any, where: str = "", default: str | None = None
              ) -> Component:
    """A :class:`Component` of ``kind`` from ``"name"``, ``{name = …, …options}`` or a
    Component (re-validated); ``default``: the name when a table gives none."""
    if isinstance(value, Component):
        if value.kind != kind:
            raise ConfigError(f"{where}: expected a {kind}, got a {value.kind}")
        value = value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        owners = [e for e in entries(kind) if e.options is type(value)]
        if len(owners) != 1:
            raise ConfigError(f"{where}: {type(value).__name__} is not the options of one "
                              f"{kind}; give the name")
        return Component(kind, owners[0].name, value)
    named = isinstance(value, str)
    if named:
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a {kind} name or a table with name = …, got "
                          f"{value!r}")
    raw = dict(value)
    name = raw.pop("name", default)
    if name is None:
        raise ConfigError(f"{where}: give the {kind}'s name (name = …); allowed: "
                          f"{', '.join(names(kind))}")
    e = entry(kind, name, (where or kind) if named else
              (f"{where}.name" if where else f"{kind}.name"))
    return Component(kind, e.name, e.parse(raw, where))


def create(kind: str, value: Any, ctx: Any = None, where: str = "") -> Any:
    """Build a component of ``kind`` named by ``value`` (see :func:`component`)."""
    return component(kind, value, where).build(ctx)


def describe_options(options: type | None) -> list[dict[str, Any]]:
    """The options of an entry for the config reference: name, type, default, description."""
    if options is None:
        return []
    hints = typing.get_type_hints(options)
    out = []
    for f in dataclasses.fields(options):
        if not f.init:
            continue
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else None)
        out.append({"name": f.name, "type": _type_text(hints.get(f.name)),
                    "default": _plain(default), "doc": f.metadata.get("doc", ""),
                    "choices": f.metadata.get("choices")})
    return out


def _type_text(tp: Any) -> str:
    if tp is None:
        return "any"
    text = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return text or str(tp).replace("typing.", "")


__all__ = ["KINDS", "PLUGIN_GROUP", "Component", "Entry", "Kind", "canonical", "component",
           "component_field", "create", "describe_options", "entries", "entry", "import_module",
           "load_plugins", "names", "option", "register", "with_trait"]
