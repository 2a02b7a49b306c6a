"""What a SuperNode's DP policy asks of the run's algorithm (:mod:`partialfl.flower.node`):
the local-DP wrapper in its chain, the noise multiplier its clients add, and whether a round
is within the DP budget — asked before the node computes or records anything."""

from __future__ import annotations

import math
from collections.abc import Iterator

from partialfl.algorithms.dp import DifferentiallyPrivate


def _dp_chain(algorithm) -> Iterator[DifferentiallyPrivate]:
    """The DP wrappers of ``algorithm``'s chain of wrappers, outermost first."""
    alg = algorithm
    while alg is not None:
        if isinstance(alg, DifferentiallyPrivate):
            yield alg
        alg = getattr(alg, "base", None)


def local_dp(algorithm) -> DifferentiallyPrivate | None:
    """The local-DP wrapper in ``algorithm``'s chain, or None: its clients then send nothing
    but their noised updates (a SuperNode withholds its evaluation sums)."""
    return next((d for d in _dp_chain(algorithm) if d.options.mode == "local"), None)


def local_noise_multiplier(algorithm, num_clients: int) -> float:
    """The noise multiplier z of the local-DP noise ``algorithm``'s clients add to their
    updates (0.0 when no wrapper in its chain is local DP): what a SuperNode's floor
    (``dp-min-noise``) checks; ∞ for an idle wrapper (a stage of 0 rounds: it releases
    nothing, so any floor is met — and it has no plan to read z from)."""
    alg = local_dp(algorithm)
    if alg is None:
        return 0.0
    return math.inf if alg.idle else float(alg.plan(num_clients).update_noise)


def check_round(algorithm, round_: int) -> None:
    """Refuse (:class:`~partialfl.algorithms.dp.PrivacyBudgetError`) a round past the budget
    of any DP wrapper in ``algorithm``'s chain: what every client update checks, asked before
    a SuperNode records the request in its release ledger."""
    for d in _dp_chain(algorithm):
        d.check_budget(round_)
