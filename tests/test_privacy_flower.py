"""Flower privacy (issues 13, 21): metrics leave a SuperNode only as allowed, aggregated
scalars (checked when encoding on the client and when decoding on the server), and evaluation
replies carry only counts and sums over at least ``eval-min-clients`` clients — no per-client
value (no histogram of them, no sum over one client) reaches the server."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from flwr.app import MetricRecord, RecordDict  # noqa: E402

from partialfl.flower.codec import (  # noqa: E402
    PrivacyError,
    WireFormatError,
    decode_updates,
    encode_updates,
)
from partialfl.types import ClientUpdates  # noqa: E402

THETA = {"theta": np.zeros(4)}


def _updates(metrics):
    return ClientUpdates({"theta": np.ones((3, 4))}, np.ones(3), np.arange(3), 1, metrics)


def test_client_cannot_send_personal_values_as_metrics():
    w = np.arange(3.0)
    with pytest.raises(PrivacyError, match="refusing to send metric 'w'"):
        encode_updates(_updates({"w": w}), THETA)
    with pytest.raises(PrivacyError, match="one scalar per client"):
        encode_updates(_updates({"loss": np.ones((3, 5))}), THETA)
    content = encode_updates(_updates({"loss": np.array([1.0, 2.0, 4.0])}), THETA)
    assert dict(content["metrics"]) == {"loss.sum": 7.0, "loss.count": 3.0}


@pytest.mark.parametrize("record,match", [
    ({"w": [0.1, 0.2, 0.3]}, "metric 'w' is not allowed"),
    ({"loss.sum": [1.0, 2.0, 4.0], "loss.count": 3.0}, "must be one finite scalar"),
    ({"loss.sum": 7.0}, "needs one sum and one count"),
    # a sum over no client is a value the count does not explain (it was accepted)
    ({"loss.sum": 7.0, "loss.count": 0.0}, "a sum of 7.0 over 0 clients"),
    ({"loss": [1.0, 2.0, 4.0]}, "metric 'loss' is not allowed"),
])
def test_server_refuses_unaggregated_or_unlisted_metrics(record, match):
    content = encode_updates(_updates({}), THETA)
    content["metrics"] = MetricRecord(record)
    with pytest.raises(WireFormatError, match=match):
        decode_updates(content, THETA, np.arange(3))


def _eval(rec, **kw):
    from partialfl.flower.codec import decode_eval

    return decode_eval(RecordDict({"eval": MetricRecord(rec)}), **{
        "kind": "least-squares", "min_clients": 2, "max_clients": 4, **kw})


def test_evaluation_replies_are_sums_and_refused_otherwise(flower_runs):
    _, report, received = flower_runs["nan"]
    evals = [m for m in received if m.metadata.message_type == "evaluate"]
    assert len(evals) == 2 * 4
    for m in evals:
        rec = dict(m.content["eval"])
        assert set(rec) == {"clients", "loss.sum", "loss-gap.sum"}
        assert all(isinstance(v, float | int) for v in rec.values())
    for m in [m for m in received if m.metadata.message_type == "train" and not m.has_error()]:
        assert all(k.endswith((".sum", ".count")) for k in m.content["metrics"])
    assert report.history[-1]["eval_clients"] == 8 and np.isfinite(
        report.history[-1]["eval_loss_gap"])
    with pytest.raises(WireFormatError, match="no per-client list"):
        _eval({"clients": 4.0, "loss.sum": [1.0, 2.0], "loss-gap.sum": 1.0})
    with pytest.raises(WireFormatError, match="are not allowed"):
        _eval({"clients": 4.0, "correct": 3.0})


def test_evaluation_means_equal_the_in_process_per_client_means(flower_runs):
    from partialfl.build import build
    from partialfl.flower.config import parse_run_config

    run, report, _ = flower_runs["nan"]
    cfg = parse_run_config(run)
    built = build(cfg.run)
    problem, alg = built.problem, built.algorithm
    theta = {"theta": problem.init_theta()["theta"]}
    own = np.arange(problem.num_clients)
    w = alg.solver(problem, own, theta, cfg.seed, -1).w
    loss = np.asarray(problem.loss(own, theta, w))
    np.testing.assert_allclose(report.history[0]["eval_loss"], loss.mean(), rtol=1e-12)
    np.testing.assert_allclose(report.history[0]["eval_loss_gap"],
                               (loss - problem.f_star()).mean(), rtol=1e-9)


def test_model_evaluation_sums_give_the_pooled_metrics():
    """FEMNIST path without data: a node's reply from per-client counts is sums only (no
    histogram, no sum of per-client ratios); the server's metrics from two nodes' replies
    equal the pooled ones (accuracy, loss). The mean and percentiles over clients are not
    computed on Flower."""
    from partialfl.flower.codec import decode_eval
    from partialfl.flower.models import count_sums, summarize_sums
    from partialfl.pipeline.evaluation import summarize_counts

    g = np.random.default_rng(0)
    total = g.integers(0, 60, 400).astype(float)
    counts = {"correct": np.floor(total * g.random(400)), "total": total,
              "loss_sum": g.random(400) * total, "loss_weight": total}
    parts = [{k: v[:150] for k, v in counts.items()}, {k: v[150:] for k, v in counts.items()}]
    replies = [decode_eval(RecordDict({"eval": MetricRecord(count_sums(p, 2))}), kind="model",
                           min_clients=2, max_clients=len(p["total"])) for p in parts]
    assert all(isinstance(v, float) for r in replies for v in r.values())
    pooled = {k: replies[0][k] + replies[1][k] for k in replies[0]}
    got = summarize_sums(pooled)
    ref = summarize_counts(counts)
    assert got["eval_acc"] == pytest.approx(ref.accuracy, rel=1e-12)
    assert got["eval_loss"] == pytest.approx(ref.loss, rel=1e-12)
    assert "eval_acc_client_mean" not in got  # a sum of ratios: see test_adversarial4
    assert not any("p10" in k or "p50" in k or "p90" in k for k in got)


def test_model_node_with_too_few_evaluable_clients_sends_nothing():
    """Clients without test data do not count towards eval-min-clients."""
    from partialfl.flower.models import count_sums

    counts = {"correct": np.array([3.0, 0.0, 0.0]), "total": np.array([5.0, 0.0, 0.0]),
              "loss_sum": np.array([1.0, 0.0, 0.0]), "loss_weight": np.array([5.0, 0, 0])}
    assert count_sums(counts, 2) == {}  # one client with data: its exact accuracy, withheld
    assert count_sums(counts, 1)["acc.count"] == 1.0


def test_a_node_with_fewer_than_eval_min_clients_sends_nothing(loopback):
    """Issue 21: a node with one client sent that client's exact loss. Now (default
    eval-min-clients = 2) such a node sends an empty evaluation, counted as withheld; the
    key is configurable, and a node's own floor raises it."""
    from _flower_sims import ls_run

    from partialfl.flower.server import run_server

    run = ls_run(2, eval_every=1, spec={"problem": {"num_clients": 4}})
    grid = loopback(4)  # one client per SuperNode
    rep = run_server(grid, run)
    for h in rep.history:
        assert "eval_loss" not in h and "eval_clients" not in h and h["eval_withheld_nodes"] == 4
    assert rep.eval_withheld == 3 * 4 and rep.summary()["eval_withheld"] == 12
    assert rep.server_steps == 2 and not rep.failures  # training is unaffected
    # what the nodes sent: an empty evaluation record each
    got = []
    run_server(loopback(4, tamper=lambda p, t, c: got.append(dict(c["eval"]))
                        if t == "evaluate" else None), run)
    assert got == [{}] * 12
    # configurable: pairs of clients per node are enough for eval-min-clients = 2 ...
    rep = run_server(loopback(2), run)
    assert rep.history[-1]["eval_clients"] == 4 and rep.eval_withheld == 0
    # ... unless a SuperNode's own node config asks for more
    rep = run_server(loopback(2, node_config={"eval-min-clients": 3}), run)
    assert rep.eval_withheld == 2 * 3 and "eval_loss" not in rep.history[-1]
    # and eval-min-clients = 1 restores per-node sums over a single client
    rep = run_server(loopback(4), {**run, "eval-min-clients": 1})
    assert rep.history[-1]["eval_clients"] == 4 and rep.eval_withheld == 0


def test_evaluation_sums_that_overflow_when_pooled_give_the_finite_mean():
    """Two nodes' finite loss sums of 1.7e308 (over 2 and 3 clients) pooled to inf; the
    server's mean is taken from scaled sums: (1.7e308 + 1.7e308) / 5, finite. The same for a
    model's loss and weight sums."""
    from partialfl.flower.models import summarize_sums
    from partialfl.stats import ratio_of_sums

    assert ratio_of_sums([1.7e308, 1.7e308], [2.0, 3.0], floor=1.0) == pytest.approx(6.8e307)
    assert ratio_of_sums([3.0, 5.0], [2.0, 2.0]) == 2.0
    assert ratio_of_sums([0.0], [0.0], floor=1.0) == 0.0
    got = summarize_sums({"correct.sum": [3.0, 4.0], "total.sum": [10.0, 10.0],
                          "loss_sum.sum": [1.7e308, 1.7e308], "loss_weight.sum": [1.0, 3.0]})
    assert got["eval_acc"] == pytest.approx(0.35)
    assert got["eval_loss"] == pytest.approx(8.5e307)


@pytest.mark.parametrize(("kind", "entries", "match"), [
    ("least-squares", {"clients": 2, "loss.sum": -1.0, "loss-gap.sum": 0.0}, "loss.sum"),
    ("least-squares", {"clients": 2, "loss.sum": 1.0, "loss-gap.sum": -0.5}, "loss-gap"),
    ("least-squares", {"clients": 2, "loss.sum": 1.0, "loss-gap.sum": 2.0}, "loss-gap"),
    ("model", {"clients": 2, "correct.sum": 1, "total.sum": 2, "loss_sum.sum": 1.0,
               "loss_weight.sum": -2.0, "acc.count": 2}, "loss_weight"),
])
def test_evaluation_reply_with_impossible_signs_is_refused(kind, entries, match):
    """A node's sums of squares (least squares), of f_m − min f_m (in [0, f_m]) and of loss
    weights cannot be negative: a reply saying so is refused (a counted eval-invalid)."""
    from partialfl.flower.codec import WireFormatError, decode_eval

    rec = RecordDict({"eval": MetricRecord({k: (int(v) if k in ("clients", "correct.sum",
                                            "total.sum", "acc.count") else float(v))
                                            for k, v in entries.items()})})
    with pytest.raises(WireFormatError, match=match):
        decode_eval(rec, kind=kind, min_clients=2, max_clients=2)
    ok = dict(entries, **({"loss.sum": 1.0, "loss-gap.sum": 0.5} if kind == "least-squares"
                          else {"loss_weight.sum": 2.0}))
    rec = RecordDict({"eval": MetricRecord({k: (int(v) if k in ("clients", "correct.sum",
                                            "total.sum", "acc.count") else float(v))
                                            for k, v in ok.items()})})
    assert decode_eval(rec, kind=kind, min_clients=2, max_clients=2) is not None
