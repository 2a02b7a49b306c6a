"""Flower privacy (issue 13): metrics leave a SuperNode only as allowed, aggregated scalars
(checked when encoding on the client and when decoding on the server), and evaluation replies
carry only counts and sums — no per-client value reaches the server."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from flwr.app import MetricRecord  # noqa: E402

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
    ({"loss": [1.0, 2.0, 4.0]}, "metric 'loss' is not allowed"),
])
def test_server_refuses_unaggregated_or_unlisted_metrics(record, match):
    content = encode_updates(_updates({}), THETA)
    content["metrics"] = MetricRecord(record)
    with pytest.raises(WireFormatError, match=match):
        decode_updates(content, THETA, np.arange(3))


def test_evaluation_replies_are_sums_and_refused_otherwise(flower_runs):
    from partialfl.flower.server import _eval_sums

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
    with pytest.raises(ValueError, match="no per-client list"):
        _eval_sums({"clients": 4.0, "loss.sum": [1.0, 2.0]})
    with pytest.raises(ValueError, match="'correct' is not allowed"):
        _eval_sums({"clients": 4.0, "correct": 3.0})


def test_evaluation_means_equal_the_in_process_per_client_means(flower_runs):
    from partialfl.flower.builders import build_algorithm, build_problem
    from partialfl.flower.config import parse_run_config

    run, report, _ = flower_runs["nan"]
    cfg = parse_run_config(run)
    problem = build_problem(cfg)
    alg = build_algorithm(cfg, problem)
    theta = {"theta": problem.init_theta()["theta"]}
    own = np.arange(problem.num_clients)
    w = alg.solver(problem, own, theta, cfg.seed, -1).w
    loss = np.asarray(problem.loss(own, theta, w))
    np.testing.assert_allclose(report.history[0]["eval_loss"], loss.mean(), rtol=1e-12)
    np.testing.assert_allclose(report.history[0]["eval_loss_gap"],
                               (loss - problem.f_star()).mean(), rtol=1e-9)


def test_model_evaluation_sums_give_the_pooled_metrics():
    """FEMNIST path without data: a node's reply from per-client counts is sums and a
    histogram only; the server's metrics from two nodes' replies equal the pooled ones
    (accuracy, loss, client mean exactly; percentiles to the histogram's resolution)."""
    from partialfl.evaluation import summarize_counts
    from partialfl.flower.models import ACC_BINS, count_sums
    from partialfl.flower.server import _eval_sums

    g = np.random.default_rng(0)
    total = g.integers(0, 60, 400).astype(float)
    counts = {"correct": np.floor(total * g.random(400)), "total": total,
              "loss_sum": g.random(400) * total, "loss_weight": total}
    parts = [{k: v[:150] for k, v in counts.items()}, {k: v[150:] for k, v in counts.items()}]
    replies = [_eval_sums(count_sums(p)) for p in parts]
    assert all(not isinstance(v, list) or k == "acc.hist" for r in replies for k, v in r.items())
    pooled = {k: replies[0][k] + replies[1][k] for k in replies[0]}
    from partialfl.flower.models import summarize_sums

    got = summarize_sums(pooled)
    ref = summarize_counts(counts)
    assert got["eval_acc"] == pytest.approx(ref.accuracy, rel=1e-12)
    assert got["eval_loss"] == pytest.approx(ref.loss, rel=1e-12)
    assert got["eval_acc_client_mean"] == pytest.approx(ref.mean_client, rel=1e-12)
    for q, name in ((ref.p10, "p10"), (ref.p50, "p50"), (ref.p90, "p90")):
        assert abs(got[f"eval_acc_{name}"] - q) <= 5.0 / ACC_BINS + 0.01, name
