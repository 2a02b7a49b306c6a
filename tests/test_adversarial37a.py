"""Adversarial round 37a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). The test failed on the code it was written against (adv37a at a358554)
because of the defect it names, and passes since the fix.

* Area 2, the initial model of a model problem: θ⁰ comes from the SuperNode describing
  partition 0 (``federation.describe`` → ``codec.decode_theta0``), which checks that the
  record is a non-empty ArrayRecord of finite float leaves — but not the leaves' *names*,
  which are the node's to choose. The names become θ's for the whole run and reach
  ``FlowerRunReport.write``, which saves θ with ``np.savez(f, **{name: leaf})``: the names
  are keyword arguments of ``np.savez``. A leaf named ``file`` makes it raise
  ``TypeError: savez() got multiple values for argument 'file'`` — at the end of every run,
  also inside ``run_server``'s ``except RunAborted`` handler, so the ServerApp ends in a
  TypeError traceback instead of its own one-line RunAborted, and ``result.json`` (the
  report: failures, summary) is never written (``metrics.jsonl`` is; the write order is
  metrics, θ, result). A leaf named ``allow_pickle`` is swallowed by ``np.savez`` instead:
  ``theta.npz`` silently lacks it. One SuperNode's reply thus breaks the ServerApp (not a
  counted failure of that node), where the module docstring promises "a reply it refuses is
  a counted failure of its SuperNode, never an exception in the ServerApp". (The same
  ``np.savez(**names)`` pattern is in ``flower/train.py``'s ``_npz``.)

Tried and held (not tested here): replies to messages the server did not send or sent to
another node (Flower's SuperLink refuses a reply whose source is not the message's
destination; ``Link.pull`` asks only for its own message ids); the asynchronous transport
(``FlowerJobs``: every reply through ``decode_reply``; late replies of a timed-out task never
pulled; train-loss metrics of async replies unused); describe replies of late joiners
(duplicates of a held partition ignored, a foreign federation left out, clients checked
against ``partition_clients``); a node's error reasons (bounded by ``short`` to 600
characters in the report); local DP on finite bit patterns (−0.0, subnormals, values beyond
the clip norm, rows whose norm is 0: clip then noise drawn in float64 and cast to θ's dtype
— no pattern survives the noise); NaN/∞ rows (refused on the node since 36a).
"""

from __future__ import annotations

import json

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from test_adversarial34a import _client_files, _spec  # noqa: E402


def _rename_first_leaf(name: str):
    """A SuperNode of partition 0 renaming θ⁰'s first leaf to ``name`` (values unchanged)."""

    def tamper(partition, mtype, content):
        if mtype == "query.describe" and "theta0" in content:
            rec = content["theta0"]
            first = next(iter(rec.keys()))
            rec[name] = rec[first]
            del rec[first]

    return tamper


def test_a_theta0_leaf_name_from_partition_0_does_not_crash_the_server_app(loopback, tmp_path):  # noqa: F811
    """2 loopback SuperNodes on a folder of 6 client files (the EMNIST CNN, FFGG, one round),
    partition 0 naming θ⁰'s first leaf ``file``. Found: the run's replies fail (the nodes'
    models have no such leaf), the run aborts — and ``report.write`` raises ``TypeError:
    savez() got multiple values for argument 'file'`` from the RunAborted handler, so no
    ``result.json``. A correct ServerApp refuses the description (a ``describe-invalid``
    failure, then no node holds partition 0: a RuntimeError) or ends in its own RunAborted
    with the report written — never an exception raised by one node's chosen name."""
    from partialfl.flower.server import run_server

    folder = tmp_path / "clients"
    _client_files(folder)
    spec = _spec(folder, False)
    spec["personalize"]["rounds"] = 1
    out = tmp_path / "out"
    rc = {"spec": spec, "stage": "personalize", "out-dir": str(out),
          "node-wait-timeout": 2.0, "round-timeout": 30.0}
    grid = loopback(2, tamper=_rename_first_leaf("file"))
    with pytest.raises(RuntimeError) as e:  # RunAborted, or no node holds partition 0
        run_server(grid, rc)
    if type(e.value).__name__ == "RunAborted":  # the report of an aborted run is written
        report = json.loads((out / "result.json").read_text())
        assert report["summary"]["aborted"]
