"""Synchronous mode: :func:`partialfl.runtime.sync.run_rounds` over the Flower transport.

Round r samples the cohort with ``sample_cohort(seed, r, M, k)``, sends each SuperNode θ and
the ids of its sampled clients (``train`` messages), pulls the replies until all arrived or
``round-timeout`` passed, and applies ``algorithm.server_update`` — the same server step as
in-process — to the updates that arrived. Every reply goes through :func:`decode_reply` (the
codec's checks); a SuperNode whose ClientApp raised, whose reply was refused or that did not
answer in time is counted (:func:`partialfl.flower.report.record_failure`) and the round
aggregates the others; a round with no update leaves θ unchanged. Checkpoints are the runtime's
codec in out-dir with the report (:class:`partialfl.flower.checkpoint.FlowerCheckpoint`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from partialfl.algorithms.base import ClientResult, RoundContext, ServerState, concat_results
from partialfl.flower.checkpoint import FlowerCheckpoint
from partialfl.flower.codec import WireFormatError, decode_updates, params_to_record
from partialfl.flower.config import ConfigError, FlowerConfig, parse_fault_injection
from partialfl.flower.evaluate import evaluate_now
from partialfl.flower.federation import Federation, Link, ServerProblem
from partialfl.flower.report import (
    FlowerRunReport,
    ReportLog,
    ServerStopped,
    check_failures,
    log,
    record_failure,
)
from partialfl.metrics import closed_form_metrics
from partialfl.runtime.sync import run_rounds
from partialfl.stats import ratio_of_sums
from partialfl.types import ClientUpdates, Params


def train_content(theta: Params, round_: int, clients, shared=None) -> RecordDict:
    """A train message: θ, the round, the clients and the numbers of the server state the
    algorithm's clients read (``shared``: ``{name: value}`` of its ``shared_extra``)."""
    task = {"round": int(round_), "clients": [int(c) for c in clients], **shared_entries(shared)}
    return RecordDict({"theta": params_to_record(theta), "task": ConfigRecord(task)})


def shared_entries(shared) -> dict[str, int | float]:
    """``{"extra.<name>": value}`` for a message's config record: an integer (Python's or
    numpy's, not a bool) stays an int, every other number is sent as a float
    (:func:`partialfl.flower.node.shared_values` reads them on the node)."""
    return {f"extra.{n}": int(v) if isinstance(v, (int, np.integer)) and not isinstance(
        v, (bool, np.bool_)) else float(v) for n, v in (shared or {}).items()}


def shared_state(algorithm, state) -> dict[str, float]:
    """``state.extra``'s entries the clients of ``algorithm`` read (``shared_extra``)."""
    return {n: state.extra[n] for n in getattr(algorithm, "shared_extra", ())
            if n in state.extra}


def decode_reply(m: Message | None, theta, clients, fed: Federation, node: int, round_: int,
                 report: FlowerRunReport, algorithm=None, faults=None
                 ) -> tuple[ClientUpdates, dict[str, tuple[float, float]]] | None:
    """The updates of one train reply, checked by
    :func:`~partialfl.flower.codec.decode_updates` against θ, the asked ``clients``, their
    declared example counts and ``algorithm``; or None after counting the failure
    (``error``, ``timeout`` or ``invalid``) in ``report`` (and ``faults``)."""
    if m is None:
        kind, reason = "timeout", "no reply within round-timeout"
    elif m.has_error():
        kind, reason = "error", str(m.error.reason)
    else:
        try:
            return decode_updates(m.content, theta, clients, fed.torch,
                                  max_weights=fed.max_weights(clients), algorithm=algorithm)
        except WireFormatError as e:
            kind, reason = "invalid", str(e)
    record_failure(report, round_, kind, fed.partition(node), clients, reason, faults)
    return None


def merge(ups: list[ClientUpdates]) -> ClientUpdates:
    merged = concat_results([ClientResult(u) for u in ups]).updates
    order = np.argsort(np.asarray(merged.cohort), kind="stable")
    return merged.select(order) if not np.array_equal(order, np.arange(len(order))) else merged


def train_loss(sums: list[dict[str, tuple[float, float]]]) -> float | None:
    """Mean training loss over the clients that reported one (node sums and counts), by
    :func:`~partialfl.stats.ratio_of_sums`: one node's finite sums never make it inf."""
    tot = [m[n][0] for m in sums for n in ("loss", "train_loss") if n in m]
    cnt = [m[n][1] for m in sums for n in ("loss", "train_loss") if n in m]
    return ratio_of_sums(tot, cnt) if sum(cnt) else None



def growth_cause(fed: Federation, faults) -> str:
    """The fault log's largest ‖θ‖ growth (if 1000× or more), with the partition of the
    client whose update was largest in that step: the likely cause when honest nodes fail
    after it (synchronous and asynchronous transports)."""
    c = faults.growth.get("client") if faults is not None else None
    if c is None:
        return ""
    node = fed.order[int(fed.owner[c])]
    return faults.growth_text(f" (partition {fed.partition(node)})")

class FlowerRounds:
    """The Flower transport of :func:`partialfl.runtime.sync.run_rounds`: round r sends θ_r
    and the ids of its sampled clients to the SuperNodes holding them, pulls the replies
    until all arrived or ``round-timeout`` passed, and returns the updates that arrived
    (client order). Failed replies are recorded in the report and the loop's fault log
    (``max-failure-fraction`` checked here); a round with no update is skipped (θ unchanged).
    Fault injection ``stop:round=R`` stops the ServerApp before round R + 1, as a killed one
    would."""

    def __init__(self, link: Link, cfg: FlowerConfig, fed: Federation,
                 report: FlowerRunReport) -> None:
        self.link, self.cfg, self.fed, self.report = link, cfg, fed, report
        self.stops = {f.round for f in parse_fault_injection(cfg.fault_injection)
                      if f.kind == "stop"}
        self.last: dict[str, Any] = {}  # record entries of the last round's training

    def run_round(self, algorithm, state, problem, cohort, ctx, client_state, faults):
        """One round's train exchange (see the class docstring)."""
        r, fed, report = ctx.round, self.fed, self.report
        if r - 1 in self.stops:
            raise ServerStopped(f"injected server stop after round {r - 1}")
        if self.cfg.secagg:
            return self._secagg_round(algorithm, state, cohort, r, faults)
        pos = fed.owner[cohort]
        nodes = [fed.order[i] for i in sorted(set(pos.tolist()))]
        parts = {n: cohort[pos == fed.order.index(n)] for n in nodes}
        shared = shared_state(algorithm, state)
        items = [(n, "train", train_content(state.theta, r, parts[n], shared), r)
                 for n in nodes]
        ids, got = self.link.exchange(items, self.cfg.round_timeout)
        replies = [rep for n, mid in zip(nodes, ids)
                   if (rep := decode_reply(got.get(mid), state.theta, parts[n], fed, n, r,
                                           report, algorithm, faults)) is not None]
        report.requested_client_updates += len(cohort)
        report.last_round = r
        ups = [u for u, _ in replies]
        done = int(sum(len(u.cohort) for u in ups))
        self.last = {"clients": done, "failed_clients": len(cohort) - done}
        loss = train_loss([m for _, m in replies])
        if loss is not None:
            self.last["train_loss"] = loss
        check_failures(self.cfg, report, growth_cause(self.fed, faults))
        if not ups:
            report.skipped_rounds += 1
            log.warning("partialfl: round %d: no update arrived; θ unchanged", r)
            return None, np.arange(0)
        updates = merge(ups)
        return ClientResult(updates), np.searchsorted(cohort, np.asarray(updates.cohort))

    def _secagg_round(self, algorithm, state, cohort, r, faults):
        """The round over SecAgg+ (:func:`partialfl.flower.secagg.secagg_round`): the round's
        mean as the row of every surviving client."""
        from partialfl.flower.secagg import secagg_round

        report = self.report
        updates, alive = secagg_round(self.link, self.cfg, self.fed, state, cohort, r,
                                      algorithm, report, faults,
                                      shared_entries(shared_state(algorithm, state)))
        report.requested_client_updates += len(cohort)
        report.last_round = r
        self.last = {"clients": len(alive), "failed_clients": len(cohort) - len(alive)}
        check_failures(self.cfg, report)
        if updates is None:
            report.skipped_rounds += 1
            log.warning("partialfl: round %d: no SecAgg+ aggregate; θ unchanged", r)
            return None, np.arange(0)
        return ClientResult(updates), np.searchsorted(cohort, np.asarray(updates.cohort))


def run_sync(link, cfg, fed, algorithm, state, ref, report, t0) -> ServerState:
    """The simulator's synchronous loop (:func:`partialfl.runtime.sync.run_rounds`: sampling,
    evaluation cadence, counting, checkpoint and resume) over the Flower transport; every
    round is recorded, with the nodes' evaluation when due (the stage's ``eval_every``). With
    ``checkpoint-every`` = c, the state after every c-th round is checkpointed; with
    ``resume`` the loop continues from the checkpoint (same θ as an uninterrupted run)."""
    M = fed.num_clients
    k = cfg.clients_per_round
    if k is not None and k > M:
        if cfg.closed_form:
            raise ConfigError(f"spec {cfg.stage}.clients_per_round: {k} > number of clients "
                              f"{M}")
        k = M  # as the pipeline: a model stage samples at most every client
    transport = FlowerRounds(link, cfg, fed, report)

    def evaluate(algorithm, st, problem, client_state, ctx) -> dict[str, Any]:
        rec = {"server_steps": st.round - report.skipped_rounds, **transport.last}
        rec.update(evaluate_now(link, cfg, fed, st, st.round, report,
                                shared_entries(shared_state(algorithm, st))))
        if ref is not None:
            rec.update(closed_form_metrics(algorithm, st, ref, None,
                                           RoundContext(cfg.seed, st.round), with_loss=False))
        return rec

    problem = ref if ref is not None else ServerProblem(M, fed.examples, fed.theta0)
    res = run_rounds(problem, algorithm, cfg.rounds, clients_per_round=k, seed=cfg.seed,
                     theta0=state.theta,
                     backend=transport, evaluate=evaluate, logger=ReportLog(report),
                     checkpoint=(FlowerCheckpoint(cfg, report, state)
                                 if cfg.checkpoint_every or cfg.resume else None),
                     checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                     max_failure_fraction=1.0)  # counted here, by check_failures
    report.history = res.history
    if res.diverged and not report.stopped:  # as the in-process run says it
        report.stopped = f"diverged: {res.diverged}"
    return ServerState(res.state.theta, res.state.opt_state,
                       res.state.round - report.skipped_rounds, res.state.extra)
