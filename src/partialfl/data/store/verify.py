"""CRC-32 checks of a store's files, once per file version.

Opening a store checks every file's CRC-32 against the header. A check that passed is
remembered — in this process and in the store's ``.verified.json`` sidecar (best effort: a
read-only store is checked once per process) — keyed by the file's inode, size, mtime and
ctime (nanoseconds), so re-opening an unchanged store (another run, a worker process) reads
no data. Any write to a file changes its mtime and ctime, so it is checked again.

A result is only kept if the file's mtime is at least :data:`RACY_NS` older than the start of
the check (as git does for its index): a write within the same timestamp tick as the check
could otherwise leave the key unchanged. So a store is re-checked by each open during the first
seconds after it was written, then once more, then never while unchanged.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from partialfl.data.store.layout import StoreError, crc_file
from partialfl.io import open_regular, write_json

SIDECAR = ".verified.json"
RACY_NS = 2_000_000_000  # coarser than any file-system timestamp tick (FAT: 2 s)
_MEMO: dict[tuple[str, str], list[int]] = {}  # (folder, name) -> [*key, crc32, checked_at]


def file_key(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _trusted(entry, key: list[int], crc: int) -> bool:
    return (isinstance(entry, list) and len(entry) == 6 and entry[:4] == key
            and entry[4] == crc and type(entry[5]) is int and key[2] < entry[5] - RACY_NS)


def _load_sidecar(root: Path) -> dict:
    """The remembered checks; {} unless the sidecar is the store's own regular file (a
    symlink is not followed; a FIFO planted under its name once hung the open for good)."""
    try:
        with open_regular(root / SIDECAR, follow=False) as f:
            d = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):  # FileFormatError is a ValueError
        return {}
    return d if isinstance(d, dict) else {}


def _save_sidecar(root: Path, entries: dict) -> None:
    try:
        write_json(root / SIDECAR, entries)
    except OSError:  # a read-only store: remembered in this process only
        pass


def check_crcs(root: Path, files: dict[str, tuple[int, int]], stats: dict[str, os.stat_result],
               *, force: bool = False) -> list[str]:
    """Check the CRC-32 of each file (``name -> (bytes, crc32)``; ``stats`` their ``os.stat``)
    unless a remembered check of the same file version passed; returns the names read."""
    folder = str(root.resolve())
    side = None
    read, fresh = [], {}
    for name, (_, crc) in files.items():
        key = file_key(stats[name])
        if not force:
            if _trusted(_MEMO.get((folder, name)), key, crc):
                continue
            if side is None:
                side = _load_sidecar(root)
            if _trusted(side.get(name), key, crc):
                _MEMO[(folder, name)] = side[name]
                continue
        started = time.time_ns()
        if crc_file(root / name) != crc:
            raise StoreError(f"{root / name}: CRC-32 mismatch (corrupt file)")
        read.append(name)
        entry = [*key, crc, started]
        if _trusted(entry, key, crc):
            _MEMO[(folder, name)] = fresh[name] = entry
    if fresh:
        side = _load_sidecar(root) if side is None else side
        _save_sidecar(root, {**{k: v for k, v in side.items() if k in files}, **fresh})
    return read


def forget(root: Path | None = None) -> None:
    """Drop this process's remembered checks (of one store folder, or all)."""
    if root is None:
        _MEMO.clear()
        return
    folder = str(Path(root).resolve())
    for k in [k for k in _MEMO if k[0] == folder]:
        del _MEMO[k]
