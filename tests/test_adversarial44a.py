"""Adversarial round 44a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes). Each test failed on the code it was written against (r44a at
f4634cd) because of the defect it names, and passes since the fix: every
:class:`~partialfl.flower.codec.WireFormatError` bounds its text
(:func:`partialfl.flower.text.bounded`), and both log lines quote it through ``short``.

Round 43's last fix made a node's *error* text reach the ServerApp's log on one printable
line of bounded length (:func:`partialfl.flower.report.short`: printable, at most 600
characters; used by :func:`~partialfl.flower.report.record_failure` for every train failure).
Two other routes log node-controlled text without it:

* Area 2, a malformed *description* is logged in full: :func:`partialfl.flower.federation.
  describe` logs ``"SuperNode %s sent an invalid description (%s); it is left out"`` with the
  raw :class:`~partialfl.flower.codec.WireFormatError` (``e``, not ``short(str(e))`` as the
  ``describe-invalid`` failure one line below). The error quotes the reply's record names
  (``sorted(keys)[:8]``: eight names of any length, repr'd so printable but never
  shortened), so one hostile SuperNode writes a log line as long as its message — seen:
  eight 200,000-character record names give a 1.6-million-character line, once per describe
  reply. Suspected root cause: ``federation.describe`` (the ``log.warning`` in its
  ``except WireFormatError``), and ``_decode_describe``'s unbounded ``sorted(keys)[:8]``.
* Area 2, a malformed *evaluation* reply is logged in full, every evaluated round:
  :func:`partialfl.flower.evaluate.eval_reduce` logs ``"partialfl: round %d: evaluation of
  partition %d refused: %s"`` with the raw error (the ``eval-invalid`` Failure beside it is
  ``short``-ened). The same eight record names of any length come back in
  ``_decode_eval``'s ``"evaluation reply records …"``; the line starts with ``partialfl:``,
  so ``partialfl flower local`` / ``deploy`` also echo it to the user's terminal
  (:func:`partialfl.flower.env.run_echoing` prints every ``partialfl:`` line). Seen: a
  1.6-million-character line per evaluated round. Suspected root cause:
  ``evaluate.eval_reduce``.

Tried and held (not tested here; run unless marked "read"): area 2 — control characters and
terminal escapes in describe/evaluation record names (repr'd: escaped, one line); the same in
train replies, SecAgg+ replies and async tasks (every failure goes through ``record_failure``
/ ``short``); (read) ``faults.client_error`` and the async stop reason (built from
``short``-ened reasons); (read) the final RuntimeError of discovery (``last[:300]``,
repr'd or ``last_line``); (read) Flower's SecAgg+ workflow logs counts only; (read)
``MessageAudit`` sanitises the node-chosen message type. Area 5 (read) — every client
computation on the node (``client_update``, the screen, encoding, evaluation, θ⁰, the
eval-units count) runs in ``kept_on_node``; the texts raised outside it (cohort check,
non-finite count, SecAgg+ weight bound) hold server-known data or counts only. Area 6
(read) — the node checks the code references of the server-sent spec before building, and
``import_callable`` checks again under the node's own ``allow-imports``.
"""

from __future__ import annotations

import io
import logging
import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import LoopbackGrid, loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402

#: a record name of 100,000 characters (the node chooses its reply's record names)
_LONG = "A" * 100_000
#: a line of the ServerApp's log may quote a node's text, shortened (report.short: 600)
_MAX_LINE = 2_000


def _longest_logged_line(tamper, **flower) -> int:
    """Run the ServerApp over a loopback federation whose partition-1 node's replies go
    through ``tamper``; the length of the longest line the ServerApp logged."""
    from partialfl.flower.server import run_server

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    run = ls_run(2, 2, eval_every=1)
    run.update({"node-wait-timeout": 2.0, "round-timeout": 2.0, **flower})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                run_server(LoopbackGrid(2, tamper=tamper), run)
            except Exception:  # noqa: BLE001 - the log is what is checked
                pass
    finally:
        logger.removeHandler(handler)
    return max((len(line) for line in buf.getvalue().splitlines()), default=0)


def test_a_malformed_description_is_logged_on_a_bounded_line(loopback, tmp_path):  # noqa: F811
    """Found: one 800,000-character log line ("SuperNode 1001 sent an invalid description
    (describe reply records ['0AAAA…"). Expected: the node's text shortened, as every other
    node text in the ServerApp's log (report.short)."""
    from flwr.app import ConfigRecord

    def tamper(partition, mtype, content):
        if partition == 1 and mtype == "query.describe":
            for i in range(8):
                content[f"{i}{_LONG}"] = ConfigRecord({"x": 1})

    longest = _longest_logged_line(tamper, **{"out-dir": str(tmp_path / "out")})
    assert longest <= _MAX_LINE, f"a log line of {longest:,} characters"


def test_a_malformed_evaluation_is_logged_on_a_bounded_line(loopback, tmp_path):  # noqa: F811
    """Found: a 800,000-character "partialfl: round 1: evaluation of partition 1 refused:
    evaluation reply records ['0AAAA…" line each evaluated round (echoed to the terminal by
    run_echoing). Expected: shortened, as the eval-invalid failure beside it."""
    from flwr.app import MetricRecord

    def tamper(partition, mtype, content):
        if partition == 1 and mtype == "evaluate":
            for i in range(8):
                content[f"{i}{_LONG}"] = MetricRecord({"x": 1.0})

    longest = _longest_logged_line(tamper, **{"out-dir": str(tmp_path / "out")})
    assert longest <= _MAX_LINE, f"a log line of {longest:,} characters"


def test_the_eval_invalid_failure_itself_is_short(loopback, tmp_path):  # noqa: F811
    """Held (control): the failure recorded in result.json is shortened."""
    import json

    from flwr.app import MetricRecord

    def tamper(partition, mtype, content):
        if partition == 1 and mtype == "evaluate":
            content["\x1b[2J" + _LONG] = MetricRecord({"x": 1.0})

    out = tmp_path / "out"
    _longest_logged_line(tamper, **{"out-dir": str(out)})
    failures = json.loads((out / "result.json").read_text())["failures"]
    assert failures and all(len(f["reason"]) <= 600 and "\x1b" not in f["reason"]
                            for f in failures)
