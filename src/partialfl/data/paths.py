"""Where real data lives.

The folder is, in order: an explicit ``data_dir`` argument (``--data-dir`` on the command
line), the ``PARTIALFL_DATA_DIR`` environment variable, or the first existing of
``./shared/data``, ``../shared/data`` (from the working directory) and ``../shared/data`` next
to the source checkout. Nothing is ever downloaded at run time by default.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "PARTIALFL_DATA_DIR"


class DataNotFoundError(FileNotFoundError):
    """A data file is missing; the message says where it was looked for and how to point to it."""


def _candidates() -> list[Path]:
    here = Path(__file__).resolve()
    repo = here.parents[3] if len(here.parents) > 3 else here.parent
    return [Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data",
            repo.parent / "shared" / "data"]


def default_data_dir(data_dir: str | Path | None = None) -> Path | None:
    """The data folder to use, or None if none of the candidates exists."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    for c in _candidates():
        if c.is_dir():
            return c
    return None


def resolve_data_file(name: str, data_dir: str | Path | None = None) -> Path:
    """Path of ``name`` inside the data folder; a clear error if it is not there."""
    d = default_data_dir(data_dir)
    if d is None:
        looked = ", ".join(str(c) for c in _candidates())
        raise DataNotFoundError(
            f"no data folder found for {name!r} (looked in {looked}); pass --data-dir or set "
            f"{ENV_VAR}"
        )
    path = d / name
    if not path.exists():
        raise DataNotFoundError(
            f"data file {path} does not exist; pass --data-dir or set {ENV_VAR} to the folder "
            f"holding {name!r}"
        )
    return path
