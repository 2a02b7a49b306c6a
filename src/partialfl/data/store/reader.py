"""Reading a client store: :class:`ClientStore`, the checked arrays of a folder.

Rows are read with positional reads (``os.preadv``, one per cluster of nearby rows, readahead
off): a round reads its cohort's bytes and nothing else. (Through ``np.memmap`` each client
touched mapped its whole page-cache folio — 1.7 MB per client on Linux 6.18 — and faulted in
the disk's whole readahead window, so RSS and disk reads grew with every round; and a file
truncated under a mapping kills the process with SIGBUS, where a read just comes back short.)

Opening validates ``header.json`` (:func:`~partialfl.data.store.layout.read_header`: every
path confined to the folder, sizes and dtypes consistent), checks each file's size and CRC-32
(once per file version: :mod:`~partialfl.data.store.verify`), and the offsets. Every read of
rows re-checks what is cheap on the rows read: labels in ``0..num_classes-1``, integer inputs
within the range the writer saw, float inputs finite — so a file changed after the open raises
:class:`StoreError` instead of training on NaN or an out-of-range label.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.data.store.layout import (
    F32_MAX,
    FIELDS,
    SPLITS,
    StoreError,
    pread_into,
    read_header,
    safe_file,
)
from partialfl.data.store.verify import check_crcs


def _memmap(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


_GAP_BYTES = 64 << 10  # rows closer than this are read in one call
_SPAN_BYTES = 16 << 20  # at most this much per call


def _clusters(s: np.ndarray, gap: int, cap: int) -> list[tuple[int, int]]:
    """``[(i, j)]`` covering the sorted rows ``s``: within a piece, consecutive rows are at most
    ``gap`` apart and the piece spans under ``cap`` rows (unless one row)."""
    cuts = [0, *(np.flatnonzero(np.diff(s) > gap) + 1).tolist(), s.size]
    out = []
    for i, j in zip(cuts[:-1], cuts[1:]):
        while s[j - 1] - s[i] >= cap:
            k = max(i + 1, int(np.searchsorted(s[i:j], s[i] + cap)) + i)
            out.append((i, k))
            i = k
        out.append((i, j))
    return out


class ClientStore:
    """The raw arrays of a client store folder (see the package docstring).

    Attributes: ``header`` (the parsed JSON), ``num_clients``, ``num_classes``, ``offsets``
    (``{split: int64 [M + 1]}``), ``client_ids_raw``, ``fields`` (``{field: read-only
    memmap}``, for inspection; rounds read through :meth:`rows`), ``meta``, ``x_scale``,
    ``description``; :attr:`crc_read` lists the files whose CRC-32 this open computed (empty
    when every check was remembered)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no client store at {self.path}")
        h = read_header(self.path)
        self._h = h
        self.header = h.raw
        self.num_clients, self.num_classes = h.num_clients, h.num_classes
        stats = {}
        for name, (nbytes, _) in h.files.items():
            fp = self.path / name
            try:
                st = fp.stat()
            except OSError:
                st = None
            if st is None or not fp.is_file():
                raise StoreError(f"{fp}: missing file of the client store")
            if st.st_size != nbytes:
                raise StoreError(f"{fp}: {st.st_size} bytes, the header says {nbytes} "
                                 "(truncated or corrupt)")
            stats[name] = st
        self.crc_read = check_crcs(self.path, h.files, stats)
        M = self.num_clients
        self.offsets = {s: self._array(f"{s}_offsets.bin", np.dtype("<i8"), (M + 1,))
                        for s in SPLITS}
        for s, off in self.offsets.items():
            if off[0] != 0 or np.any(np.diff(off) < 0) or off[-1] != h.fields[f"{s}_y"].rows:
                raise StoreError(f"{self.path / f'{s}_offsets.bin'}: offsets are inconsistent")
        self.client_ids_raw = self._array("client_ids.bin", h.id_dtype, (M,))
        self.shapes = {f: (h.fields[f].rows, *h.fields[f].shape) for f in FIELDS}
        self._fds: dict[str, int] = {}
        for f in FIELDS:  # opened now: reads from several threads share them
            self._fd(f)
        self.meta: dict[str, Any] = dict(h.meta)
        for k, (name, dt, shape) in h.meta_arrays.items():
            self.meta[k] = self._array(name, dt, shape).copy()
        self.x_scale = h.x_scale
        self.description = h.description

    def __reduce__(self):
        """Pickles as a reference (the folder), not as the data."""
        return (ClientStore, (str(self.path),))

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """``{field: read-only np.memmap [rows, ...]}`` (mapped on first use)."""
        if "_fields" not in self.__dict__:
            self._fields = {f: _memmap(self.path / f"{f}.bin", self._h.fields[f].dtype,
                                       self.shapes[f]) for f in FIELDS}
        return self._fields

    def _fd(self, field: str) -> int:
        fd = self._fds.get(field)
        if fd is None:
            fd = os.open(self.path / f"{field}.bin", os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[field] = fd
        return fd

    def close(self) -> None:
        """Close the open data files (reads reopen them)."""
        fds, self._fds = self.__dict__.get("_fds", {}), {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass

    def _array(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        fp = safe_file(self.path, name, "files")
        a = np.fromfile(fp, dtype=dtype)
        if a.size != math.prod(shape):
            raise StoreError(f"{fp}: holds {a.size} values, expected shape {shape}")
        return a.reshape(shape)

    def verify(self) -> None:
        """Check the CRC-32 of every file again, reading the whole store (nothing
        remembered is trusted)."""
        stats = {name: (self.path / name).stat() for name in self._h.files}
        check_crcs(self.path, self._h.files, stats, force=True)

    def sizes(self, split: str) -> np.ndarray:
        """Examples per client, int64 ``[M]`` (computed once per split)."""
        cache = self.__dict__.setdefault("_sizes", {})
        if split not in cache:
            cache[split] = np.diff(self.offsets[split])
        return cache[split]

    def rows(self, field: str, idx: np.ndarray) -> np.ndarray:
        """A copy of the given global rows of a field (any index shape; negative rows count
        from the end), checked (see the module docstring)."""
        idx = np.asarray(idx, dtype=np.int64)
        n, per = self.shapes[field][0], self.shapes[field][1:]
        dt = self._h.fields[field].dtype
        flat = idx.reshape(-1)
        out = np.empty((flat.size, *per), dtype=dt)
        rb = math.prod(per) * dt.itemsize
        if flat.size and rb:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < -n or hi >= n:
                raise IndexError(f"{field}: rows outside 0..{n - 1}")
            if lo < 0:
                flat = np.where(flat < 0, flat + n, flat)
                lo, hi = int(flat.min()), int(flat.max())
            span = (hi - lo + 1) * rb
            if span <= min(flat.size * rb + _GAP_BYTES, _SPAN_BYTES):  # one read
                buf = self._span(field, lo, hi - lo + 1, dt, per)
                np.take(buf, flat - lo, axis=0, out=out)
            else:
                self._read(field, flat, out.reshape(flat.size, -1), rb)
        out = out.reshape(*idx.shape, *per)
        if out.size:
            self._check_rows(field, idx, out)
        return out

    def _span(self, field: str, lo: int, rows: int, dt: np.dtype, per: tuple) -> np.ndarray:
        buf = np.empty((rows, *per), dtype=dt)
        rb = buf.nbytes // rows
        pread_into(self._fd(field), memoryview(buf.reshape(-1)).cast("B"), lo * rb,
                   self.path / f"{field}.bin")
        return buf

    def _read(self, field: str, flat: np.ndarray, out: np.ndarray, rb: int) -> None:
        order = np.argsort(flat, kind="stable")
        s = flat[order]
        for i, j in _clusters(s, max(1, _GAP_BYTES // rb), max(1, _SPAN_BYTES // rb)):
            lo = int(s[i])
            buf = self._span(field, lo, int(s[j - 1]) - lo + 1, out.dtype, (out.shape[1],))
            out[order[i:j]] = buf[s[i:j] - lo]

    def _check_rows(self, field: str, idx: np.ndarray, a: np.ndarray) -> None:
        spec = self._h.fields[field]
        if field.endswith("_y"):
            lo, hi = 0, self.num_classes - 1
        elif a.dtype.kind == "f":
            if a.dtype.itemsize > 4 and a.size and not np.abs(a).max() <= F32_MAX:
                big = ~(np.abs(a) <= F32_MAX)  # (NaN included)
                self._corrupt(field, idx, big, "a value beyond float32's range, which the "
                              "readers return", "")
            with np.errstate(over="ignore", invalid="ignore"):
                if math.isfinite(float(np.add.reduce(a, axis=None))):
                    return  # fast path: a NaN or inf makes the sum non-finite
            bad = ~np.isfinite(a)
            if bad.any():
                self._corrupt(field, idx, bad, "a non-finite value")
            return
        elif spec.lo is None:
            return
        else:
            lo, hi = spec.lo, spec.hi
        if a.dtype.kind == "b" or (np.iinfo(a.dtype).min >= lo and np.iinfo(a.dtype).max <= hi):
            return  # every value of the dtype is allowed
        if int(a.min()) >= lo and int(a.max()) <= hi:
            return
        self._corrupt(field, idx, (a < lo) | (a > hi), f"a value outside {lo}..{hi}")

    def _corrupt(self, field: str, idx: np.ndarray, bad: np.ndarray, what: str,
                 why: str = " (the file changed after it was opened and checked: corrupt "
                 "store)") -> None:
        row = int(idx.reshape(-1)[np.flatnonzero(bad.reshape(idx.size, -1).any(axis=1))[0]])
        raise StoreError(f"{self.path / f'{field}.bin'}: row {row} holds {what}{why}")
