"""Writing a client store: :class:`StoreWriter` (atomic, vectorised) and :func:`write_store`.

The writer fills a hidden temporary folder ``.<name>.tmp-<pid>-<hex>`` next to the target
(one append-only file per array, CRC-32 computed while writing), writes ``header.json`` last,
fsyncs, and renames the folder into place; an exception removes the temporary folder. While it
writes it holds an ``flock`` on a lock file inside it, so the next writer into the same
destination can tell a dead writer's leftovers (a ``kill -9``, a power cut) from a live one and
removes them (:func:`clean_stale`).

:meth:`StoreWriter.add_many` appends a block of clients with one write per array (their
examples concatenated, with per-client sizes): no per-client Python work beyond the ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.data.federated import FederatedDataset
from partialfl.data.store.layout import (
    F32_MAX,
    FIELDS,
    HEADER,
    SPLITS,
    STORE_FORMAT,
    STORE_VERSION,
    X_KINDS,
    Sink,
    as_numpy,
    fsync_dir,
    header_crc,
    split_meta,
    x_scale_problem,
)
from partialfl.data.store.verify import SIDECAR
from partialfl.io import open_regular

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: liveness by process id only
    fcntl = None

LOCK = ".writer.lock"
_CHUNK_CLIENTS, _CHUNK_BYTES = 4096, 64 << 20


# ----------------------------------------------------------------------------- stale files
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _writer_alive(folder: Path) -> bool:
    """Whether the writer that made ``folder`` (``.<name>.tmp-<pid>-<hex>``) still runs: its
    lock is held (or, before it took the lock or once it removed the lock file to swap its
    store in, its process exists)."""
    lock = folder / LOCK
    if fcntl is not None and lock.is_file():
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            swapping = os.fstat(fd).st_nlink == 0  # removed since we opened it, then unlocked
        except OSError:
            return True  # held: a live writer
        finally:
            os.close(fd)
        if not swapping:
            return False
    pid = folder.name.rsplit("-", 2)[-2] if folder.name.count("-") >= 2 else ""
    return pid.isdigit() and _pid_alive(int(pid))


def clean_stale(path: str | Path) -> list[Path]:
    """Remove what dead writers into ``path`` left next to it: temporary folders, and the old
    store a writer killed mid-swap had moved aside (put back if ``path`` is missing, else
    removed). Live writers' folders are kept. Returns the folders removed or restored."""
    path = Path(path)
    done = []
    if not path.parent.is_dir():
        return done
    # exactly the names a writer gives them (".NAME.tmp-PID-HEX12", ".NAME.old-PID-HEX12";
    # older writers: no PID): a user's ".NAME.old-backup/" beside the store is not a writer's
    own = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-([0-9]+-)?[0-9a-f]{{12}}")
    left = sorted(p for p in path.parent.iterdir() if own.fullmatch(p.name)
                  and p.is_dir() and not p.is_symlink() and not _writer_alive(p))
    for p in left:
        if p.name.startswith(f".{path.name}.tmp-"):
            shutil.rmtree(p, ignore_errors=True)
            done.append(p)
    for p in left:
        if not p.name.startswith(f".{path.name}.old-"):
            continue
        if not path.exists() and (p / HEADER).is_file():
            os.replace(p, path)  # the new store never landed: keep the previous one
        else:
            shutil.rmtree(p, ignore_errors=True)
        done.append(p)
    return done


def check_replaceable(path: Path) -> None:
    """Raise FileExistsError unless ``path`` (which exists) may be replaced by a new store: a
    real folder (not a symlink) that is empty or holds a client store (its ``header.json``
    names the store format). ``overwrite`` once removed whatever folder ``--out`` named, a
    user's files included."""
    why = None
    if path.is_symlink() or not path.is_dir():
        why = "a symlink" if path.is_symlink() else "not a folder"
    elif any(path.iterdir()):
        try:
            with open_regular(path / HEADER, follow=False) as f:
                head = json.loads(f.read(1 << 20))
            fmt, files = head.get("format"), {HEADER, *head.get("files", {})}
        except (OSError, ValueError, RecursionError, AttributeError, TypeError):
            fmt, files = None, set()
        if fmt != STORE_FORMAT:
            why = "a folder that is not a client store"
        else:  # a user's file or folder put beside the store's own files is never deleted
            own = (SIDECAR, f".{SIDECAR}.")  # the remembered CRC checks, their killed writes
            extra = sorted(p.name for p in path.iterdir()
                           if p.name not in files and not p.name.startswith(own))
            if extra:
                why = f"a client store that also holds {extra[0]!r}, not one of its files"
    if why:
        raise FileExistsError(f"{path} is {why}; overwrite only replaces a client store (or "
                              "an empty folder): remove it yourself or choose another folder")


# ----------------------------------------------------------------------------- the writer
def _check_pair(cid: str, split: str, x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(f"client {cid!r}: {split} x {x.shape} and y {y.shape} must share the "
                         "first (example) dimension")


class StoreWriter:
    """Write a client store (atomic; see the module docstring).

    Use as a context manager: ``with StoreWriter(path, num_classes=62) as w: w.add(...)``;
    on normal exit the store is renamed into place, on an exception the temporary folder is
    removed and nothing appears at ``path``.

    Args:
        path: the store folder to create.
        num_classes: labels are in ``0..num_classes-1``.
        x_scale: if set, readers return ``x`` as float32 ``x · x_scale`` (e.g. uint8 pixels
            with ``1/255``); None returns ``x`` in its stored dtype.
        overwrite: replace an existing store (or empty folder) at ``path`` (the old one is
            removed only after the new one is complete); any other file or folder there is
            refused (:func:`check_replaceable`), never deleted.
    """

    def __init__(self, path: str | Path, *, num_classes: int, description: str = "",
                 meta: dict[str, Any] | None = None, x_scale: float | None = None,
                 overwrite: bool = False) -> None:
        self.path = Path(path)
        if int(num_classes) < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if x_scale is not None and not (np.isfinite(x_scale) and x_scale > 0):
            raise ValueError(f"x_scale must be None or a positive finite number, got {x_scale}")
        if not isinstance(description, str):
            raise ValueError(f"description must be a string, got {type(description).__name__}")
        self.num_classes = int(num_classes)
        self.description = description
        self.meta_plain, self.meta_arrays = split_meta(meta or {})
        self.x_scale = None if x_scale is None else float(x_scale)
        self.overwrite = overwrite
        clean_stale(self.path)
        if self.path.exists() or self.path.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it")
            check_replaceable(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.tmp.mkdir()
        self._lock = os.open(self.tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        if fcntl is not None:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._sinks = {f: Sink(self.tmp / f"{f}.bin") for f in FIELDS}
        self._spec: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._range: dict[str, tuple[int, int]] = {}
        self._sizes: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self._ids: list[np.ndarray] = []
        self._seen: set[str] = set()
        self._done = False

    @property
    def num_clients(self) -> int:
        return len(self._seen)

    def add(self, client_id: str, train_x, train_y, test_x, test_y) -> None:
        """Append one client (arrays or tensors with a leading example axis)."""
        cid = str(client_id)
        a = dict(zip(FIELDS, map(as_numpy, (train_x, train_y, test_x, test_y))))
        for s in SPLITS:
            _check_pair(cid, s, a[f"{s}_x"], a[f"{s}_y"])
        self.add_many([cid], *a.values(), [a["train_y"].shape[0]], [a["test_y"].shape[0]])

    def add_many(self, client_ids: Sequence[str], train_x, train_y, test_x, test_y,
                 train_sizes, test_sizes) -> None:
        """Append a block of clients: each field holds their examples concatenated in client
        order, client i owning ``*_sizes[i]`` rows of its split."""
        ids = [str(c) for c in client_ids]
        k = len(ids)
        if k == 0:
            return
        if len(set(ids)) != k or not self._seen.isdisjoint(ids):
            seen = set(self._seen)
            dup = next(c for c in ids if c in seen or seen.add(c))
            raise ValueError(f"duplicate client id {dup!r}")
        if "\x00" in "".join(ids):
            raise ValueError("client ids must not contain NUL characters")
        arrs = dict(zip(FIELDS, map(as_numpy, (train_x, train_y, test_x, test_y))))
        sizes = {}
        for s, n in zip(SPLITS, (train_sizes, test_sizes)):
            n = np.asarray(n).reshape(-1)
            if n.shape != (k,) or n.dtype.kind not in "iu" or (k and n.min() < 0):
                raise ValueError(f"{s}_sizes must be {k} non-negative integers")
            sizes[s] = n.astype(np.int64)
            x, y = arrs[f"{s}_x"], arrs[f"{s}_y"]
            rows = int(sizes[s].sum())
            if x.ndim == 0 or y.ndim == 0 or x.shape[0] != rows or y.shape[0] != rows:
                raise ValueError(f"{s}_x {x.shape} and {s}_y {y.shape} must both have "
                                 f"sum({s}_sizes) = {rows} rows")
            self._check_values(s, x, y, ids, sizes[s])
            arrs[f"{s}_y"] = y.astype(np.int64, copy=False)
        for f, a in arrs.items():
            spec = (a.dtype.str, tuple(a.shape[1:]))
            ref = self._spec.setdefault(f[-1], spec)
            if ref != spec:
                raise ValueError(f"client {ids[0]!r}: {f} has dtype/per-example shape {spec}; "
                                 f"the first client has {ref}")
        for f, a in arrs.items():
            self._sinks[f].write(a)
            if a.dtype.kind in "iu" and a.size and (a.dtype.itemsize > 1 or f[-1] == "y"):
                lo, hi = int(a.min()), int(a.max())  # (1-byte inputs: pixels, no range)
                old = self._range.get(f, (lo, hi))
                self._range[f] = (min(lo, old[0]), max(hi, old[1]))
        for s in SPLITS:
            self._sizes[s].append(sizes[s])
        try:
            enc = np.array(ids, dtype="S")  # ASCII fast path
        except UnicodeEncodeError:
            enc = np.array([c.encode("utf-8") for c in ids])
        self._ids.append(enc)
        self._seen.update(ids)

    def _check_values(self, s: str, x: np.ndarray, y: np.ndarray, ids: list[str],
                      sizes: np.ndarray) -> None:
        def owner(bad: np.ndarray) -> str:
            row = int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0])
            return ids[int(np.searchsorted(np.cumsum(sizes), row, side="right"))]

        if y.dtype.kind not in "iu":
            raise TypeError(f"client {ids[0]!r}: {s}_y must hold integer labels, got {y.dtype}")
        if x.dtype.kind not in X_KINDS:
            raise TypeError(f"client {ids[0]!r}: {s}_x has dtype {x.dtype}; store numbers "
                            "(bool, integer or float)")
        if y.size and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise ValueError(f"client {owner((y < 0) | (y >= self.num_classes))!r}: {s}_y "
                             f"labels outside 0..{self.num_classes - 1}")
        if x.dtype.kind == "f" and x.size and not np.isfinite(x).all():
            raise ValueError(f"client {owner(~np.isfinite(x))!r}: {s}_x has non-finite values")
        if x.dtype.kind == "f" and x.dtype.itemsize > 4 and x.size and np.abs(x).max() > F32_MAX:
            raise ValueError(f"client {owner(np.abs(x) > F32_MAX)!r}: {s}_x has values beyond "
                             "float32's range (readers return float32 inputs)")
        why = None if self.x_scale is None else x_scale_problem(x.dtype, self.x_scale)
        if why is not None:
            raise ValueError(f"{why}; got x_scale={self.x_scale!r}")

    def close(self) -> Path:
        """Finish: write offsets, ids, meta and ``header.json``, fsync, rename into place."""
        if self._done:
            return self.path
        try:
            self._finish()
            self._swap()
        except BaseException:
            self.abort()
            raise
        return self.path

    def _finish(self) -> None:
        if not self._seen:
            raise ValueError("a client store needs at least one client")
        files = {f"{f}.bin": s.close() for f, s in self._sinks.items()}
        extra: dict[str, np.ndarray] = {
            f"{s}_offsets.bin": np.concatenate([[0], np.cumsum(np.concatenate(self._sizes[s]))])
            .astype("<i8") for s in SPLITS}
        ids = np.concatenate(self._ids)
        extra["client_ids.bin"] = ids
        meta_arrays = {}
        for k, v in self.meta_arrays.items():
            name = f"meta_{len(meta_arrays)}.bin"
            extra[name] = v
            meta_arrays[k] = {"file": name, "dtype": v.dtype.str, "shape": list(v.shape)}
        for name, a in extra.items():
            s = Sink(self.tmp / name)
            s.write(a)
            files[name] = s.close()
        rows = {s: int(extra[f"{s}_offsets.bin"][-1]) for s in SPLITS}
        fields = {}
        for f in FIELDS:
            dtype, shape = self._spec[f[-1]]
            fields[f] = {"dtype": dtype, "shape": list(shape), "rows": rows[f.split("_")[0]]}
            if f in self._range:
                fields[f]["min"], fields[f]["max"] = self._range[f]
        header = {
            "format": STORE_FORMAT, "version": STORE_VERSION,
            "num_clients": len(ids), "num_classes": self.num_classes,
            "description": self.description, "meta": self.meta_plain,
            "meta_arrays": meta_arrays, "x_scale": self.x_scale,
            "client_id_dtype": ids.dtype.str, "fields": fields, "files": files,
        }
        header["header_crc32"] = header_crc(header)
        with open(self.tmp / HEADER, "w") as f:
            json.dump(header, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    def _swap(self) -> None:
        # the lock file goes while the lock is still held: a writer starting now finds no lock
        # file and asks whether this process lives (it did remove a live, unlocked folder)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp / LOCK)
        self._unlock()
        fsync_dir(self.tmp)
        old = None
        if self.path.exists() or self.path.is_symlink():
            if not self.overwrite:
                raise FileExistsError(f"{self.path} appeared while writing; not replacing it")
            check_replaceable(self.path)
            old = self.path.parent / (f".{self.path.name}.old-{os.getpid()}-"
                                      f"{uuid.uuid4().hex[:12]}")
            os.replace(self.path, old)
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            if old is not None:
                os.replace(old, self.path)
            raise
        self._done = True
        fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def abort(self) -> None:
        """Drop everything written so far."""
        for s in self._sinks.values():
            if not s.f.closed:
                s.f.close()
        self._unlock()
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._done = True

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _blocks(data: FederatedDataset, clients: Iterable[int]) -> Iterator[tuple]:
    """``add_many`` arguments for runs of consecutive clients with the same dtypes and
    per-example shapes (at most 4096 clients or ~64 MiB each)."""
    buf: list[tuple[str, list[np.ndarray]]] = []
    key, nbytes = None, 0

    def flush():
        ids = [c for c, _ in buf]
        cols = list(zip(*(a for _, a in buf)))
        out = [np.concatenate(col) for col in cols]
        return (ids, *out, [len(a[1]) for _, a in buf], [len(a[3]) for _, a in buf])

    for m in clients:
        cid = str(data.client_ids[m])
        a = [as_numpy(getattr(data, f)[m]) for f in FIELDS]
        for s, (x, y) in zip(SPLITS, (a[:2], a[2:])):
            _check_pair(cid, s, x, y)
        k = tuple((v.dtype.str, v.shape[1:]) for v in a)
        if buf and (k != key or len(buf) >= _CHUNK_CLIENTS or nbytes >= _CHUNK_BYTES):
            yield flush()
            buf, nbytes = [], 0
        buf.append((cid, a))
        key, nbytes = k, nbytes + sum(v.nbytes for v in a)
    if buf:
        yield flush()


def write_store(path: str | Path, data: FederatedDataset, *, overwrite: bool = False,
                x_scale: float | None = None, progress: bool = False) -> Path:
    """Write a (in-memory) FederatedDataset as a client store at ``path`` (atomic)."""
    it: Iterable[int] = range(data.num_clients)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="clients", mininterval=0.5)
    with StoreWriter(path, num_classes=data.num_classes, description=data.description,
                     meta=data.meta, x_scale=x_scale, overwrite=overwrite) as w:
        for block in _blocks(data, it):
            w.add_many(*block)
    return Path(path)
