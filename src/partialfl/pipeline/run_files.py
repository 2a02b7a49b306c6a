"""Which entries of a run folder the run wrote, so that ``--overwrite`` deletes those and
nothing else (a user's notes, or the TOML config kept beside the run, stay).

A train run may start in a folder that already holds the user's files. At its first start
(no ``spec.json`` yet) :func:`record_start` writes the names already there to
``preexisting.json``; when the run has finished, :func:`record_end` writes every other
top-level name to ``run_files.json``, its very last write. :func:`remove_run` deletes the
names of ``run_files.json`` (a symlink as a link, never what it points to) — ``spec.json``
first — then ``preexisting.json`` and ``run_files.json`` last: a kill at any instant leaves
``run_files.json`` without ``spec.json``, a removal cut short
(:func:`partialfl.pipeline.train.removal_cut_short`, still a finished run for
:func:`~partialfl.pipeline.train.finished`), which only ``--overwrite`` finishes: nothing
resumes or keeps a half-deleted run. (A run folder with ``spec.json`` but without
``report.md`` is an unfinished run: it resumes.)
A finished run killed before ``run_files.json`` is named by ``preexisting.json``'s
complement; with neither record (an older run) ``--overwrite`` is refused: the user removes
it. A file put into the folder *while* the run runs is counted as the run's (the record
cannot tell it from the run's own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from partialfl import io as pio

PREEXISTING, RUN_FILES = "preexisting.json", "run_files.json"


def refuse_linked_folders(out: Path) -> None:
    """FileExistsError (one line) if a folder below ``out`` is a symbolic link: the run would
    write its stage files, logs or clients' models through it, outside ``out`` (a received
    or shared folder may hold such links; ``out`` itself is the user's choice)."""
    for root, dirs, _ in os.walk(out, followlinks=False):
        for d in dirs:
            if os.path.islink(os.path.join(root, d)):
                raise FileExistsError(f"{os.path.join(root, d)} is a symbolic link to a folder; "
                                      f"a run writes only inside {out}: remove the link (or "
                                      "choose another --out)")


def record_start(out: Path) -> None:
    """At a run's first start in ``out`` (no ``spec.json`` there): the names already in it."""
    if not (out / "spec.json").exists() and not (out / PREEXISTING).exists():
        pio.write_json(out / PREEXISTING, {"names": sorted(p.name for p in out.iterdir())})


def record_end(out: Path) -> None:
    """After a run finished in ``out``: the top-level names it wrote (all but the user's)."""
    mine = set(_names(out / PREEXISTING) or []) - {PREEXISTING, RUN_FILES}
    pio.write_json(out / RUN_FILES, {"names": sorted(p.name for p in out.iterdir()
                                                     if p.name not in mine) + [RUN_FILES]})


def remove_run(out: Path) -> None:
    """Delete the entries the finished run in ``out`` wrote (see the module docstring),
    nothing else; FileExistsError (one line) when neither record is readable."""
    names = _names(out / RUN_FILES)
    if names is None:
        mine = _names(out / PREEXISTING)
        names = None if mine is None else sorted(
            p.name for p in out.iterdir() if p.name not in set(mine) | {PREEXISTING})
    if names is None:
        raise FileExistsError(f"{out} holds a finished run without a readable record of the "
                              f"files it wrote ({RUN_FILES}): --overwrite deletes only those; "
                              "remove the folder yourself or choose another --out")
    first, last = ("spec.json",), (PREEXISTING, RUN_FILES)  # see the module docstring
    for name in [*first, *(n for n in names if n not in first + last), *last]:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _names(path: Path) -> list[str] | None:
    """The plain entry names of the JSON file ``path`` (``{"names": [...]}``); None if it is
    absent or not that."""
    try:
        names = pio.read_json(path).get("names")
    except (OSError, ValueError):
        return None
    ok = isinstance(names, list) and all(
        isinstance(n, str) and n not in ("", ".", "..") and "/" not in n and "\\" not in n
        and "\x00" not in n for n in names)
    return names if ok else None
