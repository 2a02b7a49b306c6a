"""How a model problem reads its clients' examples: one split of the data as flat tensors with
per-client offsets (in memory, on the device or pinned on the host; or the data's own lazy
view, e.g. an on-disk store), and the padded index blocks a vectorised call takes."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def chunk_batches(sizes: np.ndarray, j: int, chunk: int) -> list[np.ndarray]:
    """Chunk j (examples [j·chunk, (j+1)·chunk)) of every client; empty past its end."""
    return [np.arange(min(int(n), j * chunk), min(int(n), (j + 1) * chunk)) for n in sizes]


def check_split(split: str) -> str:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split


def flat_split(data, split: str, device: torch.device, on_device: bool | None):
    """The flat view ModelProblem reads: the data's own (lazy, e.g. an on-disk
    :class:`~partialfl.data.store.StoreDataset`, whose batches are copied to ``device``) if it
    offers one, else tensors in memory."""
    own = getattr(data, "flat_split", None)
    if own is not None:
        return own(split, device)
    return FlatSplit(data, split, device, on_device)


def padded_rows(offsets: np.ndarray, sizes: np.ndarray, cohort: np.ndarray, batches, b: int
                ) -> tuple[Tensor, Tensor]:
    """Global row indices ``[k, b]`` of the cohort's minibatches (padding repeats the client's
    first example, or row 0) and the float mask ``[k, b]``."""
    k = len(cohort)
    idx = np.zeros((k, b), dtype=np.int64)
    mask = np.zeros((k, b), dtype=np.float32)
    for i, (m, bi) in enumerate(zip(cohort, batches)):
        base = offsets[m] if sizes[m] > 0 else 0
        idx[i] = base
        if bi is not None and len(bi):
            idx[i, : len(bi)] = base + np.asarray(bi)
            mask[i, : len(bi)] = 1.0
    return torch.from_numpy(idx), torch.from_numpy(mask)


class FlatSplit:
    """One split of a FederatedDataset as flat tensors + per-client offsets.

    On a CPU device the tensors are used in place. On an accelerator they are either moved to
    the device whole (``on_device``; None: when they take under 1 GiB) or kept in pinned host
    memory, and each gathered batch is copied with a non-blocking transfer."""

    DEVICE_BUDGET = 1 << 30

    def __init__(self, data, split: str, device: torch.device | None = None,
                 on_device: bool | None = None) -> None:
        device = torch.device("cpu") if device is None else device
        xs, ys = getattr(data, f"{split}_x"), getattr(data, f"{split}_y")
        self.sizes = np.array([y.shape[0] for y in ys], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.x = torch.cat(list(xs)) if self.sizes.sum() else xs[0][:0]
        self.y = torch.cat(list(ys)) if self.sizes.sum() else ys[0][:0]
        if self.x.shape[0] == 0:  # keep indexing valid for all-empty splits
            self.x = torch.zeros((1, *xs[0].shape[1:]), dtype=xs[0].dtype)
            self.y = torch.zeros((1, *ys[0].shape[1:]), dtype=ys[0].dtype)
        self.device = device
        self.resident = True
        if device.type != "cpu":
            nbytes = sum(t.element_size() * t.numel() for t in (self.x, self.y))
            self.resident = nbytes < self.DEVICE_BUDGET if on_device is None else bool(on_device)
            if self.resident:
                self.x, self.y = self.x.to(device), self.y.to(device)
            elif device.type == "cuda":
                self.x, self.y = self.x.pin_memory(), self.y.pin_memory()

    def take(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Examples at global indices ``idx`` (any shape), on the device."""
        if self.device.type == "cpu":  # index_select: the same copy, a few times faster
            flat = idx.reshape(-1)
            return (self.x.index_select(0, flat).reshape(*idx.shape, *self.x.shape[1:]),
                    self.y.index_select(0, flat).reshape(*idx.shape, *self.y.shape[1:]))
        if self.resident:
            idx = idx.to(self.device, non_blocking=True)
            return self.x[idx], self.y[idx]
        x, y = self.x[idx], self.y[idx]
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def gather(self, m: int, idx: np.ndarray) -> tuple[Tensor, Tensor]:
        return self.take(torch.from_numpy(self.offsets[m] + np.asarray(idx, dtype=np.int64)))

    def padded(self, cohort: np.ndarray, batches, b: int) -> tuple[Tensor, Tensor]:
        """Global indices ``[k, b]`` (on the host) and the float mask ``[k, b]`` (on the
        device); see :func:`padded_rows`."""
        idx, mask = padded_rows(self.offsets, self.sizes, cohort, batches, b)
        if self.device.type != "cpu":
            mask = mask.to(self.device, non_blocking=True)
        return idx, mask


