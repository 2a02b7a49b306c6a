"""Client faults: isolation, non-finite screening, accounting — and fault injection.

Every runtime (synchronous rounds, asynchronous simulated clock, worker processes) treats a
client the same way (the simulator's *message path*, :func:`receive`):

* a client whose computation **raises** (or whose worker process dies) is skipped — unless
  it raised a **data error** (:func:`is_data_error`: a corrupt client store), which stops
  the run: the data are the run's, not the client's;
* a client whose message is refused for privacy (:func:`partialfl.privacy.screen`: a name,
  shape or dtype outside the one channel of each value, a non-finite metric) is skipped;
* a client whose update, weight, extra payload or new client state (w_m, v_m, α_m) holds a
  **non-finite** value is skipped — it is never averaged into θ, its state never kept;
* the server sees only :func:`partialfl.privacy.server_view`.

Skipped clients are counted in a :class:`FaultLog` (written into every JSONL record:
``clients_failed``, ``updates_nonfinite``, ``updates_refused``, ``worker_deaths``) and
logged with the ``partialfl`` logger. The run aborts with :class:`ClientFaultError` only
when the lost fraction exceeds ``max_failure_fraction`` (after ``min_attempts`` client
computations), or at its end when no client computation succeeded (:func:`check_end`).
If no client computation succeeded yet and a whole cohort (every slot,
asynchronously) raised or was refused, the first client error (or privacy refusal) is
re-raised as is: a bug or a bad configuration, not a fault.

:class:`FaultInjector` wraps an algorithm to inject faults at random, derived from
``generator(seed, "fault", round, client)`` (for ``partialfl reproduce faults`` and tests).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialfl import arrays
from partialfl import rng as prng
from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper
from partialfl.privacy import PrivacyError, screen, server_view, values_only
from partialfl.registry import option, register
from partialfl.runtime.clients import RunSetupError, error_text
from partialfl.types import ClientUpdates

log = logging.getLogger("partialfl")


class ClientFaultError(RuntimeError):
    """Too many clients failed: the run is aborted."""


class InjectedFault(RuntimeError):
    """The exception :class:`FaultInjector` raises in a client."""


def is_data_error(err: BaseException | str | None) -> bool:
    """Whether ``err`` is an error of the run's data rather than of a client: a
    :class:`~partialfl.data.store.StoreError` (a client store file missing, truncated or
    holding values it was not written with). It is re-raised, never skipped as a client
    fault: the data are the run's, and skipping would train on a silently shrinking
    federation. (A StoreError exists only once its module is loaded, so the runtime need not
    import the data layer to recognise one.)"""
    layout = sys.modules.get("partialfl.data.store.layout")
    return layout is not None and isinstance(err, layout.StoreError)


_rows_finite = arrays.rows_finite


def _row_norms(v) -> np.ndarray:
    """The Euclidean norm of each row (float64, scaled so that no finite row overflows)."""
    if arrays.is_torch(v) and v.dtype.is_floating_point and v.dtype.itemsize <= 4:
        # torch's own reduction where v lives (no copy to the host; it runs every round in
        # the server): in float32 (25× cheaper than accumulating in float64 on a CPU), and
        # the rows whose float32 norm overflowed or underflowed to 0 again in float64
        # (squares of fp32/16 values cannot overflow it)
        torch = sys.modules["torch"]  # v is a tensor: torch is loaded
        t = v.detach().reshape(v.shape[0], -1)
        if t.shape[1] == 0:
            return np.zeros(t.shape[0])
        n = torch.linalg.vector_norm(t, dim=1, dtype=torch.float32).double().cpu().numpy()
        for i in np.flatnonzero(~(np.isfinite(n) & (n > 0))):
            n[i] = float(torch.linalg.vector_norm(t[i], dtype=torch.float64))
        return np.where(np.isfinite(n), n, np.inf)
    if arrays.is_torch(v):
        a = v.detach().reshape(v.shape[0], -1).double().cpu().numpy()
    else:
        a = np.asarray(v, dtype=np.float64).reshape(np.shape(v)[0], -1)
    if a.shape[1] == 0:
        return np.zeros(a.shape[0])
    m = np.abs(a).max(1)
    safe = np.where((m > 0) & np.isfinite(m), m, 1.0)
    with np.errstate(invalid="ignore", over="ignore"):
        n = safe * np.sqrt(np.einsum("ij,ij->i", a / safe[:, None], a / safe[:, None]))
    return np.where(np.isfinite(m), n, np.inf)


def theta_norm(theta) -> float:
    """‖θ‖ over all leaves (float64; a finite θ's norm overflows only past 1e308)."""
    return float(_row_norms(np.asarray([[float(_row_norms(v.reshape(1, -1))[0])
                                         for v in theta.values()]]))[0])


def nonfinite_leaves(theta) -> list[str]:
    """The leaves of θ holding NaN or ±inf."""
    return [n for n, v in theta.items() if not bool(_rows_finite(v.reshape(1, -1))[0])]


def finite_mask(updates: ClientUpdates) -> np.ndarray:
    """``[k]`` True for the clients whose vectors, weight and extra payload are all finite."""
    ok = np.isfinite(np.asarray(updates.weights, dtype=float))
    for tree in (updates.vectors, *updates.extra.values()):
        for v in tree.values():
            ok &= _rows_finite(v)
    return ok


def _growth_ok(g: Any) -> bool:
    """Whether ``g`` is a growth record as :meth:`FaultLog.server_step` writes it (empty, or
    its five entries with their types: a saved one is compared and formatted later)."""
    if g == {}:
        return True
    num = (int, float)
    return (isinstance(g, dict) and set(g) == {"factor", "where", "to", "client", "norm"}
            and all(type(g[k]) in num and g[k] >= 0 for k in ("factor", "to", "norm"))
            and isinstance(g["where"], str) and type(g["client"]) is int and g["client"] >= 0)


#: client computations before the lost fraction is judged (every runtime, Flower included):
#: one unlucky first cohort never ends a run
MIN_ATTEMPTS = 20


@dataclass
class FaultLog:
    """Counts of client computations and of those lost, with the abort rule."""

    max_failure_fraction: float = 0.5
    min_attempts: int = MIN_ATTEMPTS
    attempted: int = 0
    succeeded: int = 0
    failed: int = 0
    nonfinite: int = 0
    refused: int = 0
    worker_deaths: int = 0
    first_error: BaseException | None = field(default=None, repr=False)
    first_error_text: str = ""
    #: the server step that grew ‖θ‖ most (‖θ_after‖ / max(‖θ_before‖, 1)): factor, where,
    #: its largest update's client and norm
    growth: dict[str, Any] = field(default_factory=dict)
    _norm: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        f = self.max_failure_fraction
        if not (isinstance(f, int | float) and math.isfinite(f) and 0 <= f <= 1):
            raise ValueError(f"max_failure_fraction must be in [0, 1], got {f!r}")

    @property
    def lost(self) -> int:
        return self.failed + self.nonfinite + self.refused + self.worker_deaths

    def record(self) -> dict[str, int]:
        """The counters written into every metrics record."""
        return {"clients_failed": self.failed, "updates_nonfinite": self.nonfinite,
                "updates_refused": self.refused, "worker_deaths": self.worker_deaths}

    @staticmethod
    def check_state(rec: Any) -> dict:
        """``rec`` if it is a :meth:`state` as saved (int counters, the first error's text,
        the growth record), else a ValueError naming what is malformed."""
        if not isinstance(rec, dict):
            raise ValueError(f"fault counters are not a table: {type(rec).__name__}")
        for k, v in rec.items():
            ok = (isinstance(v, str) if k == "first" else _growth_ok(v) if k == "growth"
                  else type(v) is int and v >= 0)
            if not ok:
                raise ValueError(f"fault counter {k!r} is malformed: {v!r:.60}")
        return rec

    def restore(self, rec: dict) -> None:
        self.check_state(rec)
        self.failed = int(rec.get("clients_failed", 0))
        self.nonfinite = int(rec.get("updates_nonfinite", 0))
        self.refused = int(rec.get("updates_refused", 0))
        self.worker_deaths = int(rec.get("worker_deaths", 0))
        self.attempted = int(rec.get("attempted", self.lost))
        self.succeeded = int(rec.get("succeeded", self.attempted - self.lost))
        self.first_error_text = str(rec.get("first", ""))
        self.growth = dict(rec.get("growth", {}))

    def state(self) -> dict[str, Any]:
        return {**self.record(), "attempted": self.attempted, "succeeded": self.succeeded,
                "first": self.first_error_text, "growth": dict(self.growth)}

    def client_error(self, where: str, err: BaseException | str) -> None:
        """Count ``where``'s failed computation (skipped); a data error
        (:func:`is_data_error`) is re-raised instead."""
        if is_data_error(err) or isinstance(err, RunSetupError):
            raise err
        self.attempted += 1
        self.failed += 1
        text = error_text(err)
        if self.first_error is None and not self.first_error_text:
            self.first_error = err if isinstance(err, BaseException) else None
            self.first_error_text = f"{where}: {text}"
        lines = text.strip().splitlines() or [""]
        log.warning("skipping %s: it failed (%s)", where, lines[-1])

    def worker_death(self, where: str, why: str = "died") -> None:
        self.attempted += 1
        self.worker_deaths += 1
        if not self.first_error_text:
            self.first_error_text = f"{where}: its worker process {why}"
        log.warning("skipping %s: its worker process %s", where, why)

    def rejected(self, where: str, n: int, clients=()) -> None:
        self.nonfinite += n
        if not self.first_error_text:
            self.first_error_text = (f"{where}: non-finite update of client(s) "
                                     f"{[int(c) for c in clients][:8]}")
        log.warning("skipping %d update(s) of %s: non-finite values", n, where)

    def server_step(self, where: str, old, theta, updates: ClientUpdates) -> list[str]:
        """After a server step from θ ``old`` to ``theta`` on ``updates``: note how much it
        grew ‖θ‖ (the largest growth, with the client of the step's largest update, names
        the likely cause when the run later fails) and return θ's non-finite leaves
        (divergence)."""
        bad = nonfinite_leaves(theta)
        after = math.inf if bad else theta_norm(theta)
        before = self._norm if self._norm is not None else theta_norm(old)
        self._norm = after
        if len(updates.cohort):
            factor = after / max(before, 1.0)  # (a start from θ = 0 is no growth)
            if factor > self.growth.get("factor", 1.0):
                norms = _row_norms(np.stack([_row_norms(v) for v in
                                             updates.vectors.values()], 1))
                i = int(np.argmax(norms))
                self.growth = {"factor": factor, "where": where, "to": after,
                               "client": int(updates.cohort[i]), "norm": float(norms[i])}
        return bad

    def growth_text(self, owner: str = "") -> str:
        """The server step that grew ‖θ‖ most, if it grew it 1000× (else ""): the likely
        cause when honest clients fail after it. ``owner``: where its client lives."""
        g = self.growth
        if g.get("factor", 1.0) < 1e3:
            return ""
        return (f"‖θ‖ grew ×{g['factor']:.3g} (to {g['to']:.3g}) at {g['where']}, whose "
                f"largest update came from client {g['client']}{owner} (norm {g['norm']:.3g})")

    def cause(self) -> str:
        """The first fault, and the server step that grew ‖θ‖ most if it grew it 1000×."""
        parts = [self.first_error_text] if self.first_error_text else []
        parts += [t] if (t := self.growth_text()) else []
        return "; ".join(parts) or "no client error recorded"

    def diverged(self, where: str, bad: list[str]) -> str:
        """Warn that θ is not finite after the server step of ``where`` (leaves ``bad``)."""
        msg = (f"the run diverged: θ is not finite after the server step of {where} (leaves "
               f"{bad[:4]}); the run stops there (lower the step sizes); {self.cause()}")
        log.error("%s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return msg

    def refuse(self, where: str, n: int, why: str) -> None:
        """``n`` clients' messages refused for privacy (:func:`partialfl.privacy.screen`)."""
        self.refused += n
        if self.first_error is None and not self.first_error_text:
            self.first_error = PrivacyError(why)
            self.first_error_text = f"{where}: {why}"
        log.warning("skipping %d update(s) of %s: refused (%s)", n, where, why)

    def raise_if_systematic(self, n: int) -> None:
        """Before any client computation succeeded, ``n`` or more raising or refused ones (a
        whole cohort, every slot) are a bug or a bad configuration, not faults: re-raise the
        first error as is."""
        if self.succeeded == 0 and self.failed + self.refused >= n and \
                self.first_error is not None:
            raise self.first_error

    def check(self) -> None:
        """Abort (see the module docstring) when too many client computations were lost."""
        if self.attempted < self.min_attempts or self.lost <= self.max_failure_fraction * \
                self.attempted:
            return
        if self.succeeded == 0 and self.first_error is not None:
            raise self.first_error
        raise ClientFaultError(
            f"{self.lost} of {self.attempted} client computations were lost "
            f"({self.failed} raised, {self.nonfinite} non-finite, {self.refused} refused, "
            f"{self.worker_deaths} worker deaths), more than "
            f"max_failure_fraction={self.max_failure_fraction}; first: {self.cause()}")


def check_end(faults: FaultLog) -> None:
    """At the end of a run: one whose every client computation was lost (fewer than
    ``min_attempts``, so :meth:`FaultLog.check` never judged it) trained nothing, and is not
    reported as finished: the first client error is re-raised, else :class:`ClientFaultError`
    (unless ``max_failure_fraction`` is 1: every loss tolerated, as :meth:`FaultLog.check`)."""
    if faults.attempted == 0 or faults.succeeded > 0 or faults.max_failure_fraction >= 1.0:
        return
    _none_succeeded(faults)


def check_stalled(faults: FaultLog, waiting: bool = False) -> None:
    """The asynchronous loop counts server steps, so a run whose every job is lost would draw
    jobs forever (even where ``max_failure_fraction = 1`` tolerates every loss): after
    ``min_attempts`` client computations of which none succeeded, it ends as
    :func:`check_end` does — unless it is still ``waiting`` for a job of a client that has
    not failed (a fast-failing client, relaunched over and over, never decides alone while
    slower clients are computing)."""
    if faults.succeeded == 0 and faults.attempted >= faults.min_attempts and not waiting:
        _none_succeeded(faults)


def _none_succeeded(faults: FaultLog) -> None:
    if faults.first_error is not None:
        raise faults.first_error
    raise ClientFaultError(
        f"none of the {faults.attempted} client computations succeeded ({faults.failed} "
        f"raised, {faults.nonfinite} non-finite, {faults.refused} refused, "
        f"{faults.worker_deaths} worker deaths): θ never moved; first: {faults.cause()}")


def receive(result: ClientResult, state, algorithm, faults: FaultLog, where: str,
            systematic: int | None = None) -> tuple[ClientResult | None, np.ndarray]:
    """The simulator's message path for one cohort's result: privacy screening, non-finite
    screening (both counted in ``faults``), then the server's view. Returns ``(result with
    the kept clients only, or None if none is left; kept positions)``. A refusal of
    ``systematic`` (default: the whole message) or more clients before any client passed
    re-raises the :class:`~partialfl.privacy.PrivacyError` (see the module docstring)."""
    # what is screened is what the server gets, every tree in θ's order
    sent = up = values_only(result.updates, state.theta)
    k = len(up.cohort)
    if k == 0:  # nothing was sent
        return None, np.arange(0)
    faults.attempted += k
    ok, why = screen(up, state.theta, algorithm)
    if not ok.all():
        faults.refuse(where, int((~ok).sum()), why)
        faults.raise_if_systematic(k if systematic is None else systematic)
        up = up.select(np.flatnonzero(ok)) if ok.any() else up
    fin = finite_mask(up) if ok.any() else np.zeros(0, dtype=bool)
    if result.client_state is not None and fin.size:  # a NaN personal state is never kept
        rows = np.flatnonzero(ok)
        for v in result.client_state.values():
            fin &= _rows_finite(arrays.take_rows(v, rows))
    if not fin.all():
        faults.rejected(where, int((~fin).sum()), np.asarray(up.cohort)[~fin])
    keep = np.flatnonzero(ok)[fin]
    faults.succeeded += len(keep)
    if len(keep) == 0:
        return None, keep
    cs = result.client_state
    if len(keep) < k:
        up = sent.select(keep)
        if cs is not None:
            cs = {n: v[keep] for n, v in cs.items()}
    return ClientResult(server_view(up, algorithm), cs), keep


# --------------------------------------------------------------------------- injection
FAULT_KINDS = ("raise", "nan", "die")


class FaultInjector(AlgorithmWrapper):
    """Injects faults into ``base``'s client computations: each (round, client) fails with
    probability ``rate`` (``generator(seed, "fault", round, client)``), with a kind drawn
    uniformly from ``kinds``: ``raise`` (:class:`InjectedFault`), ``nan`` (the update is NaN)
    or ``die`` (the worker process exits; outside a worker process it raises instead).
    ``at`` fixes faults by hand: ``{(round, client): kind}`` (client None: any client of
    that round; the asynchronous runtimes' round is the job number). ``faults_at(round,
    client)`` says which fault (or None) hits that computation."""

    def __init__(self, base, rate: float = 0.0, kinds: tuple[str, ...] = ("raise", "nan"),
                 seed: int = 0, at: dict | None = None) -> None:
        super().__init__(base)
        if not (0 <= rate <= 1):
            raise ValueError(f"fault rate must be in [0, 1], got {rate!r}")
        at = dict(at or {})
        bad = sorted(set(kinds) - set(FAULT_KINDS)) + sorted(set(at.values()) -
                                                             set(FAULT_KINDS))
        if bad or not kinds:
            raise ValueError(f"unknown fault kinds {bad}; allowed: {', '.join(FAULT_KINDS)}")
        self.rate, self.kinds, self.seed, self.at = float(rate), tuple(kinds), int(seed), at
        self.name = base.name

    def faults_at(self, round_: int, client: int) -> str | None:
        for key in ((int(round_), int(client)), (int(round_), None)):
            if key in self.at:
                return self.at[key]
        if self.rate == 0:
            return None
        g = prng.generator(self.seed, "fault", int(round_), int(client))
        hit, pick = g.random(), g.integers(len(self.kinds))
        return self.kinds[pick] if hit < self.rate else None

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        kinds = [self.faults_at(ctx.round, m) for m in cohort]
        for m, kind in zip(cohort, kinds):
            if kind == "die" and _in_worker():
                os._exit(3)
            if kind in ("raise", "die"):
                raise InjectedFault(f"injected {kind} fault in client {int(m)}, round "
                                    f"{ctx.round}")
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        bad = [i for i, kind in enumerate(kinds) if kind == "nan"]
        if not bad:
            return res
        vec = {}
        for n, v in res.updates.vectors.items():
            v = arrays.copy(v) if arrays.is_torch(v) else np.array(v, dtype=float, copy=True)
            v[bad] = float("nan")
            vec[n] = v
        u = res.updates
        return ClientResult(ClientUpdates(vec, u.weights, u.cohort, u.grad_evals, u.metrics,
                                          u.extra), res.client_state)


def _in_worker() -> bool:
    from partialfl.runtime.pool import in_worker

    return in_worker()


class DropClients(AlgorithmWrapper):
    """Fault-free reference: ``base`` with the updates of the (round, client) pairs in
    ``drop`` removed before they are sent — the run a faulty run must equal when its lost
    updates are exactly these (``partialfl reproduce faults``)."""

    def __init__(self, base, drop) -> None:
        super().__init__(base)
        self.drop = {(int(r), int(m)) for r, m in drop}

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        keep = np.asarray([i for i, m in enumerate(cohort)
                           if (int(ctx.round), int(m)) not in self.drop], dtype=np.int64)
        if len(keep) == len(cohort):
            return res
        cs = res.client_state
        return ClientResult(res.updates.select(keep),
                            None if cs is None else {n: v[keep] for n, v in cs.items()})


@dataclass(frozen=True)
class FaultOptions:
    """Injected client faults (testing the runtimes; ``partialfl reproduce faults``)."""

    rate: float = option(0.1, "probability that a client computation fails, in [0, 1]")
    kinds: tuple[str, ...] = option(("raise", "nan"), "what a failure does: raise, nan, die")

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, int | float) and 0 <= self.rate <= 1):
            raise ValueError(f"rate must be in [0, 1], got {self.rate!r}")
        bad = sorted(set(self.kinds) - set(FAULT_KINDS))
        if bad or not self.kinds:
            raise ValueError(f"unknown fault kinds {bad}; allowed: {', '.join(FAULT_KINDS)}")


@register("wrapper", "faults", options=FaultOptions, block="faults")
def _faults(opts: FaultOptions, ctx) -> FaultInjector:
    """Injects faults into client computations at random (seeded per round and client)."""
    return FaultInjector(ctx.base, opts.rate, tuple(opts.kinds), ctx.seed)
