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

from partialfl import io as pio
from partialfl.flower.config import ConfigError, FlowerConfig
from partialfl.flower.report import Failure, FlowerRunReport, log
from partialfl.runtime import resume_check
from partialfl.runtime.checkpoint import ResumeError
from partialfl.runtime.sync import FileCheckpoint

#: the synchronous mode's checkpoint (the pointer) in ``out-dir``
SYNC_CHECKPOINT = "checkpoint.safetensors"


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged, or written by another configuration."""


_line = resume_check.line


#: what a failure recorded in a checkpoint holds (:class:`partialfl.flower.report.Failure`)
FAILURE_FIELDS = {"round": int, "kind": str, "partition": int, "clients": list, "reason": str}


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 2000 and "\n" not in v and "\r" not in v


def check_report(rep: Any, counters: tuple[str, ...], what: str = "checkpoint") -> dict:
    """``rep`` if it is a saved report: ``failures`` (a list of failure records: round >=
    -1, partition and clients >= 0 — partition −1 for a node left out by discovery, round
    −1 —, kind and reason one line each), the integer
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
            and f["round"] >= -1 and (f["partition"] >= 0 or f["partition"] == f["round"] == -1)
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
        # (this start's discovery failures, the only ones before the restore, are kept)
        rep.failures = [Failure(**f) for f in saved["failures"]] + rep.failures
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
        loaded = (body["state"], None, body["history"], body["grad_evals"], body["faults"])
        resume_check.check_sync(loaded, self.fresh, None, self.cfg.rounds, path,
                                CheckpointError)
        state, _, history, grads, faults = loaded
        self.extra.restore(saved.extra)
        self.report.resumed_from = state.round
        log.info("partialfl: resuming from the checkpoint of round %d in %s", state.round,
                 self.cfg.out_dir)
        return state, None, history, grads, faults


def check_async(loaded, like, num_clients: int, concurrency: int, path,
                max_arrivals: int | None = None) -> Any:
    """:func:`partialfl.runtime.resume_check.check_async` for the SuperNodes, which keep no
    client state, refusing with :class:`CheckpointError`."""
    return resume_check.check_async(loaded, like, num_clients, concurrency, path,
                                    max_arrivals, None, CheckpointError)
