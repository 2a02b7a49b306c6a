"""Asynchronous training on a simulated clock (the paper's Algorithm 3).

``concurrency`` clients are active at any time. Each active client computes its update from
the θ it received (``algorithm.client_update`` on a cohort of one, with
``RoundContext(seed, job)``); when it finishes, the server applies the update at once
(``algorithm.server_update``) and hands the free slot to a newly sampled client, uniformly
among the clients not currently active (``generator(seed, "sample", job)``). With
``concurrency = M`` every client restarts as soon as it finishes.

Compute times come from a :class:`ComputeTimeModel`: a per-job distribution (one for all
clients, or one per client), an optional per-example distribution summed over the client's
examples, and a per-client device speed (time = work / speed), each drawn from
``generator(seed, "compute-time", job)``. Distributions: constant, exponential, half-normal,
log-normal, Pareto.

The *staleness* (delay) of an applied update is the number of server steps (changes of
``state.round``) between the moment its client received θ and the moment it arrived. It is
recorded for every arrival, and the event log lists every dispatch and arrival in order, so
delays can be recounted independently. The loop is written once, :func:`drive`, over a
transport (:class:`AsyncTransport`): :class:`SimulatedClock` here, worker processes in
:mod:`partialfl.runtime.processes`; the bookkeeping is :class:`AsyncServer`.

Faults (:mod:`partialfl.runtime.faults`): a client that raises, or whose update is not
finite, is skipped and counted (event ``lost``, counters in every record), its slot goes to
a newly sampled client at once; the run aborts only past ``max_failure_fraction``.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from partialfl import io as pio
from partialfl import rng as prng
from partialfl.algorithms.base import Algorithm, RoundContext, ServerState
from partialfl.runtime.checkpoint import Checkpoint, run_fingerprint
from partialfl.runtime.faults import ClientFaultError, FaultLog, receive
from partialfl.runtime.logging import base_record
from partialfl.runtime.sync import sample_cohort
from partialfl.types import ClientUpdates, Params

DISTRIBUTIONS = ("constant", "exponential", "half-normal", "log-normal", "pareto")


@dataclass(frozen=True)
class Distribution:
    """A non-negative duration distribution.

    * ``constant``: always ``scale``;   * ``exponential``: mean ``scale``;
    * ``half-normal``: scale·|N(0, 1)|;  * ``log-normal``: scale·exp(shape·N(0, 1));
    * ``pareto``: scale·(1 + Lomax(shape)), i.e. Pareto with minimum ``scale`` and tail index
      ``shape`` (heavy-tailed; infinite mean for shape ≤ 1).
    """

    kind: str = "constant"
    scale: float = 1.0
    shape: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {self.kind!r}; allowed: "
                             f"{', '.join(DISTRIBUTIONS)}")
        if not (isinstance(self.scale, int | float) and self.scale >= 0
                and math.isfinite(self.scale)):
            raise ValueError(f"{self.kind} distribution: scale must be finite and >= 0, "
                             f"got {self.scale!r}")
        if not (isinstance(self.shape, int | float) and self.shape > 0
                and math.isfinite(self.shape)):
            raise ValueError(f"{self.kind} distribution: shape must be finite and > 0, "
                             f"got {self.shape!r}")

    def sample(self, rng: np.random.Generator, size: int | None = None):
        """One draw (``size=None``) or ``size`` draws from the distribution with ``rng``."""
        k, s = self.kind, self.scale
        if k == "constant":
            return s if size is None else np.full(size, float(s))
        if k == "exponential":
            return rng.exponential(s, size)
        if k == "half-normal":
            return s * np.abs(rng.standard_normal(size))
        if k == "log-normal":
            return s * np.exp(self.shape * rng.standard_normal(size))
        return s * (1.0 + rng.pareto(self.shape, size))

    def mean(self) -> float:
        """The distribution's mean (inf for a Pareto shape ≤ 1)."""
        k, s = self.kind, self.scale
        if k in ("constant", "exponential"):
            return float(s)
        if k == "half-normal":
            return s * math.sqrt(2 / math.pi)
        if k == "log-normal":
            return s * math.exp(self.shape**2 / 2)
        return math.inf if self.shape <= 1 else s * self.shape / (self.shape - 1)


def device_speeds(num_clients: int, dist: Distribution, seed: int) -> np.ndarray:
    """Per-client device speeds drawn from ``dist`` (``generator(seed, "device-speed")``)."""
    v = np.asarray(dist.sample(prng.generator(seed, "device-speed"), num_clients), dtype=float)
    if not (v > 0).all():
        raise ValueError(f"device speeds must be positive; {dist} produced {v.min()}")
    return v


@dataclass(frozen=True)
class ComputeTimeModel:
    """duration(m) = (X + Σ_{i ≤ n_m} E_i) / speed_m with X ~ ``per_job`` (or
    ``per_job[m]``), E_i ~ ``per_example`` (omitted if None) and n_m the number of examples
    of client m; ``speed`` defaults to 1 for every client."""

    per_job: Distribution | tuple[Distribution, ...] = Distribution("constant", 1.0)
    per_example: Distribution | None = None
    speed: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        pj = self.per_job
        if not isinstance(pj, Distribution):
            pj = tuple(pj)
            if not pj or not all(isinstance(d, Distribution) for d in pj):
                raise TypeError("per_job must be a Distribution or a sequence of them "
                                "(one per client)")
            object.__setattr__(self, "per_job", pj)
        if self.per_example is not None and not isinstance(self.per_example, Distribution):
            raise TypeError(f"per_example must be a Distribution or None, "
                            f"got {self.per_example!r}")
        if self.speed is not None:
            sp = tuple(float(v) for v in np.asarray(self.speed, dtype=float).reshape(-1))
            if not all(v > 0 and math.isfinite(v) for v in sp):
                raise ValueError("device speeds must be positive and finite")
            object.__setattr__(self, "speed", sp)

    def check(self, num_clients: int) -> None:
        """Raise if a per-client table does not have one entry per client."""
        for name, v in (("per_job", self.per_job), ("speed", self.speed)):
            if isinstance(v, tuple) and len(v) != num_clients:
                raise ValueError(f"compute-time model has {len(v)} {name} entries for "
                                 f"{num_clients} clients")

    def duration(self, client: int, num_examples: float, rng: np.random.Generator) -> float:
        """The compute time of one job of ``client`` on ``num_examples`` examples."""
        d = self.per_job[client] if isinstance(self.per_job, tuple) else self.per_job
        work = float(d.sample(rng))
        if self.per_example is not None:
            work += float(np.sum(self.per_example.sample(rng, int(num_examples))))
        return work / (self.speed[client] if self.speed is not None else 1.0)

    def is_deterministic(self) -> bool:
        """Whether every distribution of the model is constant (no randomness in durations)."""
        dists = self.per_job if isinstance(self.per_job, tuple) else (self.per_job,)
        if self.per_example is not None:
            dists = (*dists, self.per_example)
        return all(d.kind == "constant" for d in dists)

    def job_duration(self, seed: int, job: int, client: int, num_examples: float) -> float:
        """The duration of asynchronous job ``job`` (``generator(seed, "compute-time", job)``,
        not even built when every distribution is constant)."""
        rng = None if self.is_deterministic() else prng.generator(seed, "compute-time", job)
        return self.duration(client, num_examples, rng)


def synchronous_round_times(compute_time: ComputeTimeModel, problem, rounds: int,
                            clients_per_round: int | None, seed: int) -> np.ndarray:
    """Simulated wall-clock of synchronous rounds ``[rounds + 1]`` (0 first): a round lasts
    as long as its slowest sampled client (cohorts as in :func:`run_rounds`, durations from
    ``generator(seed, "compute-time-sync", round, client)``)."""
    M = problem.num_clients
    compute_time.check(M)
    n = problem.num_examples(np.arange(M))
    t = np.zeros(rounds + 1)
    for r in range(rounds):
        cohort = sample_cohort(seed, r, M, clients_per_round)
        d = max(compute_time.duration(int(m), n[m],
                                      prng.generator(seed, "compute-time-sync", r, int(m)))
                for m in cohort)
        t[r + 1] = t[r] + d
    return t


# ---------------------------------------------------------------------------------------------
# bookkeeping shared by the simulated and the process runtimes


@dataclass(frozen=True)
class Job:
    """One client computation: ``client`` received θ of server round ``version``."""

    job: int
    client: int
    slot: int
    dispatch_time: float
    version: int


#: event-log tuples: (kind, time, job, client, slot, round) where round is the θ version the
#: client received for "dispatch", and the server round *after* applying for "arrive";
#: "lost": the job's client failed or sent a non-finite update (nothing applied).
EVENT_FIELDS = ("event", "time", "job", "client", "slot", "round")


@dataclass
class AsyncRunResult:
    """What an asynchronous run returns: final server state, client states, evaluation records,
    one row per applied update (``steps``), the event log and the wall-clock seconds."""

    state: ServerState
    client_state: Params | None
    history: list[dict] = field(default_factory=list)
    #: per arrival, in order: job, client, slot, dispatch_time, arrival_time, version,
    #: round_before, round_after, staleness (arrays)
    steps: dict[str, np.ndarray] = field(default_factory=dict)
    events: list[tuple] = field(default_factory=list)
    seconds: float = 0.0
    faults: FaultLog | None = None
    diverged: str = ""  # why θ became non-finite after a server step (the run stopped)

    @property
    def staleness(self) -> np.ndarray:
        """The delay τ of every applied update (server steps between its dispatch and arrival)."""
        return self.steps["staleness"]

    def event_dicts(self) -> list[dict]:
        """The event log as dicts with the keys :data:`EVENT_FIELDS`."""
        return [dict(zip(EVENT_FIELDS, e)) for e in self.events]


class AsyncServer:
    """Server side of Algorithm 3 for any driver (simulated clock or real processes)."""

    def __init__(self, problem, algorithm: Algorithm, *, concurrency: int, seed: int,
                 theta0: Params | None, evaluate, eval_every: int, logger,
                 record_events: bool = True, max_failure_fraction: float = 0.5) -> None:
        M = problem.num_clients
        if not (isinstance(concurrency, int | np.integer) and 1 <= concurrency <= M):
            raise ValueError(f"concurrency must be an integer in [1, {M}] (number of "
                             f"clients), got {concurrency!r}")
        if not (isinstance(eval_every, int | np.integer) and eval_every >= 1):
            raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
        self.problem, self.algorithm, self.concurrency = problem, algorithm, int(concurrency)
        self.seed, self.evaluate, self.eval_every, self.logger = seed, evaluate, eval_every, logger
        theta0 = theta0 if theta0 is not None else problem.init_theta(prng.generator(seed, "init"))
        self.state = algorithm.init(problem, theta0)
        self.client_state = algorithm.init_client_state(problem)
        self.busy = np.zeros(M, dtype=bool)
        self.num_examples = problem.num_examples(np.arange(M))
        self.next_job = 0
        self.arrivals = 0
        self.grad_evals = 0
        self.record_events = record_events
        self.events: list[tuple] = []
        self._rows: list[tuple] = []
        self.history: list[dict] = []
        self.time = 0.0
        self.faults = FaultLog(max_failure_fraction)
        self.diverged = ""  # why θ became non-finite (the run stops)
        self._eval(0.0)

    def sample_client(self, job: int) -> int:
        """The client that gets job ``job``: uniform among the idle clients, drawn from (seed,
        "sample", job)."""
        idle = np.flatnonzero(~self.busy)
        if len(idle) == 1:  # concurrency = M: the client that just finished restarts
            return int(idle[0])
        g = prng.generator(self.seed, "sample", job)
        return int(idle[g.choice(len(idle), 1, replace=False)[0]])

    def dispatch(self, slot: int, time: float) -> Job:
        """Sample an idle client for ``slot`` and send it the current θ."""
        jid = self.next_job
        self.next_job += 1
        client = self.sample_client(jid)
        self.busy[client] = True
        job = Job(jid, client, slot, float(time), self.state.round)
        if self.record_events:
            self.events.append(("dispatch", float(time), jid, client, slot, self.state.round))
        return job

    def job_inputs(self, job: Job) -> tuple[ServerState, Params | None, RoundContext]:
        """What the client of a just-dispatched job computes from."""
        cs = None
        if self.client_state is not None:
            cs = {n: v[[job.client]] for n, v in self.client_state.items()}
        return self.state, cs, RoundContext(self.seed, job.job)

    def lost(self, job: Job, time: float, error: BaseException | str | None = None,
             death: bool = False) -> None:
        """``job`` produced nothing usable: its client raised (``error``), its worker died
        (``death``) or (``error`` None) its update was rejected by :func:`receive`. The
        client is freed; nothing is applied. Aborts past the failure fraction."""
        where = f"client {job.client} (job {job.job})"
        if death:
            self.faults.worker_death(where)
        elif error is not None:
            self.faults.client_error(where, error)
        self.busy[job.client] = False
        if self.record_events:
            self.events.append(("lost", float(time), job.job, job.client, job.slot,
                                self.state.round))
        self.faults.check()

    def arrive(self, job: Job, result, time: float) -> bool:
        """Apply the update of ``job`` (a ClientResult) now, recording its staleness; a
        message rejected by :func:`receive` is counted as lost (returns False)."""
        result, _ = receive(result, self.state, self.algorithm, self.faults,
                            f"client {job.client} (job {job.job})", self.concurrency)
        if result is None:
            self.lost(job, time)
            return False
        before = self.state.round
        tau = before - job.version
        up: ClientUpdates = result.updates
        up = ClientUpdates(up.vectors, up.weights, up.cohort, up.grad_evals,
                           {**up.metrics, "staleness": np.array([tau])}, up.extra)
        if result.client_state is not None and self.client_state is not None:
            for n, v in result.client_state.items():
                self.client_state[n][job.client] = v[0]
        old = self.state
        self.state = self.algorithm.server_update(self.state, up,
                                                  RoundContext(self.seed, self.arrivals))
        where = f"client {job.client} (job {job.job})"
        bad = self.faults.server_step(where, old.theta, self.state.theta, up)
        if bad:  # θ is not finite: warn, record, stop (see :func:`drive`)
            self.diverged = self.faults.diverged(where, bad)
        self.busy[job.client] = False
        self.arrivals += 1
        self.grad_evals += int(up.grad_evals)
        self.time = float(time)
        after = self.state.round
        self._rows.append((job.job, job.client, job.slot, job.dispatch_time, float(time),
                           job.version, before, after, tau))
        if self.record_events:
            self.events.append(("arrive", float(time), job.job, job.client, job.slot, after))
        if self.arrivals % self.eval_every == 0 or self.diverged:
            self._eval(time)
        return True

    def snapshot(self) -> dict[str, Any]:
        """The bookkeeping to resume from (client state apart: it stays on the clients)."""
        return {"state": self.state, "busy": self.busy, "next_job": self.next_job,
                "arrivals": self.arrivals, "grad_evals": self.grad_evals,
                "events": list(self.events), "rows": list(self._rows),
                "history": list(self.history), "time": self.time,
                "faults": self.faults.state()}

    def restore(self, snap: dict[str, Any], client_state: Params | None) -> None:
        """Continue from a :meth:`snapshot` (and the clients' state of that moment)."""
        self.state, self.client_state = snap["state"], client_state
        self.busy = np.asarray(snap["busy"], dtype=bool)
        self.next_job, self.arrivals = int(snap["next_job"]), int(snap["arrivals"])
        self.grad_evals, self.time = int(snap["grad_evals"]), float(snap["time"])
        self.events, self._rows = list(snap["events"]), list(snap["rows"])
        self.history = list(snap["history"])
        self.faults.restore(snap["faults"])
        if self.logger is not None:
            for rec in self.history:
                self.logger.log(rec)

    def recent_staleness(self, n: int) -> list[int]:
        """The staleness of the last ``n`` applied updates (arrival order)."""
        return [int(row[-1]) for row in self._rows[-n:]] if n > 0 else []

    def _eval(self, time: float) -> None:
        rec = base_record(self.state.round, self.arrivals, time, self.grad_evals,
                          self.faults.record())
        if self.evaluate is not None:
            rec.update(self.evaluate(self.algorithm, self.state, self.problem,
                                     self.client_state, RoundContext(self.seed,
                                                                     self.state.round)))
        self.history.append(rec)
        if self.logger is not None:
            self.logger.log(rec)

    def result(self, seconds: float) -> AsyncRunResult:
        """The run's :class:`AsyncRunResult` (evaluating the final state if not yet done)."""
        if not self.history or self.history[-1]["step"] != self.arrivals:
            self._eval(self.time)
        names = ("job", "client", "slot", "dispatch_time", "arrival_time", "version",
                 "round_before", "round_after", "staleness")
        cols = list(zip(*self._rows)) if self._rows else [()] * len(names)
        steps = {n: np.asarray(c, dtype=float if "time" in n else np.int64)
                 for n, c in zip(names, cols)}
        return AsyncRunResult(self.state, self.client_state, self.history, steps,
                              self.events, seconds, self.faults, self.diverged)


def _check_budget(steps: int | None, max_time: float | None) -> None:
    if steps is None and max_time is None:
        raise ValueError("give steps (number of applied updates) and/or max_time")
    if steps is not None and not (isinstance(steps, int | np.integer) and steps >= 0):
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if max_time is not None and not (max_time >= 0 and math.isfinite(max_time)):
        raise ValueError(f"max_time must be finite and >= 0, got {max_time!r}")


def _progress(progress, steps, max_time, name):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps if steps is not None else max_time, mininterval=0.5, leave=False,
                desc=progress if isinstance(progress, str) else f"async {name}")


@dataclass(frozen=True)
class Event:
    """What a transport reports: ``done`` (``payload``: the job's ClientResult), ``error``
    (the client raised; ``payload``: the reason), ``death`` (the worker of ``slot`` died;
    ``job`` lost, or None), ``ready`` (a restarted worker of ``slot`` waits for a job) or
    ``wait`` (nothing yet)."""

    kind: str
    slot: int = -1
    job: Job | None = None
    payload: Any = None
    time: float = 0.0
    detail: str = ""  # ``error``: the full traceback, when the transport has one
    busy: float = 0.0  # ``done``: the seconds the job really computed (real transports)


class AsyncTransport(Protocol):
    """How jobs reach clients and results come back (simulated clock, worker processes).

    ``send`` starts ``job`` (duration ``seconds`` of the compute-time model) and returns an
    exception if the client failed at once (None otherwise); ``next(max_time)`` blocks until
    the next :class:`Event`, None when nothing more can happen before ``max_time``;
    ``restart(slot)`` replaces a dead worker (it reports ``ready``)."""

    def start(self) -> None: ...

    def now(self) -> float: ...

    def send(self, job: Job, state: ServerState, client_state: Params | None,
             ctx: RoundContext, seconds: float) -> BaseException | None: ...

    def next(self, max_time: float | None) -> Event | None: ...

    def restart(self, slot: int) -> None: ...

    def resume(self, time: float) -> None: ...

    def close(self) -> None: ...


class AsyncCheckpoint:
    """An asynchronous run's checkpoint at ``path``, a
    :class:`~partialfl.runtime.checkpoint.Checkpoint` (crash-consistent generations,
    safetensors + JSON): the server's bookkeeping and, for every job in flight, the job and
    the server state it was sent; validated against ``fingerprint``. With ``private`` the
    clients' state (and the rows the jobs in flight were sent) go to the client-side file.
    ``extra``: the transport's own bookkeeping, saved with its ``state()`` and given back to
    its ``restore(saved)`` on load (the Flower ServerApp's report: failures, requested
    updates). Tensors are loaded onto ``device`` (see :func:`partialfl.io.decode_state`)."""

    def __init__(self, path, fingerprint: dict | None, private: bool = True,
                 extra=None, device=None) -> None:
        self.codec = Checkpoint(path, fingerprint, kind="async", private=private)
        self.path, self.fingerprint, self.private = self.codec.path, fingerprint, private
        self.extra, self.device = extra, device

    def save(self, server: AsyncServer, inflight: dict[int, tuple]) -> None:
        """Commit the run state as a new generation."""
        jobs = [(tuple(job.__dict__.values()), state) for job, state, _, _ in
                inflight.values()]
        clients = {"client_state": server.client_state,
                   "rows": [cs for _, _, cs, _ in inflight.values()]}
        self.codec.save({"server": server.snapshot(), "jobs": jobs}, clients,
                        extra=None if self.extra is None else self.extra.state(),
                        progress={"arrivals": server.arrivals})

    def load(self):
        """``(snapshot, client_state, [(job, state, client rows)])``, or None if absent."""
        saved = self.codec.load(self.device)
        if saved is None:
            return None
        body, clients = saved.server, saved.client
        if not isinstance(clients, dict) or len(clients.get("rows", ())) != len(body["jobs"]):
            raise pio.FileFormatError(f"checkpoint {self.path}: the client-side part does not "
                                      "match the jobs in flight")
        jobs = [(Job(*j), st, cs) for (j, st), cs in zip(body["jobs"], clients["rows"])]
        if self.extra is not None:
            self.extra.restore(saved.extra or {})
        return body["server"], clients["client_state"], jobs


def drive(server: AsyncServer, transport: AsyncTransport, compute_time: ComputeTimeModel, *,
          steps: int | None, max_time: float | None, progress: bool | str = False,
          checkpoint: AsyncCheckpoint | None = None, checkpoint_every: int = 0,
          resume: bool = False) -> list[float]:
    """The one asynchronous loop (Algorithm 3) over any transport: keep every slot busy with
    a newly sampled client, apply each result the moment it arrives (staleness, counting and
    evaluation cadence in :class:`AsyncServer`), until ``steps`` updates were applied or
    ``max_time`` passed. A client that fails is counted and its slot relaunched; a dead
    worker's job is lost and the slot relaunched once its replacement is ready. Returns the
    ``busy`` seconds of every applied update.

    ``checkpoint``: saved after every ``checkpoint_every``-th applied update and at the end;
    with ``resume`` the run continues from it: the jobs that were in flight are sent again
    with the θ they had received (on the simulated clock the run is then exactly the
    uninterrupted one) and idle slots get new clients."""
    _check_budget(steps, max_time)
    M = server.problem.num_clients

    inflight: dict[int, tuple] = {}  # job id -> (job, state, client rows, ctx) sent

    def send(job, state, cs, ctx):
        d = compute_time.job_duration(server.seed, job.job, job.client,
                                      server.num_examples[job.client])
        err = transport.send(job, state, cs, ctx, d)
        if err is None:
            inflight[job.job] = (job, state, cs, ctx)
        return err

    def launch(slot: int) -> None:
        for _ in range(10 * M + 10):
            job = server.dispatch(slot, transport.now())
            err = send(job, *server.job_inputs(job))
            if err is None:
                return
            server.lost(job, transport.now(), err)
            server.faults.raise_if_systematic(server.concurrency)
        raise ClientFaultError(f"slot {slot}: every client dispatched failed; first: "
                               f"{server.faults.first_error_text}")

    bar = None
    busy: list[float] = []
    try:
        transport.start()
        loaded = checkpoint.load() if resume and checkpoint is not None else None
        if loaded is not None:
            snap, client_state, jobs = loaded
            server.restore(snap, client_state)
            transport.resume(server.time)
            for job, state, cs in sorted(jobs, key=lambda j: j[0].job):
                ctx = RoundContext(server.seed, job.job)
                if (err := send(job, state, cs, ctx)) is not None:
                    server.lost(job, transport.now(), err)
        bar = _progress(progress, steps, max_time, server.algorithm.name)
        if bar is not None and loaded is not None:
            bar.update(server.arrivals if steps is not None else server.time)
        busy_slots = {job.slot for job, _, _, _ in inflight.values()}
        for slot in range(server.concurrency):
            if slot not in busy_slots and (steps is None or server.arrivals < steps):
                launch(slot)  # (a resumed run that had finished launches nothing)
        while steps is None or server.arrivals < steps:
            ev = transport.next(max_time)
            if ev is None:
                break
            if ev.kind == "wait":
                continue
            if ev.job is not None:
                inflight.pop(ev.job.job, None)
            if ev.kind == "ready":
                launch(ev.slot)
                continue
            if ev.kind == "death":
                if ev.job is not None:
                    server.lost(ev.job, ev.time, death=True)
                try:
                    transport.restart(ev.slot)
                except ClientFaultError as e:
                    raise ClientFaultError(f"{e}; first: {server.faults.cause()}"
                                           ) from None
                continue
            if ev.kind == "error":
                server.lost(ev.job, ev.time, ev.payload)
                f = server.faults
                # raising client code in every slot before any success: a bug, not a fault
                # (a network transport's lost replies carry no traceback and do not count)
                if ev.detail and f.succeeded == 0 and f.failed >= server.concurrency:
                    raise RuntimeError(f"every slot's first client failed; first error:\n"
                                       f"{ev.detail}")
            elif server.arrive(ev.job, ev.payload, ev.time):
                busy.append(ev.busy)
                if bar is not None:
                    bar.update(1 if steps is not None else ev.time - bar.n)
                if checkpoint is not None and checkpoint_every and not server.diverged \
                        and server.arrivals % checkpoint_every == 0:
                    checkpoint.save(server, inflight)
            if (steps is not None and server.arrivals >= steps) or server.diverged:
                break
            launch(ev.job.slot)
        if checkpoint is not None and checkpoint_every and not server.diverged:
            checkpoint.save(server, inflight)
    finally:
        if bar is not None:
            bar.close()
        transport.close()
    return busy


class SimulatedClock:
    """The transport of :func:`run_async`: each job is computed when it is sent and arrives
    ``seconds`` later on a simulated clock (ties: by job number)."""

    def __init__(self, problem, algorithm: Algorithm) -> None:
        self.problem, self.algorithm = problem, algorithm
        self.heap: list = []
        self.t = 0.0

    def start(self) -> None:
        """Nothing to start."""

    def now(self) -> float:
        """The simulated time of the last arrival."""
        return self.t

    def send(self, job, state, client_state, ctx, seconds):
        """Compute the job's client update now; it arrives ``seconds`` later."""
        try:
            res = self.algorithm.client_update(state, self.problem, np.asarray([job.client]),
                                               ctx, client_state)
        except Exception as e:  # noqa: BLE001 - a failing client is skipped
            return e
        # dispatch_time: now, or for a job sent again on resume, when it was first sent
        heapq.heappush(self.heap, (job.dispatch_time + seconds, job.job, job, res))
        return None

    def next(self, max_time):
        """The earliest arrival, unless it comes after ``max_time``."""
        if not self.heap or (max_time is not None and self.heap[0][0] > max_time):
            return None
        t, _, job, res = heapq.heappop(self.heap)
        self.t = t
        return Event("done", job.slot, job, res, t)

    def restart(self, slot: int) -> None:
        """Simulated workers never die."""

    def resume(self, time: float) -> None:
        """Continue the clock at ``time`` (jobs sent again keep their dispatch times)."""
        self.t = float(time)

    def close(self) -> None:
        """Nothing to stop."""


def async_server(problem, algorithm: Algorithm, *, concurrency: int, compute_time, seed: int,
                 theta0, evaluate, eval_every: int, logger, record_events: bool,
                 max_failure_fraction: float, checkpoint=None, resume: bool = False,
                 private_checkpoints: bool = True
                 ) -> tuple[AsyncServer, ComputeTimeModel, AsyncCheckpoint | None]:
    """The server side, the compute-time model and the checkpoint (a path → an
    :class:`AsyncCheckpoint` checked against the run's fingerprint) every asynchronous
    runtime starts from."""
    model = compute_time or ComputeTimeModel()
    model.check(problem.num_clients)
    ck = None
    if checkpoint is not None:
        fp = run_fingerprint(problem, algorithm, seed, None,
                             {"concurrency": int(concurrency), "compute_time": model})
        ck = AsyncCheckpoint(checkpoint, fp, private_checkpoints,
                             device=getattr(problem, "device", None))
    resuming = resume and ck is not None and ck.codec.exists()
    server = AsyncServer(problem, algorithm, concurrency=concurrency, seed=seed, theta0=theta0,
                         evaluate=evaluate, eval_every=eval_every,
                         logger=None if resuming else logger,  # restore() replays the log
                         record_events=record_events,
                         max_failure_fraction=max_failure_fraction)
    server.logger = logger
    return server, model, ck


def run_async(
    problem,
    algorithm: Algorithm,
    *,
    steps: int | None = None,
    max_time: float | None = None,
    concurrency: int = 1,
    compute_time: ComputeTimeModel | None = None,
    seed: int = 0,
    theta0: Params | None = None,
    evaluate=None,
    eval_every: int = 1,
    logger=None,
    progress: bool | str = False,
    record_events: bool = True,
    max_failure_fraction: float = 0.5,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    private_checkpoints: bool = True,
) -> AsyncRunResult:
    """Run Algorithm 3 on a simulated clock until ``steps`` updates were applied or the next
    arrival would come after ``max_time`` (lost jobs, see the module docstring, do not
    count as steps).

    ``evaluate(algorithm, state, problem, client_state, ctx)`` is logged (with ``step``,
    ``round``, simulated ``time``) before the first and after every ``eval_every``-th arrival
    and at the end. ``checkpoint`` (a path), ``checkpoint_every`` (applied updates),
    ``resume``, ``private_checkpoints``: see :func:`drive` and :class:`AsyncCheckpoint`; a
    resumed run gives the uninterrupted run's θ, records and events.
    """
    _check_budget(steps, max_time)
    t0 = _time.perf_counter()
    server, model, ck = async_server(
        problem, algorithm, concurrency=concurrency, compute_time=compute_time, seed=seed,
        theta0=theta0, evaluate=evaluate, eval_every=eval_every, logger=logger,
        record_events=record_events, max_failure_fraction=max_failure_fraction,
        checkpoint=checkpoint, resume=resume, private_checkpoints=private_checkpoints)
    drive(server, SimulatedClock(problem, algorithm), model, steps=steps, max_time=max_time,
          progress=progress, checkpoint=ck, checkpoint_every=checkpoint_every, resume=resume)
    return server.result(_time.perf_counter() - t0)


def recount_staleness(events: Sequence[tuple]) -> dict[int, int]:
    """Staleness per job recounted from an event log alone: the number of arrivals that
    changed the server round between the job's dispatch and its arrival (log order)."""
    changes = 0
    last_round = None
    at_dispatch: dict[int, int] = {}
    out: dict[int, int] = {}
    for kind, _, job, _, _, rnd in events:
        if kind == "dispatch":
            at_dispatch[job] = changes
            last_round = rnd if last_round is None else last_round
        elif kind == "arrive":
            out[job] = changes - at_dispatch[job]
            if last_round is None or rnd != last_round:
                changes += 1
            last_round = rnd
        elif kind == "lost":
            at_dispatch.pop(job, None)
        else:
            raise ValueError(f"unknown event kind {kind!r}")
    return out
