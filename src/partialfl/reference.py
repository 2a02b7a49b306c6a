"""The configuration reference, generated from the run specification and the registry: every
key of :class:`partialfl.spec.RunSpec` (type, default, description) and every registered
component with its options (``docs/config.md``; ``partialfl reference`` prints it). Nothing
here is written by hand, so the reference cannot drift from the code."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from partialfl.registry import KINDS, Component, describe_options, entries

#: a spec table's TOML path → its dataclass, in the order the reference lists them
_HEADER = """# Configuration reference

Generated from `partialfl.spec` and the component registry (`partialfl reference` prints
it; a test keeps this file current). A run spec is one TOML file: a closed-form run has
`[problem]`, `[method]` and `[personalize]`; a model run has `[model]`, `[data]`, `[method]`
and the stages `[pretrain]`, `[personalize]`, `[finetune]`. A component is written as its
name, `"cg"`, or as a table with its name and options, `{ name = "cg", tau = 40 }`; the
algorithm's own options are keys of `[method]` itself. `--set key=value` overrides any key
on the command line (e.g. `--set personalize.client.tau=10`). TOML has no null: an option
of type "X or None" (X not a string) is set to None with `"none"` (e.g.
`[privacy] clip_norm = "none"`).
"""


def _type_text(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_text(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return f"list of {_type_text(inner)}"
    if origin is dict:
        return "table"
    if tp is Component:
        return "component"
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field) -> str:
    if f.metadata.get("kind"):
        name = f.metadata.get("default_name")
        return f'`"{name}"`' if name else "not set"
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(v):
            return "(its defaults)"
    else:
        return "required"
    if v is None:
        return "not set"
    if isinstance(v, str):
        return f'`"{v}"`'
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, tuple):
        return "`[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in v) + "]`"
    return f"`{v}`"


def fields(cls: type) -> list[dict[str, str]]:
    """The documented keys of a spec dataclass: name, type, default, description."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind = f.metadata.get("kind")
        tp = f"{kind} component" if kind else _type_text(hints[f.name])
        out.append({"key": f.name, "type": tp, "default": _default_text(f),
                    "doc": f.metadata.get("doc", "")})
    return out


def _nested(cls: type) -> list[tuple[str, type]]:
    """(key, dataclass) of the tables inside ``cls`` (not components)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("kind"):
            continue
        tp = hints[f.name]
        cands = [tp, *typing.get_args(tp)]
        for c in cands:
            if dataclasses.is_dataclass(c) and c is not Component:
                out.append((f.name, c))
                break
    return out


def _table(rows: list[dict[str, str]], cols: tuple[str, ...]) -> list[str]:
    head = "| " + " | ".join(cols) + " |"
    sep = "| " + " | ".join("---" for _ in cols) + " |"
    body = ["| " + " | ".join(str(r[c.lower()]).replace("|", "\\|") for c in cols) + " |"
            for r in rows]
    return [head, sep, *body]


def spec_reference(cls: type | None = None, path: str = "") -> list[str]:
    """Markdown sections for ``cls`` (default :class:`~partialfl.spec.RunSpec`) and every
    table inside it."""
    if cls is None:
        from partialfl.spec import RunSpec

        cls = RunSpec
    title = f"`[{path}]`" if path else "Top level"
    doc = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    lines = [f"### {title}", "", doc, "", *_table(fields(cls), ("Key", "Type", "Default",
                                                                  "Doc")), ""]
    seen = set()
    for key, sub in _nested(cls):
        sub_path = f"{path}.{key}" if path else key
        if (sub, key) in seen:
            continue
        seen.add((sub, key))
        lines += spec_reference(sub, sub_path)
    return lines


def component_reference(builtin: bool = False) -> list[str]:
    """Markdown sections for every kind of component and each registered entry (with
    ``builtin``: only partialfl's own, not those of loaded plugins)."""
    lines = []
    for kind, k in KINDS.items():
        lines += [f"### Kind `{kind}`", "", f"{k.doc[:1].upper()}{k.doc[1:]}.", ""]
        for e in entries(kind, builtin):
            alias = f" (also: {', '.join(e.aliases)})" if e.aliases else ""
            lines += [f"- **`{e.name}`**{alias}: {e.doc}"]
            opts = describe_options(e.options)
            if opts:
                lines += ["", *("  " + row for row in _table(
                    [{"option": o["name"], "type": o["type"], "default": f"`{o['default']}`",
                      "doc": o["doc"]} for o in opts], ("Option", "Type", "Default", "Doc"))),
                          ""]
        lines.append("")
    return lines


def reference_markdown(builtin: bool = False) -> str:
    """The whole reference (``docs/config.md`` holds it with ``builtin``: partialfl's own
    components, none of a loaded plugin's)."""
    return "\n".join([_HEADER, "## The run spec", "", *spec_reference(),
                      "## Components", "", *component_reference(builtin)]).rstrip() + "\n"


__all__ = ["component_reference", "fields", "reference_markdown", "spec_reference"]
