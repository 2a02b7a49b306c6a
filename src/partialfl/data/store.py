"""An on-disk client store: a federated data set as memory-mapped flat arrays.

Layout of a store folder (all integers little-endian)::

    header.json          format, version, num_classes, description, meta, per-field dtype and
                         per-example shape, and for every file its size in bytes and CRC-32
    train_x.bin ...      one flat C-order array per field (train_x, train_y, test_x, test_y):
                         the examples of client 0, then client 1, ...
    train_offsets.bin    int64 [M + 1]: client m's rows are offsets[m]:offsets[m+1]
    test_offsets.bin
    client_ids.bin       fixed-width UTF-8 bytes [M] (dtype ``S<width>`` in the header)
    meta_<key>.bin       array-valued ``meta`` entries (e.g. the FEMNIST pixel mean / std)

A round reads only its cohort's rows (``np.memmap`` fancy indexing copies just those rows), so
memory is O(cohort + model), not O(clients × data). Opening checks every file's size against the
header (a truncated file is named in the error) and the CRC-32 of the small files (offsets, ids,
meta); :meth:`ClientStore.verify` checks the CRC-32 of the big ones too.

Writing is atomic: :class:`StoreWriter` writes into a hidden temporary folder next to the target,
writes ``header.json`` last, fsyncs, and renames the folder into place. An interrupted write
leaves only the temporary folder, which never loads (and is removed by the writer on error).

:class:`StoreDataset` is a :class:`~partialfl.data.federated.FederatedDataset`-compatible view
(same queries, lazily read tensors) that :class:`~partialfl.problems.model.ModelProblem` reads
through :meth:`StoreDataset.flat_split` without concatenating the clients into memory.
:class:`~partialfl.data.client_state.ClientStateStore` keeps the per-client state of stateful
baselines on disk in the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from partialfl.arrays import is_array, to_numpy
from partialfl.data.federated import DataFormatError, FederatedDataset

STORE_FORMAT = "partialfl-client-store"
STORE_VERSION = 1
FIELDS = ("train_x", "train_y", "test_x", "test_y")
_CRC_BLOCK = 1 << 24


class StoreError(DataFormatError):
    """A client store (or client-state store) is missing, truncated, corrupt or of another
    version; the message names the file."""


# ----------------------------------------------------------------------------- file helpers
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


class _Sink:
    """An append-only binary file that tracks its size and CRC-32."""

    def __init__(self, path: Path) -> None:
        self.path, self.f, self.bytes, self.crc = path, open(path, "wb"), 0, 0

    def write(self, a: np.ndarray) -> None:
        if a.size == 0:
            return
        buf = memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B")
        self.f.write(buf)
        self.bytes += buf.nbytes
        self.crc = zlib.crc32(buf, self.crc)

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.bytes, "crc32": self.crc}


as_numpy = to_numpy  # a numpy view or copy of an array or (detached, host) tensor


def _split_meta(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """JSON-able meta entries and array-valued ones (stored as files)."""
    plain, arrays = {}, {}
    for k, v in (meta or {}).items():
        if is_array(v):
            arrays[str(k)] = as_numpy(v)
            continue
        try:
            json.dumps(v)
        except TypeError:
            raise ValueError(f"meta[{k!r}] of type {type(v).__name__} cannot be stored: use "
                             "JSON values or arrays") from None
        plain[str(k)] = v
    return plain, arrays


# ----------------------------------------------------------------------------- writing
class StoreWriter:
    """Write a client store one client at a time (atomic; see the module docstring).

    Use as a context manager: ``with StoreWriter(path, num_classes=62) as w: w.add(...)``;
    on normal exit the store is renamed into place, on an exception the temporary folder is
    removed and nothing appears at ``path``.

    Args:
        path: the store folder to create.
        num_classes: labels are in ``0..num_classes-1``.
        x_scale: if set, readers return ``x`` as float32 ``x · x_scale`` (e.g. uint8 pixels
            with ``1/255``); None returns ``x`` in its stored dtype.
        overwrite: replace an existing store at ``path`` (the old one is removed only after
            the new one is complete).
    """

    def __init__(self, path: str | Path, *, num_classes: int, description: str = "",
                 meta: dict[str, Any] | None = None, x_scale: float | None = None,
                 overwrite: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it")
        if int(num_classes) < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if x_scale is not None and not (np.isfinite(x_scale) and x_scale > 0):
            raise ValueError(f"x_scale must be None or a positive finite number, got {x_scale}")
        self.num_classes = int(num_classes)
        self.description = description
        self.meta_plain, self.meta_arrays = _split_meta(meta or {})
        self.x_scale = x_scale
        self.overwrite = overwrite
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{uuid.uuid4().hex[:12]}"
        self.tmp.mkdir()
        self._sinks = {f: _Sink(self.tmp / f"{f}.bin") for f in FIELDS}
        self._spec: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._rows = {"train": [0], "test": [0]}
        self._ids: list[str] = []
        self._seen: set[str] = set()
        self._done = False

    def add(self, client_id: str, train_x, train_y, test_x, test_y) -> None:
        """Append one client (arrays or tensors with a leading example axis)."""
        cid = str(client_id)
        if cid in self._seen:
            raise ValueError(f"duplicate client id {cid!r}")
        arrs = dict(zip(FIELDS, map(as_numpy, (train_x, train_y, test_x, test_y))))
        for split in ("train", "test"):
            x, y = arrs[f"{split}_x"], arrs[f"{split}_y"]
            if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
                raise ValueError(f"client {cid!r}: {split} x {x.shape} and y {y.shape} must "
                                 "share the first (example) dimension")
            if y.dtype.kind not in "iu":
                raise TypeError(f"client {cid!r}: {split}_y must hold integer labels, got "
                                f"{y.dtype}")
            if y.size and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise ValueError(f"client {cid!r}: {split}_y labels outside "
                                 f"0..{self.num_classes - 1}")
            if x.dtype.kind == "f" and x.size and not np.isfinite(x).all():
                raise ValueError(f"client {cid!r}: {split}_x has non-finite values")
            arrs[f"{split}_y"] = y.astype(np.int64, copy=False)
        for f, a in arrs.items():
            key = "x" if f.endswith("_x") else "y"
            spec = (a.dtype.str, tuple(a.shape[1:]))
            ref = self._spec.setdefault(key, spec)
            if ref != spec:
                raise ValueError(f"client {cid!r}: {f} has dtype/per-example shape {spec}; the "
                                 f"first client has {ref}")
            self._sinks[f].write(a)
        for split in ("train", "test"):
            self._rows[split].append(self._rows[split][-1] + arrs[f"{split}_y"].shape[0])
        self._ids.append(cid)
        self._seen.add(cid)

    def close(self) -> Path:
        """Finish: write offsets, ids, meta and ``header.json``, fsync, rename into place."""
        if self._done:
            return self.path
        if not self._ids:
            raise ValueError("a client store needs at least one client")
        files = {f"{f}.bin": s.close() for f, s in self._sinks.items()}
        extra: dict[str, np.ndarray] = {
            f"{s}_offsets.bin": np.asarray(self._rows[s], dtype="<i8") for s in ("train", "test")}
        ids = np.array([c.encode("utf-8") for c in self._ids])
        extra["client_ids.bin"] = ids
        meta_arrays = {}
        for k, v in self.meta_arrays.items():
            name = f"meta_{len(meta_arrays)}.bin"
            extra[name] = v
            meta_arrays[k] = {"file": name, "dtype": v.dtype.str, "shape": list(v.shape)}
        for name, a in extra.items():
            s = _Sink(self.tmp / name)
            s.write(a)
            files[name] = s.close()
        header = {
            "format": STORE_FORMAT, "version": STORE_VERSION,
            "num_clients": len(self._ids), "num_classes": self.num_classes,
            "description": self.description, "meta": self.meta_plain,
            "meta_arrays": meta_arrays, "x_scale": self.x_scale,
            "client_id_dtype": ids.dtype.str,
            "fields": {f: {"dtype": self._spec[f[-1]][0], "shape": list(self._spec[f[-1]][1]),
                           "rows": self._rows[f.split("_")[0]][-1]} for f in FIELDS},
            "files": files,
        }
        with open(self.tmp / "header.json", "w") as f:
            json.dump(header, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        old = None
        if self.path.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.path} appeared while writing; not replacing it")
            old = self.path.parent / f".{self.path.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._done = True
        return self.path

    def abort(self) -> None:
        """Drop everything written so far."""
        for s in self._sinks.values():
            if not s.f.closed:
                s.f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done = True

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_store(path: str | Path, data: FederatedDataset, *, overwrite: bool = False,
                x_scale: float | None = None, progress: bool = False) -> Path:
    """Write a (in-memory) FederatedDataset as a client store at ``path`` (atomic)."""
    it: Iterable[int] = range(data.num_clients)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="clients", mininterval=0.5)
    with StoreWriter(path, num_classes=data.num_classes, description=data.description,
                     meta=data.meta, x_scale=x_scale, overwrite=overwrite) as w:
        for m in it:
            w.add(data.client_ids[m], data.train_x[m], data.train_y[m], data.test_x[m],
                  data.test_y[m])
    return Path(path)


# ----------------------------------------------------------------------------- reading
def _memmap(path: Path, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class ClientStore:
    """The raw memory-mapped arrays of a client store folder (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        hp = self.path / "header.json"
        if not self.path.is_dir():
            raise FileNotFoundError(f"no client store at {self.path}")
        if not hp.is_file():
            raise StoreError(f"{hp}: missing — {self.path} is not a complete client store "
                             "(an interrupted conversion leaves no header)")
        try:
            h = json.loads(hp.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreError(f"{hp}: corrupt header ({e})") from None
        if not isinstance(h, dict) or h.get("format") != STORE_FORMAT:
            raise StoreError(f"{hp}: not a {STORE_FORMAT} header")
        if h.get("version") != STORE_VERSION:
            raise StoreError(f"{hp}: store version {h.get('version')!r}, this reader reads "
                             f"version {STORE_VERSION}; convert the data again")
        try:
            self.header = h
            self.num_clients = int(h["num_clients"])
            self.num_classes = int(h["num_classes"])
            files = h["files"]
            fields = h["fields"]
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{hp}: header lacks or has a bad entry {e}") from None
        for name, info in files.items():
            fp = self.path / name
            if not fp.is_file():
                raise StoreError(f"{fp}: missing file of the client store")
            size = fp.stat().st_size
            if size != int(info["bytes"]):
                raise StoreError(f"{fp}: {size} bytes, the header says {info['bytes']} "
                                 "(truncated or corrupt)")
        self._small: dict[str, np.ndarray] = {}
        for name in files:
            if not name.endswith(tuple(f"{f}.bin" for f in FIELDS)):
                self._check_crc(name)
        M = self.num_clients
        self.offsets = {s: self._array(f"{s}_offsets.bin", "<i8", (M + 1,))
                        for s in ("train", "test")}
        for s, off in self.offsets.items():
            if off[0] != 0 or np.any(np.diff(off) < 0) or off[-1] != fields[f"{s}_y"]["rows"]:
                raise StoreError(f"{self.path / f'{s}_offsets.bin'}: offsets are inconsistent")
        self.client_ids_raw = self._array("client_ids.bin", h["client_id_dtype"], (M,))
        self.fields = {}
        for f in FIELDS:
            spec = fields[f]
            shape = (int(spec["rows"]), *map(int, spec["shape"]))
            expect = int(np.prod(shape)) * np.dtype(spec["dtype"]).itemsize
            if expect != int(files[f"{f}.bin"]["bytes"]):
                raise StoreError(f"{self.path / f'{f}.bin'}: {files[f'{f}.bin']['bytes']} bytes "
                                 f"do not hold {shape} of {spec['dtype']}")
            self.fields[f] = _memmap(self.path / f"{f}.bin", spec["dtype"], shape)
        self.meta: dict[str, Any] = dict(h.get("meta") or {})
        for k, info in (h.get("meta_arrays") or {}).items():
            self.meta[k] = self._array(info["file"], info["dtype"], tuple(info["shape"])).copy()
        self.x_scale = h.get("x_scale")
        self.description = str(h.get("description", ""))

    def __reduce__(self):
        """Pickles as a reference (the folder), not as the mapped data."""
        return (ClientStore, (str(self.path),))

    def _check_crc(self, name: str) -> None:
        fp = self.path / name
        if _crc_file(fp) != int(self.header["files"][name]["crc32"]):
            raise StoreError(f"{fp}: CRC-32 mismatch (corrupt file)")

    def _array(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        fp = self.path / name
        a = np.fromfile(fp, dtype=dtype)
        if a.size != int(np.prod(shape)):
            raise StoreError(f"{fp}: holds {a.size} values, expected shape {shape}")
        return a.reshape(shape)

    def verify(self) -> None:
        """Check the CRC-32 of every file (reads the whole store)."""
        for name in self.header["files"]:
            self._check_crc(name)

    def sizes(self, split: str) -> np.ndarray:
        """Examples per client, int64 ``[M]`` (computed once per split)."""
        cache = self.__dict__.setdefault("_sizes", {})
        if split not in cache:
            cache[split] = np.diff(self.offsets[split])
        return cache[split]

    def rows(self, field: str, idx: np.ndarray) -> np.ndarray:
        """A copy of the given global rows of a field."""
        return np.asarray(self.fields[field][np.asarray(idx, dtype=np.int64)])


def open_store(path: str | Path) -> StoreDataset:
    """Open a client store folder as a :class:`StoreDataset`."""
    return StoreDataset(ClientStore(path))


class _Ids(Sequence):
    """The client ids of a store view (decoded lazily)."""

    def __init__(self, raw: np.ndarray, pos: np.ndarray | None) -> None:
        self.raw, self.pos = raw, pos

    def __len__(self) -> int:
        return len(self.raw) if self.pos is None else len(self.pos)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p = int(i) if self.pos is None else int(self.pos[i])
        return self.raw[p].decode("utf-8")

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        target = str(value).encode("utf-8")
        hits = np.flatnonzero(self.raw == target)
        if self.pos is not None and hits.size:
            hits = np.flatnonzero(np.isin(self.pos, hits))
        if hits.size == 0:
            raise ValueError(f"{value!r} is not a client id")
        return int(hits[0])


class _Clients(Sequence):
    """``train_x`` etc. of a store view: client m's tensor, read on access."""

    def __init__(self, ds: StoreDataset, field: str) -> None:
        self.ds, self.field = ds, field

    def __len__(self) -> int:
        return self.ds.num_clients

    def __getitem__(self, m):
        if isinstance(m, slice):
            return [self[j] for j in range(*m.indices(len(self)))]
        split = self.field.split("_")[0]
        p = self.ds._store_pos(int(m))
        off = self.ds.store.offsets[split]
        return self.ds._decode(self.field, np.arange(off[p], off[p + 1]))


class StoreDataset:
    """A FederatedDataset-compatible view of a :class:`ClientStore` (optionally a subset).

    Same attributes and queries as :class:`~partialfl.data.federated.FederatedDataset`
    (``train_x[m]`` etc. read client m's rows on access); :meth:`flat_split` gives
    :class:`~partialfl.problems.model.ModelProblem` lazy access by global row.
    """

    def __init__(self, store: ClientStore, positions: np.ndarray | None = None) -> None:
        self.store = store
        self._pos = None if positions is None else np.asarray(positions, dtype=np.int64)
        self.num_classes = store.num_classes
        self.description = store.description
        self.meta = dict(store.meta)
        self.client_ids = _Ids(store.client_ids_raw, self._pos)
        for f in FIELDS:
            setattr(self, f, _Clients(self, f))

    @property
    def num_clients(self) -> int:
        return self.store.num_clients if self._pos is None else len(self._pos)

    def _store_pos(self, m: int) -> int:
        if not -self.num_clients <= m < self.num_clients:
            raise IndexError(f"client position {m} outside 0..{self.num_clients - 1}")
        return m % self.num_clients if self._pos is None else int(self._pos[m])

    def _positions(self) -> np.ndarray:
        return np.arange(self.store.num_clients) if self._pos is None else self._pos

    def _decode(self, field: str, rows: np.ndarray) -> Tensor:
        a = self.store.rows(field, rows)
        t = torch.from_numpy(a)
        if field.endswith("_x") and self.store.x_scale is not None:
            t = t.to(torch.float32) * float(self.store.x_scale)
        return t

    def train_sizes(self) -> np.ndarray:
        s = self.store.sizes("train")
        return s.copy() if self._pos is None else s[self._pos]

    def test_sizes(self) -> np.ndarray:
        s = self.store.sizes("test")
        return s.copy() if self._pos is None else s[self._pos]

    def subset(self, clients) -> StoreDataset:
        """A view with the clients at the given positions, in that order (no repeats)."""
        idx = np.asarray(clients, dtype=np.int64).reshape(-1)
        if len(np.unique(idx)) != len(idx):
            raise ValueError("subset: client positions must not repeat")
        bad = idx[(idx < 0) | (idx >= self.num_clients)]
        if bad.size:
            raise IndexError(f"subset: positions {bad[:5].tolist()} outside "
                             f"0..{self.num_clients - 1}")
        return StoreDataset(self.store, self._positions()[idx])

    def pooled(self, split: str = "train") -> tuple[Tensor, Tensor, Tensor]:
        """All examples of ``split`` concatenated: ``(x, y, owner)`` (reads the whole split)."""
        fs = self.flat_split(split)
        owner = np.repeat(np.arange(self.num_clients), fs.sizes)
        rows = np.concatenate([np.zeros(0, np.int64)] + [o + np.arange(n) for o, n in
                                                         zip(fs.offsets, fs.sizes)])
        x, y = fs.take(rows)
        return x, y, torch.from_numpy(owner.astype(np.int64))

    def flat_split(self, split: str, device: torch.device | str | None = None) -> StoreSplit:
        """Lazy flat access to one split (what ModelProblem reads minibatches through);
        batches are copied to ``device`` (default: CPU)."""
        return StoreSplit(self, split, device)

    def to_memory(self) -> FederatedDataset:
        """The same clients as an in-memory FederatedDataset."""
        return FederatedDataset(*(tuple(getattr(self, f)) for f in FIELDS),
                                client_ids=tuple(self.client_ids), num_classes=self.num_classes,
                                description=self.description, meta=dict(self.meta))

    # queries shared with FederatedDataset (they only use the attributes above)
    index_of = FederatedDataset.index_of
    client = FederatedDataset.client
    split_clients = FederatedDataset.split_clients
    summary = FederatedDataset.summary
    _check_split = staticmethod(FederatedDataset._check_split)

    def __repr__(self) -> str:
        return f"StoreDataset({self.store.path}: {self.summary()})"


class StoreSplit:
    """One split of a store view as (lazy) flat rows: the interface ModelProblem uses —
    ``sizes``/``offsets`` per client position, ``take(global rows)``, ``gather``, ``padded``."""

    def __init__(self, ds: StoreDataset, split: str,
                 device: torch.device | str | None = None) -> None:
        ds._check_split(split)
        self.device = torch.device("cpu" if device is None else device)
        off = ds.store.offsets[split]
        self.ds, self.split = ds, split
        if ds._pos is None:  # the whole store: views, no O(M) copies
            self.sizes, self.offsets = ds.store.sizes(split), off[:-1]
        else:
            self.sizes = (off[ds._pos + 1] - off[ds._pos]).astype(np.int64)
            self.offsets = off[ds._pos].astype(np.int64)
        self._empty = int(off[-1]) == 0
        self._xshape = tuple(ds.store.fields[f"{split}_x"].shape[1:])

    def take(self, idx: Tensor | np.ndarray) -> tuple[Tensor, Tensor]:
        """``(x, y)`` of the given global rows (any index shape), on the device."""
        idx = np.asarray(idx, dtype=np.int64)
        if self._empty:  # only padding rows are asked for in an all-empty split
            x = self.ds._decode(f"{self.split}_x", np.zeros(0, dtype=np.int64))
            x = torch.zeros((*idx.shape, *self._xshape), dtype=x.dtype)
            y = torch.zeros(idx.shape, dtype=torch.int64)
        else:
            flat = idx.reshape(-1)
            x = self.ds._decode(f"{self.split}_x", flat)
            y = self.ds._decode(f"{self.split}_y", flat)
            x, y = x.reshape(*idx.shape, *x.shape[1:]), y.reshape(*idx.shape, *y.shape[1:])
        if self.device.type != "cpu":
            x, y = x.to(self.device), y.to(self.device)
        return x, y

    def gather(self, m: int, idx: np.ndarray) -> tuple[Tensor, Tensor]:
        return self.take(self.offsets[m] + np.asarray(idx, dtype=np.int64))

    def padded(self, cohort: np.ndarray, batches, b: int) -> tuple[Tensor, Tensor]:
        from partialfl.problems.model import padded_rows

        idx, mask = padded_rows(self.offsets, self.sizes, cohort, batches, b)
        return idx, (mask if self.device.type == "cpu" else mask.to(self.device))
