"""Per-client state on disk (the client-side state of FedAlt, FedSim, Scaffold, ...).

One memory-mapped ``[M, ...]`` file per state name (created sparse: clients never written use
no disk) plus a "written" flag per client and name; a round reads and writes only its cohort's
rows, so memory is O(cohort) however many clients there are. Rows never written come from
``init_rows(cohort)`` — the initial state is computed lazily, client by client.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from partialfl.arrays import is_torch
from partialfl.data.store import STORE_FORMAT, STORE_VERSION, as_numpy

RowsFn = Callable[[np.ndarray], dict]


class _StateRows:
    """``store[name]``: supports ``rows[cohort]`` (read) and ``rows[cohort] = v`` (write), as
    the runtimes index in-memory client state."""

    def __init__(self, store: ClientStateStore, name: str) -> None:
        self.store, self.name = store, name

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.store.num_clients, *self.store.shapes[self.name])

    def __len__(self) -> int:
        return self.store.num_clients

    def _idx(self, i) -> np.ndarray:
        if isinstance(i, slice):
            return np.arange(*i.indices(self.store.num_clients))
        return np.asarray(i, dtype=np.int64).reshape(-1) if np.ndim(i) else np.asarray([i])

    def __getitem__(self, i):
        out = self.store.get(self._idx(i), names=(self.name,))[self.name]
        return out[0] if np.ndim(i) == 0 and not isinstance(i, slice) else out

    def __setitem__(self, i, v) -> None:
        idx = self._idx(i)
        v = v if np.ndim(i) or isinstance(i, slice) else v[None]
        self.store.put(idx, {self.name: v})


class ClientStateStore:
    """Per-client state rows on disk: one memory-mapped ``[M, ...]`` file per name plus a
    "written" flag per client and name; rows never written come from ``init_rows(cohort)``
    (so an initial state for M clients costs nothing until a client is first sampled).

    ``get(cohort) -> {name: rows [k, ...]}``, ``put(cohort, rows)``; ``store[name][cohort]``
    and ``store[name][cohort] = rows`` do the same per name (the runtimes' indexing).
    Rows come back as torch tensors or numpy arrays, like ``init_rows`` returns them.
    """

    def __init__(self, path: str | Path, num_clients: int, init_rows: RowsFn) -> None:
        self.path = Path(path)
        self.num_clients = int(num_clients)
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.init_rows = init_rows
        probe = init_rows(np.zeros(1, dtype=np.int64))
        self.names = tuple(probe)
        self.torch = {n: is_torch(v) for n, v in probe.items()}
        arrs = {n: as_numpy(v) for n, v in probe.items()}
        self.shapes = {n: tuple(a.shape[1:]) for n, a in arrs.items()}
        self.dtypes = {n: a.dtype.str for n, a in arrs.items()}
        self.path.mkdir(parents=True, exist_ok=True)
        header = {"format": STORE_FORMAT + "/client-state", "version": STORE_VERSION,
                  "num_clients": self.num_clients,
                  "names": {n: {"dtype": self.dtypes[n], "shape": list(self.shapes[n])}
                            for n in self.names}}
        tmp = self.path / f".header.json.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(header))
        os.replace(tmp, self.path / "header.json")
        self._rows, self._written = {}, {}
        for i, n in enumerate(self.names):
            shape = (self.num_clients, *self.shapes[n])
            nbytes = int(np.prod(shape)) * np.dtype(self.dtypes[n]).itemsize
            self._rows[n] = self._open(f"state_{i}.bin", self.dtypes[n], shape, nbytes)
            self._written[n] = self._open(f"written_{i}.bin", "|u1", (self.num_clients,),
                                          self.num_clients)

    def _open(self, name: str, dtype: str, shape: tuple, nbytes: int) -> np.memmap:
        fp = self.path / name
        with open(fp, "wb") as f:  # sparse: no disk used until rows are written
            f.truncate(max(nbytes, 1))
        return np.memmap(fp, dtype=dtype, mode="r+", shape=shape)

    def __getitem__(self, name: str) -> _StateRows:
        if name not in self.names:
            raise KeyError(f"unknown client-state name {name!r}; have {list(self.names)}")
        return _StateRows(self, name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def keys(self):
        return self.names

    def items(self):
        return [(n, self[n]) for n in self.names]

    def _check(self, cohort) -> np.ndarray:
        c = np.asarray(cohort, dtype=np.int64).reshape(-1)
        if c.size and (c.min() < 0 or c.max() >= self.num_clients):
            raise IndexError(f"client positions outside 0..{self.num_clients - 1}")
        return c

    def get(self, cohort, names: Sequence[str] | None = None) -> dict:
        """The current rows of the cohort, ``{name: [k, ...]}`` (fresh copies)."""
        c = self._check(cohort)
        names = self.names if names is None else tuple(names)
        out = {}
        for n in names:
            a = np.array(self._rows[n][c])
            fresh = self._written[n][c] == 0
            if fresh.any():
                a[fresh] = as_numpy(self.init_rows(c[fresh])[n])
            out[n] = torch.from_numpy(a) if self.torch[n] else a
        return out

    def put(self, cohort, rows: dict) -> None:
        """Write the cohort's rows (``{name: [k, ...]}``, any subset of the names)."""
        c = self._check(cohort)
        for n, v in rows.items():
            if n not in self._rows:
                raise KeyError(f"unknown client-state name {n!r}; have {list(self.names)}")
            a = as_numpy(v)
            if a.shape != (len(c), *self.shapes[n]):
                raise ValueError(f"client state {n!r}: rows of shape {a.shape}, expected "
                                 f"{(len(c), *self.shapes[n])}")
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                raise ValueError(f"client state {n!r}: non-finite values")
            self._rows[n][c] = a
            self._written[n][c] = 1

    def __reduce__(self):
        raise TypeError(
            f"the on-disk client state at {self.path} cannot be pickled (e.g. into a run "
            "checkpoint): its rows live in files that keep changing. Run without "
            "checkpoint_every, or keep the client state in memory")

    def flush(self) -> None:
        for n in self.names:
            self._rows[n].flush()
            self._written[n].flush()
