"""Explicit randomness.

Every random choice is drawn from a generator derived from the run seed and a *purpose path*
(e.g. ``("client", round, cid)``), so results do not depend on the execution backend, the
order in which clients run, or how many clients share a batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator

import numpy as np

_PURPOSES: dict[str, int] = {}


def _purpose_int(p: int | str) -> int:
    if isinstance(p, int | np.integer):
        if p < 0:
            raise ValueError(f"purpose ints must be non-negative, got {p}")
        return int(p)
    h = _PURPOSES.get(p)
    if h is None:
        h = int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "little")
        _PURPOSES[p] = h
    return h


def seed_sequence(seed: int, *path: int | str) -> np.random.SeedSequence:
    """The seed sequence for ``path`` under the run ``seed``."""
    return np.random.SeedSequence([int(seed), *(_purpose_int(p) for p in path)])


def generator(seed: int, *path: int | str) -> np.random.Generator:
    """A numpy generator for one purpose, e.g. ``generator(seed, "client", r, cid)``."""
    return np.random.default_rng(seed_sequence(seed, *path))


def torch_seed(seed: int, *path: int | str) -> int:
    """A 63-bit seed for ``torch.Generator().manual_seed`` for one purpose."""
    return int(seed_sequence(seed, *path).generate_state(1, np.uint64)[0] >> np.uint64(1))


def round_path(round_: int) -> tuple:
    """The rng path component for a round: non-negative rounds as is, negative ones (used
    for deployment / evaluation outside training) as ``("offline", -round_)``."""
    r = int(round_)
    return (r,) if r >= 0 else ("offline", -r)


#: Held while the process-wide torch CPU generator is reseeded and drawn from
#: (:func:`global_torch_seed`): client code run by several threads at once
#: (:mod:`partialfl.runtime.threads`) would otherwise interleave one client's seeding with
#: another client's draws.
TORCH_GLOBAL_RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def global_torch_seed(seed: int, *path: int | str) -> Iterator[None]:
    """Run the block with the global torch CPU generator seeded from ``torch_seed(seed,
    *path)`` (for code that draws from it, e.g. a module's ``reset_parameters``), restore the
    generator afterwards, and hold :data:`TORCH_GLOBAL_RNG_LOCK` meanwhile (thread-safe)."""
    import torch

    with TORCH_GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, *path))
        yield
