"""The container every federated dataset loader returns.

API note (for problem / pipeline code)::

    ds = FederatedDataset(train_x, train_y, test_x, test_y, client_ids, num_classes, description)
    ds = FederatedDataset.from_arrays(train_x, train_y, train_client, test_x, test_y, test_client,
                                      client_ids, num_classes, description)   # group flat arrays
    ds.num_clients                 # M
    ds.train_x[m], ds.train_y[m]   # client m's tensors (m = 0..M-1 is the *position*);
    ds.test_x[m],  ds.test_y[m]    # ds.client_ids[m] is the original id (e.g. a writer string)
    ds.train_sizes(), ds.test_sizes()   # np.int64 [M]
    ds.subset([0, 5, 7])           # a new dataset with those clients, in that order
    seen, new = ds.split_clients(num_new=0.2, seed=0)   # disjoint, e.g. for `evaluate` on new
                                                        # clients never seen in training
    x, y, owner = ds.pooled("test")                      # everything concatenated + owner index
    ds.summary()                   # one line: clients, examples, sizes, description
    ds.meta                        # loader facts, e.g. the pixel mean/std used to normalise

Conventions: ``y`` is int64 with first dimension n (class labels ``[n]``; a text loader may use
``[n, T]`` next-token targets); ``x`` has first dimension n and the same per-example shape and
dtype on every client and in both splits (float32 images ``[n, C, H, W]``, int64 token
sequences ``[n, T]``, ...). A client may have zero test (or train) examples. The dataset is
immutable: ``subset`` / ``split_clients`` return new objects sharing the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from partialfl.rng import generator

Split = Literal["train", "test"]


class DataFormatError(ValueError):
    """A data file exists but is not in the expected format (wrong schema or corrupt)."""


def _as_tensor(a: Tensor | np.ndarray) -> Tensor:
    return a if isinstance(a, Tensor) else torch.from_numpy(np.ascontiguousarray(a))


#: the most classes a dataset may have: the labels are 0 … num_classes − 1 and every model
#: has an output per class (a folder label of 10^15 made the model builder try to allocate
#: petabytes; the largest real tasks here have tens of thousands)
MAX_CLASSES = 2 ** 20


@dataclass(frozen=True, eq=False)
class FederatedDataset:
    """Per-client train and test tensors of a federated data set.

    Attributes:
        train_x, train_y, test_x, test_y: tuples with one tensor per client (position m).
        client_ids: the original client ids (strings), unique, one per position.
        num_classes: number of classes (labels are in ``0..num_classes-1``).
        description: a short human-readable description (source, preprocessing).
        meta: loader-specific facts needed to reproduce the preprocessing on other data
            (e.g. ``{"normalize": "emnist", "pixel_mean": ndarray, "pixel_std": ndarray}``).
    """

    train_x: tuple[Tensor, ...]
    train_y: tuple[Tensor, ...]
    test_x: tuple[Tensor, ...]
    test_y: tuple[Tensor, ...]
    client_ids: tuple[str, ...]
    num_classes: int
    description: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("train_x", "train_y", "test_x", "test_y", "client_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "client_ids", tuple(str(c) for c in self.client_ids))
        m = len(self.client_ids)
        if m == 0:
            raise ValueError("a FederatedDataset needs at least one client")
        for name in ("train_x", "train_y", "test_x", "test_y"):
            if len(getattr(self, name)) != m:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries but there are {m} client_ids"
                )
        if len(set(self.client_ids)) != m:
            dup = sorted({c for c in self.client_ids if self.client_ids.count(c) > 1})
            raise ValueError(f"client_ids must be unique; duplicated: {dup[:5]}")
        if int(self.num_classes) < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if int(self.num_classes) > MAX_CLASSES:
            raise ValueError(
                f"num_classes must be at most {MAX_CLASSES:,}, got {self.num_classes} (labels "
                "that large are damaged data: a model's output layer for them would not fit "
                "in memory)")
        ref_shape, ref_dtype, ref_y = None, None, None
        for split in ("train", "test"):
            xs, ys = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            for i, (x, y) in enumerate(zip(xs, ys)):
                cid = self.client_ids[i]
                if not isinstance(x, Tensor) or not isinstance(y, Tensor):
                    raise TypeError(f"{split} data of client {cid!r} must be torch tensors")
                if y.dtype != torch.int64:
                    raise TypeError(f"{split}_y of client {cid!r} has dtype {y.dtype}; need int64")
                if x.is_floating_point() and not bool(torch.isfinite(x).all()):
                    raise ValueError(f"{split}_x of client {cid!r} has non-finite values (NaN "
                                     "or inf): refused, it would spread into every client "
                                     "through normalisation")
                if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
                    raise ValueError(
                        f"{split} data of client {cid!r}: x {tuple(x.shape)} and y "
                        f"{tuple(y.shape)} must share the first (example) dimension"
                    )
                if ref_y is None:
                    ref_y = tuple(y.shape[1:])
                elif tuple(y.shape[1:]) != ref_y:  # (stacking a cohort's labels fails)
                    raise ValueError(f"{split}_y of client {cid!r} has per-example shape "
                                     f"{tuple(y.shape[1:])}; the first client has {ref_y}")
                if ref_shape is None:
                    ref_shape, ref_dtype = tuple(x.shape[1:]), x.dtype
                elif tuple(x.shape[1:]) != ref_shape or x.dtype != ref_dtype:
                    raise ValueError(
                        f"{split}_x of client {cid!r} has per-example shape {tuple(x.shape[1:])} "
                        f"and dtype {x.dtype}; the first client has {ref_shape}, {ref_dtype}"
                    )
                if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                    raise ValueError(
                        f"{split}_y of client {cid!r} has labels in [{int(y.min())}, "
                        f"{int(y.max())}], outside 0..{self.num_classes - 1}"
                    )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(
        cls,
        train_x: Tensor | np.ndarray,
        train_y: Tensor | np.ndarray,
        train_client: Tensor | np.ndarray,
        test_x: Tensor | np.ndarray,
        test_y: Tensor | np.ndarray,
        test_client: Tensor | np.ndarray,
        client_ids: Sequence[str],
        num_classes: int,
        description: str = "",
        meta: dict[str, Any] | None = None,
    ) -> FederatedDataset:
        """Group flat arrays by their client index (``*_client[i]`` in ``0..len(client_ids)-1``).

        The order of examples inside a client is kept (stable grouping).
        """
        m = len(client_ids)
        out = {}
        for split, x, y, c in (("train", train_x, train_y, train_client),
                               ("test", test_x, test_y, test_client)):
            x, y = _as_tensor(x), _as_tensor(y).to(torch.int64)
            c = np.asarray(c).astype(np.int64).reshape(-1)
            if not (x.shape[0] == y.shape[0] == c.shape[0]):
                raise ValueError(
                    f"{split}: x, y and client arrays have lengths {x.shape[0]}, {y.shape[0]}, "
                    f"{c.shape[0]}; they must be equal"
                )
            if c.size and (c.min() < 0 or c.max() >= m):
                raise ValueError(
                    f"{split}_client has indices in [{c.min()}, {c.max()}], outside 0..{m - 1}"
                )
            order = np.argsort(c, kind="stable")
            bounds = np.searchsorted(c[order], np.arange(m + 1))
            idx = torch.from_numpy(order)
            xs, ys = x[idx], y[idx]
            out[f"{split}_x"] = tuple(xs[bounds[i]:bounds[i + 1]] for i in range(m))
            out[f"{split}_y"] = tuple(ys[bounds[i]:bounds[i + 1]] for i in range(m))
        return cls(client_ids=tuple(client_ids), num_classes=int(num_classes),
                   description=description, meta=dict(meta or {}), **out)

    # ------------------------------------------------------------------ queries
    @property
    def num_clients(self) -> int:
        """Number of clients M."""
        return len(self.client_ids)

    def train_sizes(self) -> np.ndarray:
        """Number of train examples per client, int64 ``[M]``."""
        return np.array([y.shape[0] for y in self.train_y], dtype=np.int64)

    def test_sizes(self) -> np.ndarray:
        """Number of test examples per client, int64 ``[M]``."""
        return np.array([y.shape[0] for y in self.test_y], dtype=np.int64)

    def index_of(self, client_id: str) -> int:
        """Position of the client with original id ``client_id``."""
        try:
            return self.client_ids.index(str(client_id))
        except ValueError:
            raise KeyError(f"unknown client id {client_id!r}") from None

    def client(self, m: int, split: Split = "train") -> tuple[Tensor, Tensor]:
        """``(x, y)`` of the client at position ``m``."""
        self._check_split(split)
        return getattr(self, f"{split}_x")[m], getattr(self, f"{split}_y")[m]

    def pooled(self, split: Split = "train") -> tuple[Tensor, Tensor, Tensor]:
        """All examples of ``split`` concatenated: ``(x, y, owner)`` with owner int64 positions."""
        self._check_split(split)
        xs, ys = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
        owner = torch.cat([torch.full((y.shape[0],), i, dtype=torch.int64)
                           for i, y in enumerate(ys)])
        return torch.cat(xs), torch.cat(ys), owner

    # ------------------------------------------------------------------ derived datasets
    def subset(self, clients: Sequence[int] | np.ndarray | Tensor) -> FederatedDataset:
        """A dataset with the clients at the given positions, in that order (no repeats)."""
        idx = [int(i) for i in np.asarray(clients).reshape(-1)]
        if len(set(idx)) != len(idx):
            raise ValueError("subset: client positions must not repeat")
        bad = [i for i in idx if not 0 <= i < self.num_clients]
        if bad:
            raise IndexError(f"subset: positions {bad[:5]} outside 0..{self.num_clients - 1}")
        return FederatedDataset(
            train_x=tuple(self.train_x[i] for i in idx),
            train_y=tuple(self.train_y[i] for i in idx),
            test_x=tuple(self.test_x[i] for i in idx),
            test_y=tuple(self.test_y[i] for i in idx),
            client_ids=tuple(self.client_ids[i] for i in idx),
            num_classes=self.num_classes,
            description=self.description,
            meta=dict(self.meta),
        )

    def split_clients(
        self, num_new: int | float, seed: int
    ) -> tuple[FederatedDataset, FederatedDataset]:
        """Split the clients at random into two disjoint datasets ``(seen, new)``.

        ``num_new`` is a count (int >= 1) or a fraction in (0, 1) of the clients put in ``new``
        (rounded, at least 1); both parts keep the original relative order of clients. The
        permutation comes from ``partialfl.rng.generator(seed, "split_clients")``.
        """
        m = self.num_clients
        if isinstance(num_new, float) and not isinstance(num_new, bool):
            if not 0.0 < num_new < 1.0:
                raise ValueError(f"fraction num_new must be in (0, 1), got {num_new}")
            k = max(1, int(round(num_new * m)))
        else:
            k = int(num_new)
        if not 1 <= k <= m - 1:
            raise ValueError(f"num_new={num_new} leaves no client on one side (M={m})")
        perm = generator(seed, "split_clients").permutation(m)
        new = np.sort(perm[:k])
        seen = np.sort(perm[k:])
        return self.subset(seen), self.subset(new)

    def client_folds(self, folds: int, seed: int) -> list[np.ndarray]:
        """``folds`` disjoint groups of client positions covering every client once, sizes
        differing by at most one (k-fold over clients: fold k's clients are new clients for
        a model trained on the others). Each group is sorted; the permutation comes from
        ``partialfl.rng.generator(seed, "client_folds")``."""
        m = self.num_clients
        if not isinstance(folds, int | np.integer) or not 2 <= folds <= m:
            raise ValueError(f"folds must be an integer in 2..{m} (the number of clients), "
                             f"got {folds!r}")
        perm = generator(seed, "client_folds").permutation(m)
        return [np.sort(part) for part in np.array_split(perm, int(folds))]

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        """One line: number of clients, examples and per-client sizes, plus the description."""
        tr, te = self.train_sizes(), self.test_sizes()
        feat = tuple(self.train_x[0].shape[1:])
        return (
            f"{self.num_clients} clients, {int(tr.sum())} train / {int(te.sum())} test examples "
            f"(train per client: min {int(tr.min())}, median {int(np.median(tr))}, "
            f"max {int(tr.max())}), x {feat} {self.train_x[0].dtype}, {self.num_classes} classes"
            + (f"; {self.description}" if self.description else "")
        )

    def __repr__(self) -> str:
        return f"FederatedDataset({self.summary()})"

    @staticmethod
    def _check_split(split: str) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
