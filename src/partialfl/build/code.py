"""Code named by a config (``module:callable`` models, ``plugins``) is imported only when
the user allowed it on their own machine (``--allow-code`` or ``PARTIALFL_ALLOW_CODE=1``)."""


from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from partialfl.config import ConfigError
from partialfl.registry import load_plugins
from partialfl.spec import RunSpec

ALLOW_CODE_ENV = "PARTIALFL_ALLOW_CODE"
_ALLOW_CODE: list[bool] = []


@contextmanager
def allow_code(allowed: bool | None = True) -> Iterator[None]:
    """Within this block, configs may name code to import (``module:callable`` models,
    ``plugins``) if ``allowed`` (None: as outside the block). The CLI's ``--allow-code``
    sets it; so does ``PARTIALFL_ALLOW_CODE=1``."""
    if allowed is None:
        yield
        return
    _ALLOW_CODE.append(bool(allowed))
    try:
        yield
    finally:
        _ALLOW_CODE.pop()


def code_allowed() -> bool:
    """Whether a config may name code to import now (see :func:`allow_code`)."""
    if _ALLOW_CODE:
        return _ALLOW_CODE[-1]
    return os.environ.get(ALLOW_CODE_ENV, "") == "1"


def _check_code(what: str, ref: str) -> None:
    if not code_allowed():
        raise ConfigError(f"{what}: {ref!r} names code to import and run; components are "
                          f"chosen by registered name unless you allow code from configs on "
                          f"your own machine: partialfl … --allow-code (or "
                          f"{ALLOW_CODE_ENV}=1)")


def code_refs(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(key, ref), ...]``: the code a spec (its plain dict, :meth:`RunSpec.to_dict`)
    names — a ``package.module:callable`` model and every plugin module, e.g.
    ``("model.name", "os:system")``."""
    out = []
    model = spec.get("model")
    name = model.get("name") if isinstance(model, Mapping) else None
    if isinstance(name, str) and ":" in name:
        out.append(("model.name", name.strip()))
    plugins = spec.get("plugins", [])
    for p in plugins if isinstance(plugins, list | tuple) else [plugins]:
        out.append(("plugins", str(p)))
    return out


def check_code_refs(spec: RunSpec) -> None:
    """Refuse ``spec`` unless code from configs is allowed (:func:`code_refs`): what a build
    would refuse, checked without building (a study checks every run before any runs)."""
    for key, ref in code_refs(spec.to_dict()):
        _check_code(key, ref)


def load_spec_plugins(plugins) -> None:
    """Import a spec's ``plugins`` (user modules that register components), if allowed; a
    spec's loader calls this before validating the rest, which may name their components."""
    if isinstance(plugins, RunSpec):
        plugins = plugins.plugins
    if not isinstance(plugins, list | tuple) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"plugins: expected a list of module names, got {plugins!r}")
    for mod in plugins:
        _check_code("plugins", mod)
    load_plugins(plugins)


#: the config folders :func:`config_folder_on_path` added (the processes partialfl starts for
#: the run, such as a local federation's SuperNodes, get them on their PYTHONPATH too)
CONFIG_FOLDERS: list[str] = []


def config_folder_on_path(folder: Path | None) -> None:
    """Let ``module:callable`` references in a config find modules beside the config file."""
    if folder is not None:
        f = str(Path(folder).resolve())
        if f not in CONFIG_FOLDERS:
            CONFIG_FOLDERS.append(f)
        if f not in sys.path:
            sys.path.insert(0, f)
