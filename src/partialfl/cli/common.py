"""What several commands share: output folders, loading a spec with ``--set``, and the
options every run command takes."""

from __future__ import annotations

import argparse
from pathlib import Path

from partialfl.config import ConfigError


def out_dir(path) -> Path:
    """An output folder: it may exist as a folder, never as a file."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder")
    return out


def load_spec(args: argparse.Namespace, sets: list[str] | None = None):
    """The spec of ``args.config`` with the command line's overrides (``sets`` replaces
    ``args.set``); code named by the config may be imported only with ``--allow-code``."""
    from partialfl.build import allow_code, config_folder_on_path
    from partialfl.pipeline.train import load_run_spec

    sets = list(args.set or []) if sets is None else list(sets)
    if args.threads is not None:
        sets.append(f"threads={args.threads}")
    if args.allow_code:
        config_folder_on_path(Path(args.config).parent)
    with allow_code(args.allow_code or None):
        return load_run_spec(args.config, sets, device=args.device)


def add_common(s: argparse.ArgumentParser) -> None:
    """Options every run command takes."""
    s.add_argument("--threads", type=int, metavar="N",
                   help="torch/BLAS threads (overrides the config's threads; recorded with "
                        "the run: a run repeats exactly at the same thread count)")
    s.add_argument("--allow-code", action="store_true",
                   help="allow the config to import code (model.name = 'module:callable', "
                        "plugins); modules beside the config file are found")
    s.add_argument("--no-progress", action="store_true")
