"""Asynchronous mode (the paper's Algorithm 3): :func:`partialfl.runtime.asynchronous.drive`
with :class:`FlowerJobs` as transport.

The spec's ``[asynchronous]`` block: ``concurrency`` single-client tasks are kept in flight;
task j trains a client sampled among the idle ones (``generator(seed, "sample", j)``) at the θ
current when it was sent; replies are applied as they arrive (each checked by
:func:`partialfl.flower.rounds.decode_reply`) by the block's rule — FedAsync (each update,
weighted by its staleness: with FFGG the paper's Algorithm 3) or FedBuff (``buffer`` = K
arrived updates make one server step; :mod:`partialfl.algorithms.asynchronous`). The
staleness (server steps between sending θ and applying the update) of every applied update is
recorded; checkpoints are the loop's own
:class:`~partialfl.runtime.asynchronous.AsyncCheckpoint` in ``out-dir`` (on resume the tasks in
flight are sent again). Flower has no asynchronous strategy; this loop only uses
``push_messages``/``pull_messages``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.algorithms.base import ClientResult, RoundContext, ServerState
from partialfl.flower import checkpoint
from partialfl.flower.config import FlowerConfig, parse_fault_injection
from partialfl.flower.evaluate import evaluate_now
from partialfl.flower.federation import Federation, Link, ServerProblem
from partialfl.flower.report import (
    Failure,
    FlowerRunReport,
    ReportLog,
    ServerStopped,
    check_failures,
    log,
    record_failure,
)
from partialfl.flower.rounds import (
    decode_reply,
    growth_cause,
    shared_entries,
    shared_state,
    train_content,
)
from partialfl.metrics import closed_form_metrics
from partialfl.runtime import resume_check
from partialfl.runtime.asynchronous import (
    AsyncCheckpoint,
    AsyncServer,
    ComputeTimeModel,
    Event,
    drive,
)
from partialfl.runtime.checkpoint import ResumeError

#: the asynchronous mode's checkpoint (pointer) in ``out-dir`` (synchronous mode:
#: :data:`partialfl.flower.checkpoint.SYNC_CHECKPOINT`)
ASYNC_CHECKPOINT = "checkpoint-async.safetensors"


class FlowerJobs:
    """The Flower transport of :func:`partialfl.runtime.asynchronous.drive`: a job is one
    ``train`` message for its client (task number = job number) to the SuperNode holding it;
    replies are pulled as they arrive, a task without a reply within ``round-timeout`` is
    lost. After ``max(10, 3 × concurrency)`` consecutive failed tasks the run stops early
    (``report.stopped``). Its :meth:`state` / :meth:`restore` (the report so far) go into
    the run's :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`. Fault injection
    ``stop:round=R`` stops the ServerApp at the first send after server step R + 1 (after
    that step's checkpoint), as a killed one would."""

    def __init__(self, link: Link, cfg: FlowerConfig, fed: Federation,
                 report: FlowerRunReport, concurrency: int, t0: float,
                 algorithm=None) -> None:
        self.link, self.cfg, self.fed, self.report, self.t0 = link, cfg, fed, report, t0
        self.algorithm = algorithm  # what replies are checked against (declared extras)
        self.inflight: dict[str, tuple] = {}
        self.queue: list = []
        self.streak, self.max_streak = 0, max(10, 3 * concurrency)
        self.failed_clients: set[int] = set()  # clients failed in the current streak
        self.stops = {f.round for f in parse_fault_injection(cfg.fault_injection)
                      if f.kind == "stop"}
        self.server: AsyncServer | None = None  # set by run_async (the step to checkpoint)

    def start(self) -> None:
        """The SuperNodes are up already."""

    def now(self) -> float:
        """Seconds since the ServerApp started."""
        return time.perf_counter() - self.t0

    def send(self, job, state, client_state, ctx, seconds):
        """Push the job's train message (θ it received, its client)."""
        if any(state.round > r for r in self.stops):
            raise ServerStopped(f"injected server stop after server step {state.round}")
        client = np.asarray([job.client], dtype=np.int64)
        node = self.fed.order[int(self.fed.owner[job.client])]
        content = train_content(state.theta, ctx.round, client,
                                shared_state(self.algorithm, state))
        (mid,) = self.link.push([(node, "train", content, ctx.round)])
        if not mid:  # not stored (the SuperNode left): a counted failure of that node now
            record_failure(self.report, job.job, "timeout", self.fed.partition(node), client,
                           "the train message could not be delivered (the SuperNode is gone)")
            self._done(job, None)
            return None
        self.inflight[mid] = (job, node, client, state.theta,
                              time.monotonic() + self.cfg.round_timeout)
        return None

    def _done(self, job, rep) -> None:
        """Queue the outcome of ``job``: its decoded reply, or (None) its counted failure."""
        report = self.report
        report.requested_client_updates += 1
        report.last_round = max(report.last_round, job.job)
        if rep is None:
            self.failed_clients.add(int(job.client))
            self.streak += 1
            self.queue.append(Event("error", job.slot, job, report.failures[-1].reason,
                                    self.now()))
        else:
            self.streak = 0
            self.failed_clients.clear()
            self.queue.append(Event("done", job.slot, job, ClientResult(rep[0]), self.now()))

    def next(self, max_time):
        """The next reply (or lost task); None once too many tasks failed in a row."""
        report = self.report
        while not self.queue:
            if self.streak >= self.max_streak and not any(  # nor a client still computing
                    int(j.client) not in self.failed_clients  # that has not failed
                    for j, *_ in self.inflight.values()):
                check_failures(self.cfg, report, self._cause(), when="stalled")
                report.stopped = (f"{self.streak} consecutive client tasks failed (last: "
                                  f"{report.failures[-1].kind}: {report.failures[-1].reason})")
                log.error("partialfl: async training stopped early: %s", report.stopped)
                return None
            got = self.link.pull(set(self.inflight))
            now = time.monotonic()
            for mid in [m for m, v in self.inflight.items() if m in got or v[4] <= now]:
                job, node, client, theta, _ = self.inflight.pop(mid)
                self._done(job, decode_reply(got.get(mid), theta, client, self.fed, node,
                                             job.job, report, self.algorithm))
            check_failures(self.cfg, report, self._cause())
            if not got and not self.queue:
                time.sleep(self.cfg.poll_interval)
        return self.queue.pop(0)

    def _cause(self) -> str:
        return growth_cause(self.fed, self.server.faults if self.server is not None else None)

    def restart(self, slot: int) -> None:
        """SuperNodes are not restarted by the server."""

    def resume(self, seconds: float) -> None:
        """Continue the clock at ``seconds`` (a resumed run)."""
        self.t0 = time.perf_counter() - seconds

    def state(self) -> dict[str, Any]:
        """The report so far (without the history: the server's records replay it)."""
        rep = self.report
        step = self.server.state.round if self.server is not None else 0
        return {"step": int(step), "failures": [asdict(f) for f in rep.failures],
                "requested": rep.requested_client_updates, "last_round": rep.last_round,
                "streak": self.streak, "eval_withheld": rep.eval_withheld}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue the report of the checkpointed run (checked:
        :func:`partialfl.flower.checkpoint.check_report`)."""
        saved = checkpoint.check_report(saved, ("step", "requested", "streak"),
                                        "asynchronous checkpoint")
        last = saved.get("last_round", -1)
        if type(last) is not int:
            raise checkpoint.CheckpointError("asynchronous checkpoint report has a malformed "
                                             "last_round")
        rep = self.report
        # (this start's discovery failures, the only ones before the restore, are kept)
        rep.failures = [Failure(**f) for f in saved["failures"]] + rep.failures
        rep.requested_client_updates = saved["requested"]
        rep.last_round, self.streak = last, saved["streak"]
        rep.eval_withheld = saved.get("eval_withheld", 0)
        rep.resumed_from = saved["step"]
        log.info("partialfl: resuming from the checkpoint of server step %d in %s",
                 rep.resumed_from, self.cfg.out_dir)

    def close(self) -> None:
        """Tasks still in flight are abandoned (their replies are never pulled)."""


class FlowerAsyncCheckpoint(AsyncCheckpoint):
    """:class:`AsyncCheckpoint` whose :meth:`load` checks everything it read against this
    run (:func:`partialfl.flower.checkpoint.check_async`: ``fresh``, the run's initial
    state, ``num_clients`` and ``concurrency``) and refuses anything else with one line."""

    def __init__(self, path, fingerprint, extra=None, fresh=None, num_clients: int = 0,
                 concurrency: int = 0, max_arrivals: int | None = None) -> None:
        super().__init__(path, fingerprint, private=False, extra=extra)
        self.fresh, self.num_clients, self.concurrency = fresh, num_clients, concurrency
        self.max_arrivals = max_arrivals

    def load(self):
        try:
            loaded = super().load()
        except checkpoint.CheckpointError:
            raise
        except resume_check.CheckpointError as e:
            raise checkpoint.CheckpointError(str(e)) from None
        except ResumeError as e:
            raise checkpoint.CheckpointError(f"refusing to resume: {checkpoint._line(e)}"
                                             ) from None
        except (pio.FileFormatError, OSError, TypeError, ValueError, KeyError) as e:
            raise checkpoint.CheckpointError(
                f"checkpoint {self.path}: {checkpoint._line(e)}") from None
        if loaded is None or self.fresh is None:
            return loaded
        return checkpoint.check_async(loaded, self.fresh, self.num_clients, self.concurrency,
                                      self.path, self.max_arrivals)


def async_checkpoint(cfg: FlowerConfig, extra=None, fresh=None, num_clients: int = 0,
                     concurrency: int = 0) -> AsyncCheckpoint:
    """The asynchronous mode's checkpoint ``out-dir``/:data:`ASYNC_CHECKPOINT`, validated
    like the synchronous one against the run's fingerprint (the spec's identity and the
    run-config keys but the volatile ones, :meth:`FlowerConfig.fingerprint`); no
    client-side file (the SuperNodes are stateless). ``extra``: the transport whose report
    is saved with it; given ``fresh`` (the run's initial state), what it loads is checked
    (:class:`FlowerAsyncCheckpoint`)."""
    return FlowerAsyncCheckpoint(Path(cfg.out_dir) / ASYNC_CHECKPOINT, cfg.fingerprint(),
                                 extra=extra, fresh=fresh, num_clients=num_clients,
                                 concurrency=concurrency,
                                 max_arrivals=cfg.rounds)


def run_async(link, cfg, fed, algorithm, state, ref, report, t0) -> ServerState:
    """Algorithm 3 with the simulator's asynchronous loop
    (:func:`partialfl.runtime.asynchronous.drive`: sampling among idle clients, staleness,
    counting, checkpoint and resume) over the Flower transport, ``algorithm`` the spec's
    asynchronous rule (FedBuff: one server step on every K arrived updates). The stage's
    ``rounds`` count applied updates, as in process (``rounds``/K server steps under
    FedBuff). Every server step is recorded,
    with its updates' staleness and the nodes' evaluation when due. With
    ``checkpoint-every`` = c the run is checkpointed every c server steps (c·K arrivals) to
    ``out-dir``/:data:`ASYNC_CHECKPOINT` (an
    :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`: the server's bookkeeping, the
    report so far and every task in flight with the θ it was sent); with ``resume`` those
    tasks are sent again (the SuperNodes are stateless: a task's update depends only on θ,
    its client and its task number) and idle slots get new clients."""
    K = cfg.buffer_size
    # the nodes evaluate where the in-process run does: every eval_every applied updates
    # (0: none between), before the first and after the last; a record per server step
    every = cfg.eval_every or max(1, cfg.rounds)
    conc = min(cfg.asynchronous.concurrency, fed.num_clients)
    alg = algorithm  # the spec's asynchronous rule (FedAsync, FedBuff) wraps the method
    holder: dict[str, AsyncServer] = {}

    def evaluate(a, st, problem, client_state, ctx) -> dict[str, Any]:
        server = holder.get("server")
        rec: dict[str, Any] = {"server_steps": st.round}
        if server is not None and server.arrivals:
            stale = server.recent_staleness(K)
            rec.update({"clients": len(stale), "staleness": stale,
                        "max_staleness": max(stale), "local_grads": server.grad_evals})
        else:
            rec["local_grads"] = 0
        n = server.arrivals if server is not None else 0
        rec.update(evaluate_now(link, cfg, fed, st, st.round, report,
                                shared_entries(shared_state(a, st)),
                                due=n in (0, cfg.rounds) or n % every == 0))
        if ref is not None:
            rec.update(closed_form_metrics(algorithm, st, ref, None,
                                           RoundContext(cfg.seed, st.round), with_loss=False))
        return rec

    problem = ref if ref is not None else ServerProblem(fed.num_clients, fed.examples, fed.theta0)
    jobs = FlowerJobs(link, cfg, fed, report, conc, t0, algorithm)
    ck = async_checkpoint(cfg, jobs, state, fed.num_clients, conc) \
        if cfg.checkpoint_every or cfg.resume else None
    if cfg.resume and not ck.path.is_file():
        raise checkpoint.CheckpointError(f"run-config key 'resume': no checkpoint at {ck.path}")
    server = AsyncServer(problem, alg, concurrency=conc, seed=cfg.seed, theta0=state.theta,
                         evaluate=evaluate,
                         eval_every=math.gcd(K, cfg.eval_every) if cfg.eval_every else K,
                         logger=None if cfg.resume else ReportLog(report),  # replayed
                         max_failure_fraction=1.0)
    server.logger = ReportLog(report)
    holder["server"] = jobs.server = server
    drive(server, jobs, ComputeTimeModel(), steps=cfg.rounds, max_time=None,
          checkpoint=ck, checkpoint_every=cfg.checkpoint_every * K, resume=cfg.resume)
    server.result(0.0)  # the final state's record, as in process (a partial last buffer)
    if server.diverged and not report.stopped:  # as the in-process run says it
        report.stopped = f"diverged: {server.diverged}"
    return server.state
