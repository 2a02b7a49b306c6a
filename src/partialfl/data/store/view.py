"""The dataset view of a client store: :class:`StoreDataset` (FederatedDataset-compatible,
tensors read lazily) and :class:`StoreSplit` (flat rows for
:class:`~partialfl.problems.model.ModelProblem`), opened with :func:`open_store`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from partialfl.data.federated import FederatedDataset
from partialfl.data.store.layout import FIELDS, StoreError
from partialfl.data.store.reader import ClientStore


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
        try:
            return self.raw[p].decode("utf-8")
        except UnicodeDecodeError:
            raise StoreError(f"client id {p} is not UTF-8 (corrupt client_ids.bin)") from None

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
        elif field.endswith("_y") and t.dtype != torch.int64:
            t = t.to(torch.int64)  # what the losses take (a store may hold int32 or uint8)
        elif t.is_floating_point() and t.dtype != torch.float32:
            t = t.to(torch.float32)  # the models' dtype (float16 / float64 stores)
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
        self._xshape = tuple(ds.store.shapes[f"{split}_x"][1:])

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
