"""Privacy accounting for client-level DP of θ, with the ``dp-accounting`` library (extra
``dp``: ``pip install 'partialfl[dp]'``).

One round of DP training (:mod:`partialfl.algorithms.dp`) releases a Gaussian-noised sum of
the cohort's clipped updates (clip norm C, noise std z·C). What one round is, as a
``dp_accounting`` event (C drops out: z is noise std over sensitivity):

* ``central`` + ``poisson`` sampling with rate q = k/M, neighbouring data sets differ by one
  client added or removed (sum sensitivity C): the Poisson-subsampled Gaussian mechanism
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (Abadi et al. 2016; Mironov, Talwar, Zhang
  2019).
* ``central`` + ``fixed`` sampling, k of M without replacement, neighbouring data sets differ
  by one client replaced (M public; sum sensitivity ‖ũ − ũ'‖ ≤ 2C):
  ``SampledWithoutReplacementDpEvent(M, k, GaussianDpEvent(z/2))`` (Wang, Balle,
  Kasiviswanathan 2019, Theorem 27; RDP accountant only).
* ``local`` (every client adds N(0, z²C²) to its own clipped update): the Gaussian mechanism
  on one client's message, sensitivity 2C (any two data sets of that client), with no
  amplification by sampling (the server knows who sent what), ``GaussianDpEvent(z/2)``.

R rounds compose as ``SelfComposedDpEvent(event, R)`` (worst case for ``local``: a client
could take part in every round). ε for a given δ comes from the RDP accountant (default;
Mironov 2017) or the PLD accountant (tighter, slower). :func:`solve_noise_multiplier` gives
a z with ε(z) ≤ target (``dp_accounting.calibrate_dp_mechanism``: Brent's method, then a
bisection that guarantees the side meeting the target).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from partialfl.sampling import SAMPLINGS

ACCOUNTANTS = ("rdp", "pld")
#: the smallest noise multiplier :func:`solve_noise_multiplier` searches from, and the smallest
#: one accounted: below it ε is reported ∞ (no meaningful guarantee; the accountants leave
#: their domain there: RDP said ε = 0 at z = 1e-155 and divided by zero at 1e-200, PLD tried
#: to allocate 38 GiB at z = 1e-3)
Z_MIN = 0.05
#: the largest noise multiplier accounted (ε is already 0 to double precision there; the
#: accountants overflow or leave their domain far above it)
Z_MAX = 1e6


def _lib():
    try:
        import dp_accounting
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("differential privacy accounting needs the dp-accounting package: "
                          "pip install 'partialfl[dp]'") from e
    return dp_accounting


@contextlib.contextmanager
def _quiet():
    """Silence the library's absl warnings (RDP orders it drops as not converged)."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True)
class Mechanism:
    """One round of client-level DP as the accountant sees it.

    Attributes:
        noise_multiplier: z, noise std over the clip norm C (on the sum, ``central``; on each
            client's update, ``local``).
        num_clients: M.
        clients_per_round: k, the expected cohort size (Poisson rate q = k/M).
        sampling: ``poisson`` or ``fixed`` (see :mod:`partialfl.sampling`).
        local: each client noises its own update (local DP) instead of the server the sum.
    """

    noise_multiplier: float
    num_clients: int
    clients_per_round: int
    sampling: str = "poisson"
    local: bool = False

    def __post_init__(self) -> None:
        z, M, k = self.noise_multiplier, self.num_clients, self.clients_per_round
        if not 0 <= z <= Z_MAX:
            raise ValueError(f"noise multiplier must be in [0, {Z_MAX:g}], got {z!r}")
        if not 1 <= k <= M:
            raise ValueError(f"clients_per_round must be in [1, num_clients={M}], got {k!r}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"unknown client sampling {self.sampling!r}; allowed: "
                             f"{', '.join(SAMPLINGS)}")

    @property
    def rate(self) -> float:
        """q = k/M."""
        return self.clients_per_round / self.num_clients

    @property
    def neighbours(self) -> str:
        """The neighbouring relation of the guarantee: one client ``add-or-remove`` (Poisson)
        or ``replace`` (fixed-size sampling; local DP: any two data sets of one client)."""
        return "replace" if self.local or self.sampling == "fixed" else "add-or-remove"

    def describe(self) -> str:
        """A one-line statement of the mechanism (for errors and summaries)."""
        where = "local" if self.local else "central"
        return (f"{where} Gaussian z={self.noise_multiplier:.6g}, {self.sampling} sampling "
                f"k={self.clients_per_round} of M={self.num_clients} (q={self.rate:.4g}), "
                f"{self.neighbours} one client")

    def event(self, rounds: int):
        """The ``dp_accounting`` event of ``rounds`` rounds (see the module docstring)."""
        dpa = _lib()
        z = self.noise_multiplier
        if self.local:
            one = dpa.GaussianDpEvent(z / 2)
        elif self.sampling == "poisson":
            one = dpa.PoissonSampledDpEvent(self.rate, dpa.GaussianDpEvent(z))
        else:
            one = dpa.SampledWithoutReplacementDpEvent(
                self.num_clients, self.clients_per_round, dpa.GaussianDpEvent(z / 2))
        return dpa.SelfComposedDpEvent(one, int(rounds))

    def accountant(self, name: str = "rdp"):
        """A fresh ``dp_accounting`` accountant ``name`` with this mechanism's relation."""
        dpa = _lib()
        rel = (dpa.NeighboringRelation.REPLACE_ONE if self.neighbours == "replace"
               else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
        if name == "rdp":
            from dp_accounting.rdp import RdpAccountant

            return RdpAccountant(neighboring_relation=rel)
        if name == "pld":
            if self.sampling == "fixed" and not self.local:
                raise ValueError("the PLD accountant has no fixed-size (without replacement) "
                                 "sampling: use accountant 'rdp' or sampling 'poisson'")
            from dp_accounting.pld import PLDAccountant

            return PLDAccountant(neighboring_relation=rel)
        raise ValueError(f"unknown accountant {name!r}; allowed: {', '.join(ACCOUNTANTS)}")


def epsilon(mech: Mechanism, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """ε of ``rounds`` rounds of ``mech`` at δ = ``delta`` (0 for no round, ∞ for
    z < :data:`Z_MIN`)."""
    return _epsilon(mech, int(rounds), float(delta), accountant)


@lru_cache(maxsize=4096)
def _epsilon(mech: Mechanism, rounds: int, delta: float, accountant: str) -> float:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds!r}")
    if rounds == 0:
        return 0.0
    if mech.noise_multiplier < Z_MIN:
        return math.inf
    with _quiet():
        return float(mech.accountant(accountant).compose(mech.event(rounds))
                     .get_epsilon(delta))


def solve_noise_multiplier(mech: Mechanism, target_epsilon: float, rounds: int,
                           delta: float, accountant: str = "rdp", tol: float = 1e-4
                           ) -> float:
    """A noise multiplier z ≥ :data:`Z_MIN` with ε(z) ≤ ``target_epsilon`` after ``rounds``
    rounds at δ = ``delta``, within ``tol`` of the smallest such z (``mech``'s own z is
    ignored). A target already met at z = Z_MIN gives Z_MIN; ∞ gives 0."""
    if not target_epsilon > 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon!r}")
    if math.isinf(target_epsilon):
        return 0.0
    dpa = _lib()

    def at(z: float) -> Mechanism:
        return replace(mech, noise_multiplier=float(z))

    if epsilon(at(Z_MIN), rounds, delta, accountant) <= target_epsilon:
        return Z_MIN
    with _quiet():
        z = dpa.calibrate_dp_mechanism(
            lambda: at(1.0).accountant(accountant), lambda z: at(z).event(rounds),
            float(target_epsilon), float(delta),
            bracket_interval=dpa.LowerEndpointAndGuess(Z_MIN, max(2 * Z_MIN, 1.0)), tol=tol)
    if not epsilon(at(z), rounds, delta, accountant) <= target_epsilon:  # a target too small
        raise ValueError(f"target epsilon {target_epsilon!r} is out of reach: the accountant "
                         f"gives ε = {epsilon(at(z), rounds, delta, accountant):.3g} at the "
                         f"noise multiplier it settles on (z = {z:.6g})")
    return float(z)
