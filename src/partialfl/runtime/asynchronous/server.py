"""The server side of the asynchronous runtime (Algorithm 3), shared by every transport:
sampling among idle clients, applying each update as it arrives with its staleness, the event
log, evaluation cadence and fault counting (:class:`AsyncServer`), the run's result and its
checkpoint (:class:`AsyncCheckpoint`: the jobs in flight are sent again on resume)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialfl import rng as prng
from partialfl.aggregation.common import ZeroWeightsError
from partialfl.algorithms.base import Algorithm, RoundContext, ServerState, skipped_step
from partialfl.runtime.checkpoint import Checkpoint
from partialfl.runtime.faults import FaultLog, receive
from partialfl.runtime.logging import base_record
from partialfl.runtime.resume_check import CheckpointError
from partialfl.types import ClientUpdates, Params


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
                 record_events: bool = True, max_failure_fraction: float = 0.5,
                 mode=None) -> None:
        M = problem.num_clients
        if not (isinstance(concurrency, int | np.integer) and 1 <= concurrency <= M):
            raise ValueError(f"concurrency must be an integer in [1, {M}] (number of "
                             f"clients), got {concurrency!r}")
        if not (isinstance(eval_every, int | np.integer) and eval_every >= 1):
            raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
        self.problem, self.algorithm, self.concurrency = problem, algorithm, int(concurrency)
        self.seed, self.evaluate, self.eval_every, self.logger = seed, evaluate, eval_every, logger
        self.mode = mode  # the executor's kernel mode, in every RoundContext
        theta0 = theta0 if theta0 is not None else problem.init_theta(prng.generator(seed, "init"))
        self.state = algorithm.init(problem, theta0)
        self.client_state = algorithm.init_client_state(problem)
        self.busy = np.zeros(M, dtype=bool)
        self.num_examples = problem.num_examples(np.arange(M))
        self.next_job = 0
        #: clients whose job was lost while none succeeded (see check_stalled)
        self.failed_clients: set[int] = set()
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

    def context(self, round_: int) -> RoundContext:
        """The :class:`RoundContext` of job (or server round) ``round_``."""
        return RoundContext(self.seed, round_, self.mode)

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
        return self.state, cs, self.context(job.job)

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
        if self.faults.succeeded == 0:
            self.failed_clients.add(int(job.client))
        if self.record_events:
            self.events.append(("lost", float(time), job.job, job.client, job.slot,
                                self.state.round))
        self.faults.check()

    def arrive(self, job: Job, result, time: float) -> bool:
        """Apply the update of ``job`` (a ClientResult) now, recording its staleness; a
        message rejected by :func:`receive` is counted as lost (returns False). A step a
        weighing rule cannot take (weights summing to 0) is skipped (warned, θ stays) and
        counted as a server step, as in a synchronous round."""
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
        where = f"client {job.client} (job {job.job})"
        try:
            self.state = self.algorithm.server_update(self.state, up,
                                                      self.context(self.arrivals))
        except ZeroWeightsError as e:
            # nothing to average: skipped and counted as a synchronous round is (a run of
            # clients without examples would otherwise draw jobs forever)
            warnings.warn(f"{where}: {e}; its server step is skipped (θ stays)",
                          RuntimeWarning, stacklevel=2)
            self.state = skipped_step(old)
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
                                     self.client_state, self.context(self.state.round)))
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
        try:
            rows = clients["rows"]
            if len(rows) != len(body["jobs"]):
                raise ValueError("one client part per job")
            jobs = [(Job(*j), st, cs) for (j, st), cs in zip(body["jobs"], rows)]
            snap, client_state = body["server"], clients["client_state"]
        except (TypeError, KeyError, ValueError, IndexError):
            raise CheckpointError(f"checkpoint {self.path}: the jobs in flight and the "
                                  "client-side part are malformed or do not match") from None
        if self.extra is not None:
            self.extra.restore(saved.extra or {})
        return snap, client_state, jobs


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
