"""The ServerApp: θ, the server optimizer and the aggregation live here; data never does.

The loops are the simulator's own, over a Flower transport (so sampling, evaluation cadence,
counting, staleness, checkpoint and resume are written once, in :mod:`partialfl.runtime`):

Synchronous mode: :func:`partialfl.runtime.sync.run_rounds` with :class:`_FlowerRounds` as
transport. Round r samples the cohort with ``sample_cohort(seed, r, M, k)``, sends each
SuperNode θ and the ids of its sampled clients (``train`` messages, pushed with
``grid.push_messages``), pulls the replies until all arrived or ``round-timeout`` passed, and
applies ``algorithm.server_update(state, updates, RoundContext(seed, r))`` — the same server
step (aggregator, SGD/Adam, schedule) as in-process — to the updates that arrived. A SuperNode
whose ClientApp raised, returned a malformed update or did not answer in time is logged and
counted (:class:`FlowerRunReport`); the round aggregates the others, and a round with no
update at all leaves θ unchanged. Every round is recorded, with the SuperNodes' evaluation
(``evaluate`` messages, sums only) every ``eval-every`` rounds; checkpoints are the out-dir
files of :mod:`partialfl.flower.checkpoint` (:class:`_FlowerCheckpoint`).

Asynchronous mode (the paper's Algorithm 3): :func:`partialfl.runtime.asynchronous.drive`
with :class:`_FlowerJobs` as transport: ``concurrency`` single-client tasks are kept in
flight; task j trains a client sampled among the idle ones (``generator(seed, "sample",
j)``) at the θ current when it was sent; replies are applied as they arrive, and with
``buffer-size`` = K > 1 every K arrived updates make one server step
(:class:`~partialfl.algorithms.asynchronous.FedBuff`; K = 1: θ ← θ − γ g_m(θ_stale)). The
staleness (server steps between sending θ and applying the update) of every applied update is
recorded; checkpoints are the loop's own :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`
in ``out-dir`` (on resume the tasks in flight are sent again). Flower has no asynchronous
strategy; this loop only uses ``push_messages``/``pull_messages``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from partialfl import arrays
from partialfl import io as pio
from partialfl.algorithms.asynchronous import FedBuff
from partialfl.algorithms.base import ClientResult, RoundContext, ServerState, concat_results
from partialfl.flower import checkpoint
from partialfl.flower.builders import build_algorithm, build_problem
from partialfl.flower.codec import WireFormatError, decode_params, decode_updates, params_to_record
from partialfl.flower.config import (
    ConfigError,
    FlowerConfig,
    parse_fault_injection,
    parse_run_config,
)
from partialfl.metrics import closed_form_metrics
from partialfl.runtime.asynchronous import (
    AsyncCheckpoint,
    AsyncServer,
    ComputeTimeModel,
    Event,
    drive,
)
from partialfl.runtime.sync import run_rounds
from partialfl.types import ClientUpdates, Params

log = logging.getLogger("flwr.partialfl")

MessageHook = Callable[[Message], None]


class RunAborted(RuntimeError):
    """Too many client updates failed (``max-failure-fraction``): the run stops, with a reason."""


class ServerStopped(RuntimeError):
    """Testing (fault injection ``stop:round=R``): the ServerApp stops as a killed one would."""


@dataclass
class Failure:
    """One SuperNode reply that did not yield updates."""

    round: int
    kind: str  # "error" (the ClientApp raised), "timeout", "invalid" (malformed reply)
    partition: int
    clients: list[int]
    reason: str


@dataclass
class FlowerRunReport:
    """What a Flower run produced: final θ, per-round metrics and every failure."""

    config: dict[str, Any]
    theta: Params
    history: list[dict[str, Any]] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    server_steps: int = 0
    skipped_rounds: int = 0
    seconds: float = 0.0
    nodes: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""  # why training stopped early ("" = it ran all rounds)
    setup_seconds: float = 0.0  # waiting for SuperNodes, describing them, building θ⁰
    requested_client_updates: int = 0
    aborted: bool = False  # stopped by max-failure-fraction
    resumed_from: int = -1  # the round a resumed run continued from (-1: not resumed)
    last_round: int = -1  # the last round (async: task) whose updates were requested

    @property
    def lost_partitions(self) -> list[int]:
        """Partitions whose last two or more requests all failed (a SuperNode that left)."""
        last: dict[int, list[int]] = {}
        for f in self.failures:
            if f.kind in ("error", "timeout", "invalid"):
                last.setdefault(f.partition, []).append(f.round)
        return sorted(p for p, rounds in last.items() if len(rounds) >= 2
                      and rounds[-1] == self.last_round and rounds[-2] == rounds[-1] - 1)

    @property
    def failure_counts(self) -> dict[str, int]:
        """Number of failures of each kind."""
        out: dict[str, int] = {}
        for f in self.failures:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    @property
    def failed_client_updates(self) -> int:
        """Number of client updates lost to failures."""
        return sum(len(f.clients) for f in self.failures)

    def summary(self) -> dict[str, Any]:
        """Server steps, skipped rounds, failures and timings of the run."""
        rounds = max(1, self.config.get("num-rounds", 1))
        return {
            "server_steps": self.server_steps,
            "skipped_rounds": self.skipped_rounds,
            "failures": len(self.failures),
            "failure_counts": self.failure_counts,
            "failed_client_updates": self.failed_client_updates,
            "seconds": self.seconds,
            "setup_seconds": self.setup_seconds,
            "seconds_per_round": (self.seconds - self.setup_seconds) / rounds,
            "stopped_early": self.stopped,
            "aborted": self.aborted,
            "requested_client_updates": self.requested_client_updates,
            "lost_partitions": self.lost_partitions,
            "resumed_from": self.resumed_from,
        }

    def __repr__(self) -> str:
        """A summary (what ran, the last metrics, failures, the size of θ), not θ's values."""
        c = self.config
        size = sum(int(getattr(v, "size", 1)) for v in self.theta.values())
        last = self.history[-1] if self.history else {}
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items()
                 if not isinstance(v, list | dict)}
        return (f"FlowerRunReport({c.get('algorithm')} on {c.get('problem')}, "
                f"{self.server_steps} server steps in {self.seconds:.1f} s, "
                f"{len(self.failures)} failures, θ: {len(self.theta)} tensors / {size:,} "
                f"values; last record {shown})")

    def to_json(self) -> dict[str, Any]:
        """The report without θ, as JSON-ready dicts (written to ``result.json``)."""
        return {"summary": self.summary(), "config": self.config, "nodes": self.nodes,
                "history": self.history, "failures": [asdict(f) for f in self.failures]}

    def write(self, out_dir: str | Path) -> Path:
        """``result.json``, ``metrics.jsonl`` (one line per evaluated round), ``theta.npz``;
        every file written atomically (temp file + rename)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        pio.write_bytes(out / "metrics.jsonl", "".join(
            json.dumps(rec, default=float) + "\n" for rec in self.history).encode())
        with pio.atomic_write(out / "theta.npz", "wb") as f:
            np.savez(f, **{n: _np(v) for n, v in self.theta.items()})
        pio.write_bytes(out / "result.json",
                        json.dumps(self.to_json(), indent=1, default=float).encode())
        return out / "result.json"


_np = arrays.to_numpy


class _Link:
    """push/pull with our own polling (``send_and_receive`` of the deployment Grid sleeps 3 s
    between pulls); every received message goes through ``hook`` first."""

    def __init__(self, grid: Grid, cfg: FlowerConfig, hook: MessageHook | None) -> None:
        self.grid, self.cfg, self.hook = grid, cfg, hook
        self.ttl = max(cfg.round_timeout, cfg.node_wait_timeout) + 60.0
        # The server's validated config travels with every message, so all SuperNodes run
        # exactly the server's configuration (and simulation needs no app folder).
        self.run_config = ConfigRecord(cfg.to_run_config())

    def push(self, items: list[tuple[int, str, RecordDict, int]]) -> list[str]:
        msgs = []
        for node, mtype, content, group in items:
            content["run-config"] = self.run_config
            msgs.append(Message(content, node, mtype, ttl=self.ttl, group_id=str(group)))
        ids = [str(i) if i is not None else "" for i in self.grid.push_messages(msgs)]
        return ids

    def pull(self, ids) -> dict[str, Message]:
        if not ids:
            return {}
        out = {}
        for m in self.grid.pull_messages(list(ids)):
            if self.hook is not None:
                self.hook(m)
            out[m.metadata.reply_to_message_id] = m
        return out

    def exchange(self, items, timeout: float) -> tuple[list[str], dict[str, Message]]:
        """Push ``items`` and pull until every reply arrived or ``timeout`` seconds passed."""
        ids = self.push(items)
        pending = {i for i in ids if i}
        got: dict[str, Message] = {}
        deadline = time.monotonic() + timeout
        while pending:
            new = self.pull(pending)
            got.update(new)
            pending -= set(new)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.cfg.poll_interval)
        return ids, got


@dataclass
class _Federation:
    nodes: dict[int, dict[str, Any]]  # node id -> describe info
    order: list[int]  # node ids by partition
    owner: np.ndarray  # client id -> position in `order` (node ids exceed int64)
    num_clients: int
    theta0: Params
    torch: bool
    examples: np.ndarray  # client id -> its number of training examples (from the nodes)

    def partition(self, node: int) -> int:
        return int(self.nodes[node]["partition-id"])


def _wait_for_nodes(grid: Grid, cfg: FlowerConfig) -> list[int]:
    deadline = time.monotonic() + cfg.node_wait_timeout
    while True:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= cfg.min_nodes:
            return nodes
        if time.monotonic() >= deadline:
            raise TimeoutError(f"only {len(nodes)} SuperNode(s) connected after "
                               f"{cfg.node_wait_timeout}s; min-nodes = {cfg.min_nodes}")
        time.sleep(min(0.5, cfg.poll_interval * 5))


def _describe(link: _Link, cfg: FlowerConfig, node_ids: list[int]) -> _Federation:
    """Ask every SuperNode which clients it holds (partition 0 also sends θ⁰); SuperNodes
    that connect later are asked too, until every partition has one or ``node-wait-timeout``
    passed."""
    request = RecordDict({"request": ConfigRecord({"init-partition": 0})})
    deadline = time.monotonic() + cfg.node_wait_timeout
    nodes: dict[int, dict[str, Any]] = {}
    seen: dict[int, int] = {}  # partition -> node
    asked: set[int] = set()
    theta0 = None
    while True:
        new = [n for n in node_ids if n not in asked]
        asked.update(new)
        # Starting ClientApps (Ray actors, processes, data) can take longer than a round.
        ids, got = link.exchange([(n, "query.describe", request, -1) for n in new],
                                 max(cfg.round_timeout, cfg.node_wait_timeout))
        for node, mid in zip(new, ids):
            m = got.get(mid)
            if m is None or m.has_error():
                reason = "no reply" if m is None else _short(m.error.reason)
                log.warning("SuperNode %s did not describe itself (%s); it is left out", node,
                            reason)
                continue
            info = dict(m.content["info"])
            p = int(info["partition-id"])
            if p in seen:
                log.warning("SuperNodes %s and %s both hold partition %d; using %s", seen[p],
                            node, p, seen[p])
                continue
            seen[p], nodes[node] = node, info
            if "theta0" in m.content:
                theta0 = decode_params(m.content["theta0"], bool(int(info["torch"])))
        infos = list(nodes.values())
        nparts = {int(i["num-partitions"]) for i in infos}
        M = int(infos[0]["num-clients"]) if infos else 0
        if len(nparts) > 1 or any(int(i["num-clients"]) != M for i in infos):
            raise ConfigError(f"SuperNodes disagree on num-partitions {sorted(nparts)} or the "
                              "number of clients: start them with the same node config")
        missing = sorted(set(range(nparts.pop())) - set(seen)) if nparts else None
        if missing == []:
            break
        if time.monotonic() >= deadline:
            if missing is None:
                raise RuntimeError("no SuperNode answered the describe query")
            raise RuntimeError(f"no SuperNode holds partition(s) {missing} after "
                               f"{cfg.node_wait_timeout}s; partitions present: {sorted(seen)}")
        time.sleep(min(1.0, 20 * cfg.poll_interval))
        node_ids = sorted(int(n) for n in link.grid.get_node_ids())
    order = sorted(nodes, key=lambda n: int(nodes[n]["partition-id"]))
    owner = np.full(M, -1, dtype=np.int64)  # client id -> position in `order`
    examples = np.zeros(M)
    for pos, node in enumerate(order):
        ids = np.asarray(nodes[node]["clients"], dtype=np.int64)
        owner[ids] = pos
        examples[ids] = np.asarray(nodes[node]["num-examples"], dtype=np.float64)
    if (owner < 0).any():
        raise RuntimeError(f"clients {np.flatnonzero(owner < 0).tolist()} are on no SuperNode")
    if theta0 is None:
        raise RuntimeError("the SuperNode of partition 0 did not send the initial model")
    return _Federation(nodes, order, owner, M, theta0, bool(int(nodes[order[0]]["torch"])),
                       examples)


class _ServerProblem:
    """What the server knows of the problem when it holds no data: the number of clients,
    their example counts (from the SuperNodes' descriptions) and the names and shapes of θ.
    Personal parameter names never reach the server: ``w_names`` and ``state_names`` are
    empty here (an algorithm that shares w refuses a personal split on the clients)."""

    w_names: tuple[str, ...] = ()
    state_names: tuple[str, ...] = ()

    def __init__(self, num_clients: int, examples: np.ndarray, theta0: Params) -> None:
        self.num_clients = num_clients
        self._examples = np.asarray(examples, dtype=np.float64)
        self.theta_names = tuple(theta0)
        self.theta_shapes = {n: tuple(np.shape(v)) for n, v in theta0.items()}

    def num_examples(self, cohort) -> np.ndarray:
        """The example counts the SuperNodes reported for ``cohort``."""
        return self._examples[np.asarray(cohort, dtype=np.int64)]


def run_server(grid: Grid, run_config: dict[str, Any], *, aggregator=None,
               message_hook: MessageHook | None = None,
               algorithm_factory=None) -> FlowerRunReport:
    """Run the configured training over ``grid`` and return the report (also written to
    ``out-dir`` when set). ``aggregator`` overrides the configured aggregation rule;
    ``message_hook`` sees every message the server receives (before it is decoded);
    ``algorithm_factory(cfg, problem)`` (problem None when the server holds no data) builds
    the algorithm instead of the run config (the ClientApps must use the same factory)."""
    cfg = parse_run_config(run_config)
    t0 = time.perf_counter()
    link = _Link(grid, cfg, message_hook)
    fed = _describe(link, cfg, _wait_for_nodes(grid, cfg))
    # Only the synthetic least-squares problem (public generator and seed) is rebuilt on the
    # server: for 'server-lr = auto' (1/L) and the reference metrics ‖θ − θ*‖², ‖F(θ)‖².
    ref = build_problem(cfg) if cfg.problem == "least-squares" else None
    if algorithm_factory is None:
        algorithm = build_algorithm(cfg, ref, aggregator=aggregator,
                                    num_clients=fed.num_clients)
    else:
        algorithm = algorithm_factory(cfg, ref)
    state = algorithm.init(ref if ref is not None else _ServerProblem(
        fed.num_clients, fed.examples, fed.theta0), fed.theta0)
    report = FlowerRunReport(cfg.to_run_config(), state.theta,
                             nodes=[{"node": n, **i} for n, i in fed.nodes.items()],
                             setup_seconds=time.perf_counter() - t0)
    log.info("partialfl: %s (%s) on %d SuperNodes holding %d clients", cfg.algorithm, cfg.mode,
             len(fed.nodes), fed.num_clients)
    loop = _run_sync if cfg.mode == "sync" else _run_async
    try:
        state = loop(link, cfg, fed, algorithm, state, ref, report, t0)
    except RunAborted as e:
        report.aborted, report.stopped = True, str(e)
        report.seconds = time.perf_counter() - t0
        log.error("partialfl: %s", e)
        if cfg.out_dir:
            report.write(cfg.out_dir)
        raise
    report.theta = {n: _np(v) for n, v in state.theta.items()}
    report.server_steps = state.round
    report.seconds = time.perf_counter() - t0
    if report.failures:
        log.warning("partialfl: %d failed replies (%s), %d client updates lost, %d rounds "
                    "skipped", len(report.failures), report.failure_counts,
                    report.failed_client_updates, report.skipped_rounds)
    if cfg.out_dir:
        path = report.write(cfg.out_dir)
        log.info("partialfl: wrote %s", path)
    return report


def _train_content(theta: Params, round_: int, clients) -> RecordDict:
    return RecordDict({
        "theta": params_to_record(theta),
        "task": ConfigRecord({"round": int(round_), "clients": [int(c) for c in clients]}),
    })


def _decode_reply(m: Message | None, theta, clients, fed, node, round_, report
                  ) -> tuple[ClientUpdates, dict[str, tuple[float, float]]] | None:
    part = fed.partition(node)
    if m is None:
        kind, reason = "timeout", "no reply within round-timeout"
    elif m.has_error():
        kind, reason = "error", m.error.reason
    else:
        try:
            return decode_updates(m.content, theta, clients, fed.torch)
        except (WireFormatError, KeyError, TypeError, ValueError) as e:
            kind, reason = "invalid", str(e)
    f = Failure(int(round_), kind, part, [int(c) for c in clients], _short(reason))
    report.failures.append(f)
    log.warning("partialfl: round %d: SuperNode %s (partition %d, %d clients) failed: %s: %s",
                round_, node, part, len(clients), kind, f.reason)
    return None


def _check_failures(cfg: FlowerConfig, report: FlowerRunReport) -> None:
    """Abort once more than ``max-failure-fraction`` of the requested updates failed."""
    asked = report.requested_client_updates
    lost = report.failed_client_updates
    if asked and lost / asked > cfg.max_failure_fraction:
        raise RunAborted(
            f"{lost} of {asked} requested client updates failed ({lost / asked:.0%} > "
            f"max-failure-fraction {cfg.max_failure_fraction:g}); failures by kind "
            f"{report.failure_counts}, partitions lost: {report.lost_partitions or 'none'}")


def _short(reason: str, n: int = 600) -> str:
    """Long reasons (e.g. a remote traceback) keep their head and their tail (the error)."""
    reason = reason.strip()
    return reason if len(reason) <= n else f"{reason[:200]} ... {reason[-(n - 205):]}"


def _merge(ups: list[ClientUpdates]) -> ClientUpdates:
    merged = concat_results([ClientResult(u) for u in ups]).updates
    order = np.argsort(np.asarray(merged.cohort), kind="stable")
    return merged.select(order) if not np.array_equal(order, np.arange(len(order))) else merged


def _eval_due(cfg: FlowerConfig, round_: int) -> bool:
    return bool(cfg.eval_every) and (round_ % cfg.eval_every == 0 or round_ == cfg.num_rounds)


def _eval_items(fed, theta: Params, round_: int) -> list[tuple[int, str, RecordDict, int]]:
    content = RecordDict({"theta": params_to_record(theta),
                          "task": ConfigRecord({"round": int(round_)})})
    return [(n, "evaluate", content, round_) for n in fed.order]


def _eval_reduce(fed, ids, got, round_, report) -> dict[str, Any]:
    """Add up the nodes' evaluation sums (``clients``, ``<metric>.sum``, ``<metric>.count``,
    ``acc.hist``: counts only, never a per-client value): least squares → means over all
    clients; model problems → :func:`partialfl.flower.models.summarize_sums`. A reply with
    any other entry (e.g. a per-client list) is refused and counted (``eval-invalid``)."""
    pooled: dict[str, Any] = {}
    for node, mid in zip(fed.order, ids):
        m = got.get(mid)
        if m is None or m.has_error():
            report.failures.append(Failure(
                int(round_), "eval-timeout" if m is None else "eval-error", fed.partition(node),
                [], "no reply" if m is None else _short(m.error.reason)))
            continue
        try:
            sums = _eval_sums(dict(m.content["eval"]))
        except (KeyError, TypeError, ValueError) as e:
            report.failures.append(Failure(int(round_), "eval-invalid", fed.partition(node),
                                           [], _short(str(e))))
            continue
        for k, v in sums.items():
            pooled[k] = pooled[k] + v if k in pooled else v
    if not pooled:
        return {}
    if "acc.hist" in pooled:
        from partialfl.flower.models import summarize_sums

        return {"eval_clients": int(pooled["clients"]), **summarize_sums(pooled)}
    n = max(pooled["clients"], 1.0)
    out: dict[str, Any] = {"eval_clients": int(pooled["clients"])}
    for k, v in pooled.items():
        if k.endswith(".sum"):
            out["eval_" + k[: -len(".sum")].replace("-", "_")] = float(v) / n
    return out


def _eval_sums(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if k == "acc.hist":
            arr = np.asarray(v, dtype=np.float64)
            if arr.ndim != 1 or not (np.isfinite(arr).all() and (arr >= 0).all()):
                raise ValueError("evaluation histogram must be finite counts >= 0")
            out[k] = arr
        elif k == "clients" or k.endswith((".sum", ".count")):
            if isinstance(v, list | tuple) or not np.isfinite(float(v)):
                raise ValueError(f"evaluation entry {k!r} must be one finite scalar (no "
                                 "per-client list reaches the server)")
            out[k] = float(v)
        else:
            raise ValueError(f"evaluation entry {k!r} is not allowed: only 'clients', "
                             "'<metric>.sum', '<metric>.count' and 'acc.hist'")
    if "clients" not in out:
        raise ValueError("evaluation reply lacks 'clients'")
    return out


def _train_loss(sums: list[dict[str, tuple[float, float]]]) -> float | None:
    """Mean training loss over the clients that reported one (node sums and counts)."""
    tot = cnt = 0.0
    for m in sums:
        for name in ("loss", "train_loss"):
            if name in m:
                tot, cnt = tot + m[name][0], cnt + m[name][1]
    return tot / cnt if cnt else None


class _FlowerRounds:
    """The Flower transport of :func:`partialfl.runtime.sync.run_rounds`: round r sends θ_r
    and the ids of its sampled clients to the SuperNodes holding them, pulls the replies
    until all arrived or ``round-timeout`` passed, and returns the updates that arrived
    (client order). Failed replies are recorded in the report (``max-failure-fraction``
    checked here); a round with no update is skipped (θ unchanged). Fault injection
    ``stop:round=R`` stops the ServerApp before round R + 1, as a killed one would."""

    def __init__(self, link: _Link, cfg: FlowerConfig, fed: _Federation,
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
        pos = fed.owner[cohort]
        nodes = [fed.order[i] for i in sorted(set(pos.tolist()))]
        parts = {n: cohort[pos == fed.order.index(n)] for n in nodes}
        items = [(n, "train", _train_content(state.theta, r, parts[n]), r) for n in nodes]
        ids, got = self.link.exchange(items, self.cfg.round_timeout)
        replies = [rep for n, mid in zip(nodes, ids)
                   if (rep := _decode_reply(got.get(mid), state.theta, parts[n], fed, n, r,
                                            report)) is not None]
        report.requested_client_updates += len(cohort)
        report.last_round = r
        ups = [u for u, _ in replies]
        done = int(sum(len(u.cohort) for u in ups))
        self.last = {"clients": done, "failed_clients": len(cohort) - done}
        loss = _train_loss([m for _, m in replies])
        if loss is not None:
            self.last["train_loss"] = loss
        _check_failures(self.cfg, report)
        if not ups:
            report.skipped_rounds += 1
            log.warning("partialfl: round %d: no update arrived; θ unchanged", r)
            return None, np.arange(0)
        updates = _merge(ups)
        return ClientResult(updates), np.searchsorted(cohort, np.asarray(updates.cohort))


class _FlowerCheckpoint:
    """The ServerApp's checkpoint in ``out-dir`` (:mod:`partialfl.flower.checkpoint`) with
    the report so far, for :func:`partialfl.runtime.sync.run_rounds`."""

    def __init__(self, cfg: FlowerConfig, report: FlowerRunReport, names) -> None:
        self.cfg, self.report, self.names = cfg, report, set(names)

    def save(self, state, client_state, history, local_grads, faults) -> None:
        """θ, the optimizer state and the report so far."""
        rep = self.report
        checkpoint.save(self.cfg, state, state.round, {
            "history": history, "failures": [asdict(f) for f in rep.failures],
            "skipped_rounds": rep.skipped_rounds, "requested": rep.requested_client_updates,
            "grads": int(local_grads)})

    def load(self):
        """The saved state (the report restored), validated against the configuration."""
        loaded, start, rep = checkpoint.load(self.cfg)
        if set(loaded.theta) != self.names:
            raise checkpoint.CheckpointError(f"checkpoint θ leaves {sorted(loaded.theta)} "
                                             f"differ from the model's {sorted(self.names)}")
        report = self.report
        report.failures = [Failure(**f) for f in rep["failures"]]
        report.skipped_rounds = int(rep["skipped_rounds"])
        report.requested_client_updates = int(rep["requested"])
        report.resumed_from = start
        log.info("partialfl: resuming from the checkpoint of round %d in %s", start,
                 self.cfg.out_dir)
        return loaded, None, list(rep["history"]), int(rep["grads"]), {}


class _ReportLog:
    """The run's records: into the report and the log."""

    def __init__(self, report: FlowerRunReport) -> None:
        self.report = report

    def log(self, rec: dict[str, Any]) -> None:
        self.report.history.append(rec)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rec.items()
                 if k not in ("staleness",)}
        log.info("partialfl: %s", shown)


def _run_sync(link, cfg, fed, algorithm, state, ref, report, t0) -> ServerState:
    """The simulator's synchronous loop (:func:`partialfl.runtime.sync.run_rounds`: sampling,
    evaluation cadence, counting, checkpoint and resume) over the Flower transport; every
    round is recorded, with the nodes' evaluation when due (``eval-every``). With
    ``checkpoint-every`` = c, the state after every c-th round is checkpointed; with
    ``resume`` the loop continues from the checkpoint (same θ as an uninterrupted run)."""
    k = cfg.clients_per_round or None
    M = fed.num_clients
    if k is not None and k > M:
        raise ConfigError(f"run-config key 'clients-per-round': {k} > number of clients {M}")
    transport = _FlowerRounds(link, cfg, fed, report)

    def evaluate(algorithm, st, problem, client_state, ctx) -> dict[str, Any]:
        rec = {"server_steps": st.round - report.skipped_rounds, **transport.last}
        rec.update(_evaluate_now(link, cfg, fed, st, st.round, report))
        if ref is not None:
            rec.update(closed_form_metrics(algorithm, st, ref, None,
                                           RoundContext(cfg.seed, st.round), with_loss=False))
        return rec

    problem = ref if ref is not None else _ServerProblem(M, fed.examples, fed.theta0)
    res = run_rounds(problem, algorithm, cfg.num_rounds, clients_per_round=k, seed=cfg.seed,
                     theta0=state.theta,
                     backend=transport, evaluate=evaluate, logger=_ReportLog(report),
                     checkpoint=(_FlowerCheckpoint(cfg, report, state.theta)
                                 if cfg.checkpoint_every or cfg.resume else None),
                     checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                     max_failure_fraction=1.0)
    report.history = res.history
    return ServerState(res.state.theta, res.state.opt_state,
                       res.state.round - report.skipped_rounds, res.state.extra)


def _evaluate_now(link, cfg, fed, state, round_, report) -> dict[str, Any]:
    if not _eval_due(cfg, round_):
        return {}
    ids, got = link.exchange(_eval_items(fed, state.theta, round_), cfg.round_timeout)
    return _eval_reduce(fed, ids, got, round_, report)


#: the asynchronous mode's checkpoint file in ``out-dir`` (synchronous mode:
#: ``checkpoint.json`` + ``checkpoint-<round>.safetensors``, :mod:`partialfl.flower.checkpoint`)
ASYNC_CHECKPOINT = "checkpoint-async.safetensors"


class _FlowerJobs:
    """The Flower transport of :func:`partialfl.runtime.asynchronous.drive`: a job is one
    ``train`` message for its client (task number = job number) to the SuperNode holding it;
    replies are pulled as they arrive, a task without a reply within ``round-timeout`` is
    lost. After ``max(10, 3 × concurrency)`` consecutive failed tasks the run stops early
    (``report.stopped``). Its :meth:`state` / :meth:`restore` (the report so far) go into
    the run's :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`. Fault injection
    ``stop:round=R`` stops the ServerApp at the first send after server step R + 1 (after
    that step's checkpoint), as a killed one would."""

    def __init__(self, link: _Link, cfg: FlowerConfig, fed: _Federation,
                 report: FlowerRunReport, concurrency: int, t0: float) -> None:
        self.link, self.cfg, self.fed, self.report, self.t0 = link, cfg, fed, report, t0
        self.inflight: dict[str, tuple] = {}
        self.queue: list = []
        self.streak, self.max_streak = 0, max(10, 3 * concurrency)
        self.stops = {f.round for f in parse_fault_injection(cfg.fault_injection)
                      if f.kind == "stop"}
        self.server: AsyncServer | None = None  # set by _run_async (the step to checkpoint)

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
        (mid,) = self.link.push([(node, "train", _train_content(state.theta, ctx.round, client),
                                  ctx.round)])
        self.inflight[mid] = (job, node, client, state.theta,
                              time.monotonic() + self.cfg.round_timeout)
        return None

    def next(self, max_time):
        """The next reply (or lost task); None once too many tasks failed in a row."""
        report = self.report
        while not self.queue:
            if self.streak >= self.max_streak:
                report.stopped = (f"{self.streak} consecutive client tasks failed (last: "
                                  f"{report.failures[-1].kind}: {report.failures[-1].reason})")
                log.error("partialfl: async training stopped early: %s", report.stopped)
                return None
            got = self.link.pull(set(self.inflight))
            now = time.monotonic()
            for mid in [m for m, v in self.inflight.items() if m in got or v[4] <= now]:
                job, node, client, theta, _ = self.inflight.pop(mid)
                rep = _decode_reply(got.get(mid), theta, client, self.fed, node, job.job,
                                    report)
                report.requested_client_updates += len(client)
                report.last_round = max(report.last_round, job.job)
                if rep is None:
                    self.streak += 1
                    self.queue.append(Event("error", job.slot, job, report.failures[-1].reason,
                                            self.now()))
                else:
                    self.streak = 0
                    self.queue.append(Event("done", job.slot, job, ClientResult(rep[0]),
                                            self.now()))
            _check_failures(self.cfg, report)
            if not got and not self.queue:
                time.sleep(self.cfg.poll_interval)
        return self.queue.pop(0)

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
                "streak": self.streak}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue the report of the checkpointed run."""
        rep = self.report
        rep.failures = [Failure(**f) for f in saved["failures"]]
        rep.requested_client_updates = int(saved["requested"])
        rep.last_round, self.streak = int(saved["last_round"]), int(saved["streak"])
        rep.resumed_from = int(saved["step"])
        log.info("partialfl: resuming from the checkpoint of server step %d in %s",
                 rep.resumed_from, self.cfg.out_dir)

    def close(self) -> None:
        """Tasks still in flight are abandoned (their replies are never pulled)."""


def async_checkpoint(cfg: FlowerConfig, extra=None) -> AsyncCheckpoint:
    """The asynchronous mode's checkpoint ``out-dir``/:data:`ASYNC_CHECKPOINT`, validated
    like the synchronous one against every run-config key but the volatile ones
    (:data:`partialfl.flower.checkpoint.VOLATILE`); no client-side file (the SuperNodes are
    stateless). ``extra``: the transport whose report is saved with it."""
    fp = {k: v for k, v in cfg.to_run_config().items() if k not in checkpoint.VOLATILE}
    return AsyncCheckpoint(Path(cfg.out_dir) / ASYNC_CHECKPOINT, fp, private=False,
                           extra=extra)


def _run_async(link, cfg, fed, algorithm, state, ref, report, t0) -> ServerState:
    """Algorithm 3 with the simulator's asynchronous loop
    (:func:`partialfl.runtime.asynchronous.drive`: sampling among idle clients, staleness,
    counting, checkpoint and resume) over the Flower transport; ``buffer-size`` = K > 1 is
    FedBuff (one server step on every K arrived updates). Every server step is recorded,
    with its updates' staleness and the nodes' evaluation when due. With
    ``checkpoint-every`` = c the run is checkpointed every c server steps (c·K arrivals) to
    ``out-dir``/:data:`ASYNC_CHECKPOINT` (an
    :class:`~partialfl.runtime.asynchronous.AsyncCheckpoint`: the server's bookkeeping, the
    report so far and every task in flight with the θ it was sent); with ``resume`` those
    tasks are sent again (the SuperNodes are stateless: a task's update depends only on θ,
    its client and its task number) and idle slots get new clients."""
    K = cfg.buffer_size
    conc = cfg.concurrency or len(fed.nodes)
    alg = FedBuff(algorithm, K) if K > 1 else algorithm
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
        rec.update(_evaluate_now(link, cfg, fed, st, st.round, report))
        if ref is not None:
            rec.update(closed_form_metrics(algorithm, st, ref, None,
                                           RoundContext(cfg.seed, st.round), with_loss=False))
        return rec

    problem = ref if ref is not None else _ServerProblem(fed.num_clients, fed.examples, fed.theta0)
    jobs = _FlowerJobs(link, cfg, fed, report, conc, t0)
    ck = async_checkpoint(cfg, jobs) if cfg.checkpoint_every or cfg.resume else None
    if cfg.resume and not ck.path.is_file():
        raise checkpoint.CheckpointError(f"run-config key 'resume': no checkpoint at {ck.path}")
    server = AsyncServer(problem, alg, concurrency=conc, seed=cfg.seed, theta0=state.theta,
                         evaluate=evaluate, eval_every=K,
                         logger=None if cfg.resume else _ReportLog(report),  # replayed
                         max_failure_fraction=1.0)
    server.logger = _ReportLog(report)
    holder["server"] = jobs.server = server
    drive(server, jobs, ComputeTimeModel(), steps=cfg.num_rounds * K, max_time=None,
          checkpoint=ck, checkpoint_every=cfg.checkpoint_every * K, resume=cfg.resume)
    return server.state


def make_server_app(*, run_config: dict[str, Any] | None = None, aggregator=None,
                    message_hook: MessageHook | None = None,
                    on_report: Callable[[FlowerRunReport], None] | None = None) -> ServerApp:
    """A ServerApp running :func:`run_server` on ``context.run_config`` (what ``flwr run -c``
    fused), or on ``run_config`` when given. The keyword arguments are for programmatic use
    (Python simulation, custom aggregator callables, message capture, getting the report)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = dict(context.run_config) if run_config is None else dict(run_config)
        report = run_server(grid, cfg, aggregator=aggregator, message_hook=message_hook)
        if on_report is not None:
            on_report(report)

    return server


app = make_server_app()

__all__ = ["Failure", "FlowerRunReport", "RunAborted", "ServerStopped", "app",
           "make_server_app", "run_server"]
