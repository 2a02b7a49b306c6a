"""Client sampling rules that a privacy accountant can state.

* ``fixed``: k of the M clients, uniformly without replacement (the runtime's default
  :func:`partialfl.runtime.sync.sample_cohort`, ``generator(seed, "sample", r)``); k = M is
  full participation.
* ``poisson``: every client independently with probability q = k/M: ``generator(seed,
  "sample", r)`` draws u_1, …, u_M ~ U[0, 1) and client m takes part iff u_m < q. The cohort
  size is Binomial(M, q) (mean k, possibly 0).

Both are functions of (seed, round) only, so a run resumes with the same cohorts.
"""

from __future__ import annotations

import numpy as np

from partialfl import rng as prng

SAMPLINGS = ("poisson", "fixed")


def poisson_cohort(seed: int, round_: int, num_clients: int, rate: float) -> np.ndarray:
    """The sorted ids of the clients of round ``round_`` under Poisson sampling with ``rate``
    q ∈ [0, 1] (each client independently with probability q)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"Poisson sampling rate must be in [0, 1], got {rate!r}")
    u = prng.generator(seed, "sample", round_).random(num_clients)
    return np.flatnonzero(u < rate)


def draw_cohort(sampling: str, seed: int, round_: int, num_clients: int,
                clients_per_round: int) -> np.ndarray:
    """Round ``round_``'s cohort under ``sampling`` (one of :data:`SAMPLINGS`) with expected
    size ``clients_per_round`` = k (Poisson rate k/M)."""
    if sampling == "poisson":
        return poisson_cohort(seed, round_, num_clients, clients_per_round / num_clients)
    if sampling == "fixed":
        return sample_cohort(seed, round_, num_clients, clients_per_round)
    raise ValueError(f"unknown client sampling {sampling!r}; allowed: {', '.join(SAMPLINGS)}")


def sample_cohort(seed: int, round_: int, num_clients: int, k: int | None) -> np.ndarray:
    """The clients of round ``round_``: all (k None or = M) or k drawn without replacement."""
    if k is None or k == num_clients:
        return np.arange(num_clients)
    if not isinstance(k, int | np.integer) or not 1 <= k <= num_clients:
        raise ValueError(f"clients_per_round must be in [1, {num_clients}], got {k!r}")
    return np.sort(prng.generator(seed, "sample", round_).choice(num_clients, k, replace=False))
