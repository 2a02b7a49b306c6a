"""Adversarial round 39a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes). Each test fails on the code it was written against (adv39a at
1707fcd) because of the defect it names.

* Area 2, the weights of a train reply, again (round 38a's fix is partial): the codec accepts
  per client any finite weight ``0 <= w_m <= max(1, n_m)``, so a SuperNode may send all
  zeros. Round 38a's fix skips the step only in :func:`partialfl.runtime.sync._step`, and
  only when ``algorithm.aggregator.weighted`` is true. But every rule other than the mean
  refuses all-zero weights *whether it weighs or not*: each calls
  :func:`partialfl.aggregation.common.prepare` with the weights, which raises ``ValueError:
  <rule>: weights must be finite, non-negative, not all zero`` — the coordinate-wise median,
  the (unweighted) geometric median, centered clipping, Krum, trimmed mean, …; and a
  pre-aggregation wrapper (static clipping, NNM, ARC, bucketing) has no ``weighted``
  attribute and raises the same from its own ``prepare``, even around a weighted mean. So
  with ``[aggregation] name = "cm"`` (or ``gm``, ``cc``, or ``mean`` weighted with ``clip``)
  a round whose arrived updates all come from the node sending zeros ends ``run_server`` in
  that ValueError: not a counted failure of the node, not the ServerApp's own RunAborted, no
  ``result.json``.
* Area 2, same, asynchronous: the asynchronous server step
  (:meth:`partialfl.runtime.asynchronous.server.AsyncServer.arrive` → the FedAsync /
  FedBuff rule's ``server_update``) has no zero-weight handling at all: one SuperNode's
  zero-weight reply under a weighted mean (``mean: weighted mean with all weights zero``)
  or any non-mean rule ends the asynchronous ServerApp in a ValueError traceback.

  Suspected root cause for both: the zero-total-weight case is handled only in the
  synchronous ``_step`` and only for aggregators that say ``weighted``; it is neither refused
  on the wire (``codec._decode_updates``) nor handled where the rules are called
  (``aggregation.common.prepare`` refusing zero weights for rules that ignore them;
  the asynchronous server's step).

Tried and held (not tested here): area 2 — zero weights with the mean unweighted (the mean
ignores them); evaluation replies (counts ≤ the node's clients, ``acc.count`` ≤
``clients``, eval-units bounds, sums of 1.7e308, a zero-weight loss); DP adaptive clipping's
server metric ``dp_unclipped.sum`` of ±1e300 from a node (the server clips each bit to
[0, 1]); SecAgg+ contributions (metric names in the clear FitRes are finite floats the
server never reads; counts checked; weights bounded on the node). Area 5 (read) — a
SuperNode's ``evaluate`` decodes the server's θ without comparing its leaves to the run's
(only sums over at least eval-min-clients clients leave); local DP's clients still send
the base's ``grad_evals`` (a bounded int: listed as known); a node with guards refuses the
spec's ``[data]``. Area 6 (read) — code named by a spec is only ``model.name`` with ``:``
and ``plugins``; the node checks both before parsing, the build re-checks under
``allow_code(False)``; other config-named imports are fixed module names (trackers,
flwr-datasets partitioners); installed entry-point plugins are the operator's own.
"""

from __future__ import annotations

import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


def _zero_weights(partition, mtype, content):
    """The SuperNode of partition 1 sends weight 0 for every client (within the bound)."""
    if mtype == "train" and partition == 1:
        content["update"]["weights"] = [0.0] * len(content["update"]["weights"])


def _run(loopback, out, spec):  # noqa: F811
    """Least squares (8 clients) on 2 loopback SuperNodes, FedAvg weighted by examples, one
    client per round for 8 rounds/steps; partition 1 replies with weights 0. Returns the
    train messages' destinations."""
    from partialfl.flower.server import run_server

    base = {"method": {"algorithm": "fedavg", "weighting": "examples"},
            "personalize": {"client": {"name": "gd", "tau": 5}, "server": {"lr": 0.05}}}
    run = ls_run(8, 1, spec={**base, **spec})
    run.update({"node-wait-timeout": 2.0, "out-dir": str(out)})
    grid = loopback(2, tamper=_zero_weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_server(grid, run)
        except RuntimeError:  # the ServerApp's own RunAborted: acceptable
            pass
        finally:
            asked = [m.metadata.dst_node_id for m in grid.sent
                     if m.metadata.message_type == "train"]
    return asked


@pytest.mark.xfail(strict=True, reason="sync._step skips a zero-weight round only when "
                   "aggregator.weighted; every non-mean rule and every pre-aggregation "
                   "wrapper refuses all-zero weights in aggregation.common.prepare "
                   "(ValueError out of run_server)")
@pytest.mark.parametrize("aggregation", [
    {"name": "cm"},
    {"name": "gm"},
    {"name": "cc"},
    {"name": "mean", "weighted": True, "clip": 1.0},
], ids=["cm", "gm-unweighted", "cc", "weighted-mean-clipped"])
def test_a_node_sending_zero_weights_does_not_crash_a_robust_or_wrapped_rule(
        loopback, tmp_path, aggregation):  # noqa: F811
    """Round 38a's scenario under an aggregation rule other than the plain mean. Found:
    ``run_server`` raises ``ValueError: coordinate-wise median: weights must be finite,
    non-negative, not all zero`` (likewise ``geometric median``, ``centered clipping``,
    ``static clipping``) in the first round that samples only partition 1's clients, and
    out-dir has no report. Expected: the node's replies refused as counted failures, or the
    round skipped (θ unchanged) — the run completing, or ending in its own RunAborted, with
    its report written."""
    out = tmp_path / "out"
    asked = _run(loopback, out, {"aggregation": aggregation})
    assert 1001 in asked  # partition 1's node was asked (and replied with zero weights)
    assert (out / "result.json").exists(), "the run's report was not written"


@pytest.mark.xfail(strict=True, reason="the asynchronous server step has no zero-weight "
                   "handling: a node's all-zero weights raise ValueError out of run_server")
@pytest.mark.parametrize("aggregation", [{"name": "mean", "weighted": True}, {"name": "cm"}],
                         ids=["weighted-mean", "cm"])
def test_a_node_sending_zero_weights_does_not_crash_an_async_server_app(
        loopback, tmp_path, aggregation):  # noqa: F811
    """FedAsync (concurrency 1: every server step applies one client's update). Found:
    ``run_server`` raises ``ValueError: mean: weighted mean with all weights zero`` (or the
    median's ``weights must be finite, non-negative, not all zero``) out of
    ``AsyncServer.arrive`` at the first update from partition 1, and out-dir has no report.
    Expected as in the synchronous case: a counted failure of the node or a skipped step,
    and the report written."""
    out = tmp_path / "out"
    asked = _run(loopback, out, {"aggregation": aggregation,
                                 "asynchronous": {"rule": "fedasync", "concurrency": 1}})
    assert 1001 in asked
    assert (out / "result.json").exists(), "the run's report was not written"
