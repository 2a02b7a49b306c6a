"""What a SuperNode's operator decides on the node itself — never a message.

A SuperNode takes its run configuration from the server's messages (and ``flwr run``'s
config, which the server's user chose too), so nothing in it may make the node run code or
lower its privacy floor. What only the node's own configuration — its ``--node-config`` or
the environment its operator started it in — decides:

* ``partition-id`` / ``num-partitions``: which clients it serves;
* ``allow-imports`` (node config ``allow-imports=true``, or the environment variable
  ``PARTIALFL_NODE_ALLOW_IMPORTS=1``): whether a ``package.module:callable`` named in the run
  config (e.g. ``model = "mypkg.models:make"``, or the train spec's ``model.name``) may be
  imported and called here. Off by default: a node builds components by registered name
  only, and refuses (:class:`~partialfl.flower.config.ConfigError`, one line) a run config
  that names code (:func:`check_code`) before anything is built. ``partialfl train --engine
  flower-sim|flower`` turns it on for the SuperNodes it starts itself when the user's own
  spec names such a callable;
* ``eval-min-clients`` (node config): a floor under the run config's ``eval-min-clients`` —
  the node evaluates only when it holds at least the larger of the two.

This module does not import ``flwr``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partialfl.flower.config import ConfigError, FlowerConfig, node_partition

#: the environment variable that lets a SuperNode import callables named in a run config
ALLOW_IMPORTS_ENV = "PARTIALFL_NODE_ALLOW_IMPORTS"
#: a ``package.module:attr`` reference (what :func:`partialfl.build.import_callable` imports)
_CODE_REF = re.compile(r"^\s*[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\s*:\s*[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\s*$")
#: ``prefix:NAME`` forms that name a registry entry, not code
_REGISTRY_PREFIXES = ("preset",)


@dataclass(frozen=True)
class NodeOptions:
    """A SuperNode's own settings (see the module docstring)."""

    partition: int
    num_partitions: int
    allow_imports: bool = False
    eval_min_clients: int = 1


def _flag(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: got {v!r}; expected true or false")


def node_options(node_config: Mapping[str, Any],
                 environ: Mapping[str, str] | None = None) -> NodeOptions:
    """The options of a SuperNode from its ``--node-config`` and environment."""
    env = os.environ if environ is None else environ
    part, nparts = node_partition(node_config)
    allow = _flag(node_config.get("allow-imports", False), "node-config 'allow-imports'") or \
        _flag(env.get(ALLOW_IMPORTS_ENV, ""), f"environment variable {ALLOW_IMPORTS_ENV}")
    floor = node_config.get("eval-min-clients", 1)
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        raise ConfigError(f"node-config 'eval-min-clients': got {floor!r}; expected an "
                          "integer >= 1")
    return NodeOptions(part, nparts, allow, floor)


def _strings(tree: Any, where: str):
    if isinstance(tree, str):
        yield where, tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _strings(v, f"{where}[{i}]")


def _spec_dict(text: str) -> Any:
    import base64
    import binascii

    try:
        if text.startswith("b64:"):
            text = base64.urlsafe_b64decode(text[4:].encode()).decode()
        return json.loads(text)
    except (json.JSONDecodeError, binascii.Error, UnicodeDecodeError, ValueError,
            RecursionError):
        return None  # not a spec: parsing it later fails with its own message


def code_refs(cfg: FlowerConfig) -> list[tuple[str, str]]:
    """``[(key, "package.module:callable"), ...]``: every value of the run config (and of the
    train spec it carries) that names code to import, e.g. ``("model", "os:system")``."""
    values = dict(cfg.to_run_config())
    spec = _spec_dict(values.pop("train-spec", "") or "")
    found = list(_strings(values, "")) + list(_strings(spec, "train-spec"))
    return [(k, v.strip()) for k, v in found if _CODE_REF.match(v)
            and v.split(":", 1)[0].strip() not in _REGISTRY_PREFIXES]


def check_code(cfg: FlowerConfig, opts: NodeOptions) -> None:
    """Refuse a run config that names code unless this node's own configuration allows
    imports (see the module docstring)."""
    refs = code_refs(cfg)
    if refs and not opts.allow_imports:
        key, ref = refs[0]
        raise ConfigError(
            f"SuperNode refuses run-config {key} = {ref!r}: a SuperNode never imports code "
            "named by a message; its operator may allow it with --node-config "
            f"'allow-imports=true' or {ALLOW_IMPORTS_ENV}=1")
