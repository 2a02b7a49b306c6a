"""What a Flower run produced and how its failures are counted (the ServerApp's bookkeeping).

Every SuperNode reply that yields nothing — the ClientApp raised (``error``), no reply within
``round-timeout`` (``timeout``), a reply the codec refused (``invalid``), or the same for an
evaluation (``eval-*``) — is one :class:`Failure` in :class:`FlowerRunReport` (``result.json``)
and, for training replies, also a lost client computation per client in the run loop's
:class:`~partialfl.runtime.faults.FaultLog` (``clients_failed`` in every ``metrics.jsonl``
record). :func:`check_failures` aborts past ``max-failure-fraction``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partialfl import arrays
from partialfl import io as pio
from partialfl.flower.config import FlowerConfig
from partialfl.flower.text import MAX_REASON, bounded
from partialfl.runtime.faults import MIN_ATTEMPTS
from partialfl.types import Params

log = logging.getLogger("flwr.partialfl")


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
    """What a Flower run produced: final θ, per-round metrics and every failure. ``config``:
    the run config (its ``spec`` decoded into a table); ``label``: what ran."""

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
    eval_withheld: int = 0  # node evaluations withheld (fewer than eval-min-clients clients)
    rounds: int = 0  # the stage's rounds (asynchronous: server steps)
    label: str = ""  # what ran: "METHOD on PROBLEM-OR-DATA, stage STAGE"

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
        rounds = max(1, self.rounds)
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
            "eval_withheld": self.eval_withheld,
        }

    def __repr__(self) -> str:
        """A summary (what ran, the last metrics, failures, the size of θ), not θ's values."""
        size = sum(int(getattr(v, "size", 1)) for v in self.theta.values())
        last = self.history[-1] if self.history else {}
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items()
                 if not isinstance(v, list | dict)}
        return (f"FlowerRunReport({self.label}, "
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
        pio.write_npz(out / "theta.npz", {n: arrays.to_numpy(v) for n, v in self.theta.items()})
        pio.write_bytes(out / "result.json",
                        json.dumps(self.to_json(), indent=1, default=float).encode())
        return out / "result.json"


class ReportLog:
    """The run's records: into the report and the log."""

    def __init__(self, report: FlowerRunReport) -> None:
        self.report = report

    def log(self, rec: dict[str, Any]) -> None:
        self.report.history.append(rec)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rec.items()
                 if k not in ("staleness",)}
        log.info("partialfl: %s", shown)


#: the last line of a Python traceback: ``[module.]TypeName: message``
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit)): (.+)$")
#: how Flower reports a ClientApp's exception: ``<class 'pkg.mod.ConfigError'>:<'message'>``
_FLOWER_REASON = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>:<'(.*?)'>", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def node_reason(reason: str) -> str:
    """A ClientApp's error as Flower reports it, written as Python does (``ConfigError:
    message``)."""
    return _FLOWER_REASON.sub(lambda m: f"{m.group(1)}: {m.group(2)}", str(reason))


def failure_cause(*texts: str) -> str | None:
    """The error that stopped a Flower run, from its processes' output (give the ServerApp's
    stream first, then the SuperNodes' logs): the last ``TypeName: message`` line of the
    first text that has one (:func:`node_reason` applied), or None."""
    for text in texts:
        found = None
        for line in (text or "").splitlines():
            m = _ERROR_LINE.match(_ANSI.sub("", line).strip())
            if m:
                found = f"{m.group(1)}: {m.group(2)}"
        if found:
            return node_reason(found)
    return None


def last_line(reason: str) -> str:
    """The last non-blank line of a node's reason (the error of a traceback), bounded."""
    lines = [x for x in node_reason(str(reason)).splitlines() if x.strip()]
    return bounded(lines[-1].strip(), 300) if lines else ""


def short(reason: str, n: int = MAX_REASON) -> str:
    """A node's reason on one printable line of at most ``n`` characters
    (:func:`~partialfl.flower.text.bounded`), Flower's wrapping of a ClientApp's exception
    unwrapped (:func:`node_reason`)."""
    return bounded(node_reason(str(reason)).strip(), n)


def record_failure(report: FlowerRunReport, round_: int, kind: str, partition: int,
                   clients, reason: str, faults=None) -> Failure:
    """Count one failed reply: a :class:`Failure` in the report, a log line and, with
    ``faults`` (the run loop's :class:`~partialfl.runtime.faults.FaultLog`), one lost client
    computation per client (``clients_failed``)."""
    f = Failure(int(round_), kind, int(partition), [int(c) for c in clients], short(reason))
    report.failures.append(f)
    log.warning("partialfl: round %d: SuperNode of partition %d (%d clients) failed: %s: %s",
                f.round, f.partition, len(f.clients), kind, f.reason)
    if faults is not None and f.clients:
        faults.client_error(f"partition {f.partition} in round {f.round}", f"{kind}: {f.reason}")
        faults.attempted += len(f.clients) - 1
        faults.failed += len(f.clients) - 1
    return f


def check_failures(cfg: FlowerConfig, report: FlowerRunReport, cause: str = "", *,
                   when: str = "running") -> None:
    """Abort once more than ``max-failure-fraction`` of the requested updates failed, judged
    as in process (:meth:`~partialfl.runtime.faults.FaultLog.check`): while ``"running"``
    after :data:`~partialfl.runtime.faults.MIN_ATTEMPTS` requested updates (a node whose
    failures arrive first never ends the run alone); at the ``"end"`` when none succeeded;
    when the run ``"stalled"`` (consecutive failures stop it) whatever the count.
    ``cause``: the likely cause beyond the failures (the server step that grew ‖θ‖ most:
    honest nodes fail after one node's huge update, and only this names that node)."""
    asked = report.requested_client_updates
    lost = report.failed_client_updates
    frac = cfg.max_failure_fraction
    judged = {"running": asked >= MIN_ATTEMPTS, "stalled": True,
              "end": lost == asked and frac < 1}[when]
    if asked and judged and lost / asked > frac:
        raise RunAborted(
            f"{lost} of {asked} requested client updates failed ({lost / asked:.0%} > "
            f"max-failure-fraction {frac:g}); failures by kind "
            f"{report.failure_counts}, partitions lost: {report.lost_partitions or 'none'}"
            + (f"; {cause}" if cause else ""))
