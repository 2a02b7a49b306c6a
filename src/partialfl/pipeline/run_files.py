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
cannot tell it from the run's own). A user's entry named like one the run writes
(:func:`run_names`: ``report.md``, ``tensorboard``, ...) refuses the start, since the run
would write over it; a later command that adds an entry to a finished run (``report
--tensorboard``, ``compare``) records it (:func:`record_added`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
from collections.abc import Callable
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


#: top-level names (fnmatch patterns) a run writes into its folder, or a later command into a
#: finished run (``report --tensorboard``, ``compare``); ``{name}``: the spec's name
RUN_NAMES = ("spec.json", "source.json", "config.json", "report.md", "metrics.json",
             "new_clients.json", "learning_curves.png", "per_client_accuracy.png",
             "budget_curves.png", "summary.md", "compare.md", "compare.png", "tensorboard",
             "personalized", "flower", "stage1", "stage2*", "theta*", "deploy.*",
             "client_state*", "{name}.jsonl", "{name}.png", "{name}_*")


def run_names(name: str | None = None) -> tuple[str, ...]:
    """:data:`RUN_NAMES` with ``{name}`` the spec's name (without one: those patterns left
    out)."""
    return tuple(p.replace("{name}", glob_escape(name)) if name is not None else p
                 for p in RUN_NAMES if name is not None or "{name}" not in p)


def glob_escape(text: str) -> str:
    """``text`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def confined(root: Path, files: list[Path]) -> None:
    """Refuse a file a command reads from a run folder (the deployed model, metrics, logs),
    or a folder on its way, that is a symbolic link: it could lead outside the folder
    (``evaluate`` would score, ``compare`` and ``report`` table, another run)."""
    for f in files:
        for p in (f, *[q for q in f.relative_to(root).parents if q != Path(".")]):
            pio.refuse_link(p if p == f else root / p, f"a run folder's files must lie "
                            f"inside {root}; copy the run there instead of linking it")


def record_start(out: Path, name: str | None = None) -> None:
    """At a run's first start in ``out`` (no ``spec.json`` there): the names already in it;
    FileExistsError (one line) if one of them is named like an entry the run writes
    (:func:`run_names` of the spec's ``name``): the run would write over the user's file."""
    if not (out / "spec.json").exists() and not (out / PREEXISTING).exists():
        names = sorted(p.name for p in out.iterdir())
        clash = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in run_names(name))]
        if clash:
            raise FileExistsError(
                f"{out / clash[0]} is not a run's (there is no run in {out}) but has the name "
                "of an entry the run writes, which would replace it: move it (or choose "
                "another --out)")
        pio.write_json(out / PREEXISTING, {"names": names})


def refuse_users_entries(out: Path, writes: tuple[str, ...], mark: str) -> None:
    """Before a command without a start record (a closed-form ``partialfl run``) writes the
    entries ``writes`` into ``out``: FileExistsError (one line) if one of them is there while
    its ``mark`` (the first entry it writes) is not — a user's file it would replace — or
    if ``out`` holds the record of another command's run, study or reproduction (whose
    files it could replace under a name that matches ``mark``)."""
    other = [r for r in RECORDS if os.path.lexists(out / r)]
    if other:
        raise FileExistsError(f"{out} holds the files of another command ({other[0]}): "
                              "choose another --out")
    if (out / mark).exists():
        return  # an earlier run of the same command: its own files, rewritten
    for name in writes:
        if os.path.lexists(out / name):
            raise FileExistsError(f"{out / name} is not this run's (no {mark} beside it) but "
                                  "has the name of a file the run writes, which would replace "
                                  "it: move it (or choose another --out)")


def claim_folder(out: Path, marker: str, owner: str, options: dict | None = None) -> None:
    """A command that fills a whole folder (a reproduction) claims ``out``: new or empty, or
    holding its ``marker`` (a JSON file naming the ``owner`` and the ``options`` that decide
    which results it writes) from an earlier start with the same options, whose killed
    writes' temporary files are then removed (a folder linked below it refused); else
    FileExistsError (one line) — the user's files, another command's, or its own under other
    options (their results would lie beside the new ones, under no summary). Writes the
    marker."""
    if out.is_dir() and any(not (p.name.startswith(f".{marker}.") and p.name.endswith(".tmp"))
                            for p in out.iterdir()):  # (a killed first write of the marker)
        try:
            held = pio.read_json(out / marker)
            who, before = held.get("owner"), held.get("options")
        except (OSError, ValueError, AttributeError):
            who = before = None
        if who != owner:
            what = f"the output of {who!r}" if isinstance(who, str) else "files that are not its"
            raise FileExistsError(f"{out} holds {what}; {owner} writes into a new or empty "
                                  "folder, or its own from an earlier start: choose another "
                                  "--out")
        if before != options:
            here = "options it did not record" if before is None else f"other options ({before})"
            raise FileExistsError(f"{out} holds {owner} with {here}; this run's are {options}: "
                                  "rerun with the same options, or choose another --out")
        refuse_linked_folders(out)  # (a received folder: its files would go elsewhere)
        pio.clean_stale_writes(out)
    elif out.is_dir():  # empty, or only the marker's killed first write: that one removed
        pio.clean_stale_writes(out, recursive=False, targets=[marker])
    out.mkdir(parents=True, exist_ok=True)
    pio.write_json(out / marker, {"owner": owner} if options is None
                   else {"owner": owner, "options": options})


def record_added(out: Path, name: str) -> None:
    """``name`` is now in the finished run ``out``, written by a later command: listed in
    ``run_files.json`` (so ``--overwrite`` deletes it); FileExistsError (one line) if it is
    one of the user's own names (``preexisting.json``), which the command must not touch."""
    if name in set(_names(out / PREEXISTING) or []):
        raise FileExistsError(f"{out / name} was in {out} before the run (the user's own): "
                              "partialfl does not write into it; move it first")
    names = _names(out / RUN_FILES)
    if names is not None and name not in names:
        pio.write_json(out / RUN_FILES, {"names": sorted(set(names) - {RUN_FILES} | {name})
                                         + [RUN_FILES]})


#: the records of a run, a study or a reproduction in their folder
RECORDS = (PREEXISTING, RUN_FILES, "study.json", "reproduction.json")


def refuse_run_file(path: Path, option: str) -> None:
    """FileExistsError (one line) when ``path`` (``..`` resolved) is, or lies in, an entry of
    a run: one its ``run_files.json`` lists, every entry but the user's of a run still
    going (``preexisting.json``, no ``run_files.json``), or a run's, study's or
    reproduction's record itself — a command's output (``option``) never replaces a run's
    model, metrics, report or record. ``path`` is resolved as the write will reach it (links
    followed, then ``..``)."""
    path = Path(path).resolve()
    for folder in path.parents:
        entry = path.relative_to(folder).parts[0]
        ours = set(_names(folder / RUN_FILES) or []) | {m for m in RECORDS
                                                        if (folder / m).exists()}
        mine = _names(folder / PREEXISTING)
        if mine is not None and not (folder / RUN_FILES).exists() and folder.is_dir():
            ours |= {p.name for p in folder.iterdir()} - set(mine)  # an unfinished run's
        if entry in ours:
            raise FileExistsError(f"{option} {path}: a file of the run in {folder} "
                                  f"({entry}); choose another path")


def refuse_foreign(path: Path, option: str, ours: Callable[[Path], bool]) -> None:
    """FileExistsError (one line) when ``path`` exists but is not an earlier output of the
    same command (``ours(path)`` false): a command's output (``option``) replaces only its
    own file, never a user's or another command's (a closed-form run's summary, a
    reproduction's results, a study's comparison …)."""
    if os.path.lexists(path) and not (path.is_file() and ours(path)):
        raise FileExistsError(f"{option} {path}: the file exists and is not an earlier "
                              f"output of this command, which would replace it; choose "
                              "another path (or remove it)")


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


def user_entries(out: Path) -> list[str]:
    """The user's own entries in the run folder ``out`` (``preexisting.json``; none if it
    is absent): what no command of the run may touch."""
    return _names(out / PREEXISTING) or []


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
