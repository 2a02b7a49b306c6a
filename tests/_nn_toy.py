"""Tiny models and federated data sets shared by the neural-network tests (fast on a CPU)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from partialfl.data.federated import FederatedDataset


class ToyNet(nn.Module):
    """conv 3×3 (1→4) → ReLU → linear 144→8 → ReLU → [linear 8→8 → ReLU]×2 → linear 8→5
    (8×8 grey input). ``mid`` and ``mid2`` have equal shapes on purpose: with one of them
    personal, a leak of personal values under a global name would be detectable by value."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 8)
        self.mid = nn.Linear(8, 8)
        self.mid2 = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.c1(x)).flatten(1)
        h = torch.relu(self.mid(torch.relu(self.fc1(h))))
        h = torch.relu(self.mid2(h))
        return self.fc(h)


class ToyBNNet(nn.Module):
    """conv 3×3 (1→4) → BatchNorm → ReLU → conv 3×3 (4→4) → BatchNorm → ReLU → linear 64→5
    (8×8 grey input): a CNN with BatchNorm running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.c1(x)))
        h = torch.relu(self.bn2(self.c2(h)))
        return self.fc(h.flatten(1))


def toy_bn_model(seed: int = 0) -> ToyBNNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ToyBNNet()


def toy_model(seed: int = 0) -> ToyNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ToyNet()


def toy_data(num_clients: int = 6, seed: int = 0, sizes=None, classes: int = 5
             ) -> FederatedDataset:
    """Clients with uneven sizes (one with a single example) and client-specific label
    shifts, so personalization matters."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    if sizes is None:
        sizes = rng.integers(5, 30, num_clients)
        sizes[1] = 1
    tx, ty, vx, vy = [], [], [], []
    for m, n in enumerate(sizes):
        for xs, ys, k in ((tx, ty, int(n)), (vx, vy, max(2, int(n) // 3))):
            x = torch.randn(k, 1, 8, 8, generator=g)
            y = ((x[:, 0, :4].sum((1, 2)) > 0).long() * 2 + m) % classes
            xs.append(x)
            ys.append(y)
    return FederatedDataset(tx, ty, vx, vy, [f"c{m}" for m in range(len(sizes))], classes)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a) if a else 0.0


def one_thread():
    """Context for the tests: tiny models run fastest (and robustly on a loaded machine) on
    one torch thread; the previous setting is restored."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(old)

    return ctx()
