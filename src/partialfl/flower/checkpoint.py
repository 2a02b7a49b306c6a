"""The synchronous ServerApp's checkpoint: the runtime's one codec
(:class:`partialfl.runtime.checkpoint.Checkpoint`, under
:class:`~partialfl.runtime.sync.FileCheckpoint`) in ``out-dir``, plus what is Flower's own —
the report so far as the transport's ``extra`` (:class:`ReportBook`), the run's identity from
the run config (:meth:`~partialfl.flower.config.FlowerConfig.fingerprint`: the spec's
identity and the non-volatile keys) and the checks a resumed state must pass, each refusal
one line (:class:`CheckpointError`, a ConfigError: exit 2 on the command line).

Files in ``out-dir``: the pointer :data:`SYNC_CHECKPOINT` and one generation
``checkpoint.g<g>.server.safetensors`` (θ, the optimizer state, the algorithm's counters, the
history, the loop's counters and the report; safetensors + JSON, never pickle), committed by
switching the pointer atomically — a kill at any instant leaves the previous checkpoint or the
new one, and temp files of a killed write are removed when it is next opened. No client-side
file: the SuperNodes keep no client state.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.arrays import is_torch, to_numpy
from partialfl.flower.config import ConfigError, FlowerConfig
from partialfl.flower.report import Failure, FlowerRunReport, log
from partialfl.runtime.checkpoint import ResumeError
from partialfl.runtime.faults import FaultLog
from partialfl.runtime.sync import FileCheckpoint

#: the synchronous mode's checkpoint (the pointer) in ``out-dir``
SYNC_CHECKPOINT = "checkpoint.safetensors"


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged, or written by another configuration."""


def _line(text: Any, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def signature(tree: Any) -> Any:
    """The structure of a state tree: dict keys, list lengths, array shapes and dtypes, scalar
    types (what a resumed state must share with a fresh one)."""
    if isinstance(tree, dict):
        return {str(k): signature(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [signature(v) for v in tree]
    if hasattr(tree, "shape"):
        a = to_numpy(tree)
        return ("array", tuple(a.shape), a.dtype.str, is_torch(tree))
    return type(tree).__name__


#: what a failure recorded in a checkpoint holds (:class:`partialfl.flower.report.Failure`)
FAILURE_FIELDS = {"round": int, "kind": str, "partition": int, "clients": list, "reason": str}


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 2000 and "\n" not in v and "\r" not in v


def history_ok(history: Any, last: int) -> bool:
    """Whether ``history`` is a list of records (dicts) of rounds 0..``last`` in order."""
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return False
    rounds = [h.get("round") for h in history]
    return all(type(r) is int and 0 <= r <= last for r in rounds) and rounds == sorted(rounds)


def check_report(rep: Any, counters: tuple[str, ...], what: str = "checkpoint") -> dict:
    """``rep`` if it is a saved report: ``failures`` (a list of failure records: round >=
    -1, partition and clients >= 0, kind and reason one line each), the integer
    ``counters`` >= 0 and, when present, ``history`` (a list of dicts) and
    ``eval_withheld`` (an integer >= 0); else :class:`CheckpointError`."""
    if not isinstance(rep, dict):
        raise CheckpointError(f"{what} report is not a dict")
    fails = rep.get("failures")
    if not isinstance(fails, list) or not all(
            isinstance(f, dict) and set(f) == set(FAILURE_FIELDS)
            and all(isinstance(f[k], t) and not isinstance(f[k], bool)
                    for k, t in FAILURE_FIELDS.items())
            and all(type(c) is int and c >= 0 for c in f["clients"])
            and f["round"] >= -1 and f["partition"] >= 0
            and _text(f["kind"]) and _text(f["reason"]) for f in fails):
        raise CheckpointError(f"{what} report has malformed failures")
    if "history" in rep and not (isinstance(rep["history"], list)
                                 and all(isinstance(h, dict) for h in rep["history"])):
        raise CheckpointError(f"{what} report has a malformed history")
    for k in counters:
        if k not in rep or type(rep[k]) is not int or rep[k] < 0:
            raise CheckpointError(f"{what} report lacks the integer {k!r} >= 0")
    if type(rep.get("eval_withheld", 0)) is not int or rep.get("eval_withheld", 0) < 0:
        raise CheckpointError(f"{what} report has a malformed eval_withheld")
    return rep


class ReportBook:
    """The report's part a resumed run continues (the checkpoint's ``extra``): failures,
    skipped rounds, requested client updates, withheld evaluations."""

    def __init__(self, report: FlowerRunReport, what: str = "checkpoint") -> None:
        self.report, self.what = report, what

    def state(self) -> dict[str, Any]:
        rep = self.report
        return {"failures": [asdict(f) for f in rep.failures],
                "skipped_rounds": rep.skipped_rounds, "requested": rep.requested_client_updates,
                "eval_withheld": rep.eval_withheld}

    def restore(self, saved: Any) -> None:
        saved = check_report(saved, ("skipped_rounds", "requested"), self.what)
        rep = self.report
        rep.failures = [Failure(**f) for f in saved["failures"]]
        rep.skipped_rounds = saved["skipped_rounds"]
        rep.requested_client_updates = saved["requested"]
        rep.eval_withheld = saved.get("eval_withheld", 0)


class FlowerCheckpoint(FileCheckpoint):
    """The ServerApp's checkpoint ``out-dir``/:data:`SYNC_CHECKPOINT` for
    :func:`partialfl.runtime.sync.run_rounds`: a :class:`FileCheckpoint` validated against
    the run config's fingerprint, with the report so far as its ``extra``; :meth:`load`
    checks everything it read (a state must have the structure, shapes and dtypes of
    ``fresh``, this run's initial state) and refuses anything else with one line."""

    def __init__(self, cfg: FlowerConfig, report: FlowerRunReport, fresh) -> None:
        path = Path(cfg.out_dir) / SYNC_CHECKPOINT
        super().__init__(path, cfg.fingerprint(), private=False,
                         extra=ReportBook(report, f"checkpoint {path}"))
        self.cfg, self.report, self.fresh = cfg, report, fresh

    def load(self):
        """``(state, None, history, grad_evals, fault counters)`` of the committed
        generation (the report restored); :class:`CheckpointError` if there is none or it is
        not this run's, damaged or malformed."""
        path = self.path
        if not self.codec.exists():
            raise CheckpointError(f"run-config key 'resume': no checkpoint at {path}")
        try:
            saved = self.codec.load(self.device)
        except ResumeError as e:
            raise CheckpointError(f"refusing to resume: {_line(e)}") from None
        except (pio.FileFormatError, OSError) as e:
            raise CheckpointError(_line(e)) from None
        if saved is None:  # removed meanwhile
            raise CheckpointError(f"run-config key 'resume': no checkpoint at {path}")
        body = saved.server
        if not isinstance(body, dict) or set(body) != {"state", "history", "grad_evals",
                                                       "faults"}:
            raise CheckpointError(f"checkpoint {path}: the server file is not a partialfl run "
                                  "state")
        if saved.client is not None:
            raise CheckpointError(f"checkpoint {path} holds client state; the SuperNodes keep "
                                  "none")
        state = self._state(body["state"])
        if state.round > self.cfg.rounds:
            raise CheckpointError(f"checkpoint {path}: round {state.round} is past this "
                                  f"stage's {self.cfg.rounds} rounds")
        history, grads, faults = body["history"], body["grad_evals"], body["faults"]
        if not history_ok(history, state.round):
            raise CheckpointError(f"checkpoint {path} has a malformed history (records of "
                                  f"rounds 0..{state.round} in order)")
        if type(grads) is not int or grads < 0:
            raise CheckpointError(f"checkpoint {path}: grad_evals must be an integer >= 0")
        try:
            FaultLog.check_state(faults)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {_line(e)}") from None
        self.extra.restore(saved.extra)
        self.report.resumed_from = state.round
        log.info("partialfl: resuming from the checkpoint of round %d in %s", state.round,
                 self.cfg.out_dir)
        return state, None, history, grads, faults

    def _state(self, state):
        """``state`` if it is a server state shaped like this run's fresh one."""
        return check_state(state, self.fresh, self.path)


def check_state(state, like, path):
    """``state`` if it is a server state shaped like ``like`` (this run's fresh one: θ and
    optimizer state of the same structure, shapes and dtypes, θ finite, a round >= 0, the
    algorithm's counters of its types); else :class:`CheckpointError` naming ``path``."""
    from partialfl.algorithms.base import ServerState

    if not isinstance(state, ServerState) or not isinstance(state.theta, dict) or \
            not isinstance(state.extra, dict):
        raise CheckpointError(f"checkpoint {path}: the server state is malformed")
    if type(state.round) is not int or state.round < 0:
        raise CheckpointError(f"checkpoint {path}: the round must be an integer >= 0")
    for part, got, ref in (("θ", state.theta, like.theta),
                           ("optimizer state", state.opt_state, like.opt_state)):
        if signature(got) != signature(ref):
            raise CheckpointError(f"checkpoint {path}: the {part} differs in structure, "
                                  "shape or dtype from this run's model and optimizer")
    for k, v in state.extra.items():  # the algorithm's own, or counters it adds later
        if k in like.extra and like.extra[k] == () and _buffered(v, like.theta):
            continue  # FedBuff's buffer of updates received
        if k in like.extra and signature(v) != signature(like.extra[k]) or \
                k not in like.extra and (type(v) not in (int, float) or v != v):
            raise CheckpointError(f"checkpoint {path}: algorithm state "
                                  f"{str(k)[:40]!r} differs from this run's")
    if not all(np.isfinite(to_numpy(v)).all() for v in state.theta.values()):
        raise CheckpointError(f"checkpoint {path}: θ is not finite")
    return state


def _buffered(buf: Any, theta: dict) -> bool:
    """Whether ``buf`` is a tuple of received updates for ``theta`` (FedBuff's buffer): per
    update n rows of each θ leaf, finite, n finite weights >= 0 and n client ids."""
    from partialfl.types import ClientUpdates

    def ok(u: Any) -> bool:
        if not isinstance(u, ClientUpdates) or not isinstance(u.vectors, dict) or \
                set(u.vectors) != set(theta):
            return False
        w, c = to_numpy(u.weights), to_numpy(u.cohort)
        n = len(w) if w.ndim == 1 else -1
        return (n >= 1 and c.shape == (n,) and c.dtype.kind in "iu"
                and bool(np.isfinite(w).all() and (w >= 0).all())
                and all(to_numpy(v).shape == (n, *to_numpy(theta[k]).shape)
                        and np.isfinite(to_numpy(v)).all() for k, v in u.vectors.items()))

    return isinstance(buf, tuple) and all(ok(u) for u in buf)


#: a resumed asynchronous server's bookkeeping (:meth:`AsyncServer.snapshot`)
SNAPSHOT_KEYS = {"state", "busy", "next_job", "arrivals", "grad_evals", "events", "rows",
                 "history", "time", "faults"}
_EVENT_KINDS = ("dispatch", "arrive", "lost")


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _when(v: Any) -> bool:
    return type(v) in (int, float) and v == v and 0 <= v < float("inf")


def check_async(loaded, like, num_clients: int, concurrency: int, path,
                max_arrivals: int | None = None) -> Any:
    """``loaded`` (an asynchronous checkpoint's ``(snapshot, client state, jobs)``) if the
    server's bookkeeping and every job in flight are this run's kind: each state as
    :func:`check_state`, ``busy`` one flag per client, the counters integers >= 0 consistent
    with one record per applied update (``arrivals`` rows, round <= arrivals), events and
    records of their fields' types, each job's client and slot in range and its θ version no
    newer than the server's, at most ``max_arrivals`` applied updates; else
    :class:`CheckpointError`."""
    snap, client_state, jobs = loaded
    bad = f"checkpoint {path}: the asynchronous server's bookkeeping"
    if not isinstance(snap, dict) or set(snap) != SNAPSHOT_KEYS:
        raise CheckpointError(f"{bad} is malformed")
    if client_state is not None:
        raise CheckpointError(f"checkpoint {path} holds client state; the SuperNodes keep none")
    state = check_state(snap["state"], like, path)
    busy = snap["busy"]
    if not hasattr(busy, "shape") or to_numpy(busy).shape != (num_clients,) or \
            to_numpy(busy).dtype != bool:
        raise CheckpointError(f"{bad}: busy must be {num_clients} flags (one per client)")
    counts = {k: snap[k] for k in ("next_job", "arrivals", "grad_evals")}
    rows, events, history = snap["rows"], snap["events"], snap["history"]
    if not all(_count(v) for v in counts.values()) or not _when(snap["time"]):
        raise CheckpointError(f"{bad}: next_job, arrivals, grad_evals and time must be "
                              "numbers >= 0")
    if max_arrivals is not None and snap["arrivals"] > max_arrivals:
        raise CheckpointError(f"{bad}: {snap['arrivals']} updates applied, past this stage's "
                              f"{max_arrivals}")
    if not (isinstance(rows, list) and len(rows) == snap["arrivals"] >= state.round
            and all(isinstance(r, tuple) and len(r) == 9 and all(_when(x) for x in r)
                    for r in rows)):
        raise CheckpointError(f"{bad}: the records of applied updates do not match its "
                              "arrivals and round")
    if not (isinstance(events, list) and all(
            isinstance(e, tuple) and len(e) == 6 and e[0] in _EVENT_KINDS
            and _when(e[1]) and all(_count(x) for x in e[2:]) for e in events)):
        raise CheckpointError(f"{bad}: the event log is malformed")
    if not history_ok(history, state.round):
        raise CheckpointError(f"{bad}: the history is malformed")
    try:
        FaultLog.check_state(snap["faults"])
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {_line(e)}") from None
    slots = set()
    for job, st, rows_sent in jobs:
        f = job.__dict__
        if not (all(_count(f[k]) for k in ("job", "client", "slot", "version"))
                and _when(f["dispatch_time"]) and f["job"] < snap["next_job"]
                and f["client"] < num_clients and f["slot"] < concurrency
                and f["slot"] not in slots and f["version"] <= state.round
                and rows_sent is None):
            raise CheckpointError(f"checkpoint {path}: a job in flight is malformed")
        slots.add(f["slot"])
        check_state(st, like, path)
    return loaded
