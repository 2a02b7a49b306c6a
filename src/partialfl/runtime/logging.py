"""The metric records of a run (its *history*) and their JSON-lines files.

Every record of every loop — synchronous rounds (:func:`partialfl.runtime.sync.run_rounds`),
the asynchronous loop (:func:`partialfl.runtime.asynchronous.drive`, simulated or on worker
processes) — has these keys (:func:`base_record`), then the evaluator's metrics:

* ``round`` — server steps taken (``state.round``): rounds run (sync), ``server_update``
  calls (async; FedBuff steps once per K arrivals);
* ``step`` — the loop's progress: rounds run (sync, = ``round``), client updates applied
  (async: arrivals);
* ``time`` — seconds since the start (wall-clock for rounds and worker processes, simulated
  for the simulated clock);
* ``grad_evals`` — local gradient evaluations behind θ: one client's count per round summed
  over rounds (sync: clients of a round do equal work), each applied update's count summed
  (async);
* ``clients_failed``, ``updates_nonfinite``, ``updates_refused``, ``worker_deaths`` — the
  fault counters (:class:`partialfl.runtime.faults.FaultLog`).
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

#: the keys every history record has (see the module docstring)
RECORD_KEYS = ("round", "step", "time", "grad_evals", "clients_failed", "updates_nonfinite",
               "updates_refused", "worker_deaths")


def base_record(round_: int, step: int, time: float, grad_evals: int,
                faults: dict[str, int]) -> dict[str, Any]:
    """A record's common keys (:data:`RECORD_KEYS`); ``faults``: ``FaultLog.record()``."""
    return {"round": int(round_), "step": int(step), "time": float(time),
            "grad_evals": int(grad_evals), **faults}


def train_record(round_: int, sent, kept, problem, seconds: float) -> dict[str, Any]:
    """One round's training record: ``round`` (after the round), ``train_loss`` — the mean
    over the clients whose update was kept of the ``train_loss`` each reported (the allowed
    per-client metric, :mod:`partialfl.privacy`; absent if none reported one), ``clients``
    kept, ``examples`` (their training examples), ``seconds`` of the round,
    ``examples_per_s`` = examples / seconds and ``rounds_per_s`` = 1 / seconds.

    ``sent``: the cohort's message before screening (ClientUpdates or None), ``kept``: the
    client ids that passed (None: none)."""
    import numpy as np

    kept = np.asarray([] if kept is None else kept, dtype=int)
    rec: dict[str, Any] = {"round": int(round_), "clients": int(kept.size)}
    loss = None if sent is None else sent.metrics.get("train_loss")
    if loss is not None and kept.size:
        pos = {int(c): i for i, c in enumerate(np.asarray(sent.cohort))}
        vals = np.asarray(loss, dtype=float)[[pos[int(c)] for c in kept if int(c) in pos]]
        vals = vals[np.isfinite(vals)]
        if vals.size:
            rec["train_loss"] = float(vals.mean())
    n = float(np.sum(problem.num_examples(kept))) if kept.size else 0.0
    sec = max(float(seconds), 1e-9)
    rec.update(examples=n, seconds=float(seconds), examples_per_s=n / sec,
               rounds_per_s=1.0 / sec)
    return rec


def _clean(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlLogger:
    """Appends metric records to ``path`` (created with its parent folders); line-buffered so
    nothing is lost if a run is interrupted."""

    def __init__(self, path: str | Path, append: bool = False, **static: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink():  # a planted link would redirect the log onto its target
            raise ValueError(f"{self.path} is a symbolic link: a run's log is never written "
                             "through one (remove it)")
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        fd = os.open(self.path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
        self._f = open(fd, "a" if append else "w", buffering=1)  # noqa: SIM115
        self.static = static

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (with the logger's static fields; values made JSON-safe) as a line."""
        rec = {**self.static, **{k: _clean(v) for k, v in record.items()}}
        self._f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def __enter__(self) -> JsonlLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read records back; string "nan"/"inf" become floats. A corrupt line (e.g. the last
    one of an interrupted run: the log is appended line by line) gives a named error."""
    from partialfl.io import FileFormatError, open_regular

    out = []
    with open_regular(path) as raw:  # (a FIFO in a received run folder hung `report`)
        f = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        for i, line in enumerate(f, 1):
            if line.strip():
                try:  # (ValueError: also an integer of more than 4300 digits)
                    rec = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise FileFormatError(f"{path}, line {i}: not a JSON record (truncated?): "
                                          f"{str(e)[:200]}") from None
                if not isinstance(rec, dict):  # a list or a string crashed the readers
                    raise FileFormatError(f"{path}, line {i}: not a JSON record (an object): "
                                          f"a {type(rec).__name__}")
                for k, v in rec.items():
                    if v in ("nan", "inf", "-inf"):
                        rec[k] = float(v)
                out.append(rec)
    return out
