"""Flower security (issue 13): a client's non-finite weights or vectors are refused, counted
and skipped (never reach θ), and NNM never runs with δ = 0 from the default
``aggregator-delta``."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from partialfl.aggregation import Bucketing, Krum, NearestNeighborMixing  # noqa: E402
from partialfl.flower.codec import WireFormatError, decode_updates, encode_updates  # noqa: E402
from partialfl.flower.config import ConfigError, build_aggregator, parse_run_config  # noqa: E402
from partialfl.types import ClientUpdates  # noqa: E402

THETA = {"theta": np.zeros(4)}


def _content(k=3):
    rng = np.random.default_rng(0)
    return encode_updates(ClientUpdates({"theta": rng.standard_normal((k, 4))}, np.ones(k),
                                        np.arange(k), 1), THETA)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_codec_refuses_bad_weights(bad):
    content = _content()
    content["update"]["weights"] = [1.0, bad, 1.0]
    with pytest.raises(WireFormatError, match="weights .* must be 3 finite numbers >= 0"):
        decode_updates(content, THETA, np.arange(3))


def test_codec_refuses_nonfinite_or_foreign_extras():
    from partialfl.flower.codec import params_to_record

    content = _content()
    content["extra.dc"] = params_to_record({"theta": np.full((3, 4), np.nan)})
    with pytest.raises(WireFormatError, match="extra 'extra.dc' is not finite"):
        decode_updates(content, THETA, np.arange(3))
    content = _content()
    content["extra.dc"] = params_to_record({"w": np.zeros((3, 2))})
    with pytest.raises(WireFormatError, match="not θ leaves"):
        decode_updates(content, THETA, np.arange(3))


def test_nan_weight_client_is_rejected_counted_and_skipped(flower_runs):
    _, report, _ = flower_runs["nan"]
    (f,) = report.failures
    assert (f.round, f.kind, f.partition, f.clients) == (1, "invalid", 1, [4, 5, 6, 7])
    assert "finite numbers >= 0" in f.reason
    assert report.server_steps == 3 and np.isfinite(report.theta["theta"]).all()
    assert report.history[2]["failed_clients"] == 4 and report.history[2]["clients"] == 4


def test_nnm_with_the_default_delta_derives_or_refuses():
    base = {"algorithm": "br-ffgg", "nnm": True}
    # cm has no δ of its own and aggregator-delta = 0 (the default): refused at parse time
    with pytest.raises(ConfigError, match="set aggregator-delta > 0"):
        parse_run_config({**base, "aggregator": "cm"})
    # krum has one (0.1): NNM mixes with k − ⌊0.1k⌋ inputs, never all k
    agg = build_aggregator(parse_run_config({**base, "aggregator": "krum"}))
    assert isinstance(agg, NearestNeighborMixing) and agg.delta == pytest.approx(0.1)
    agg = build_aggregator(parse_run_config({**base, "aggregator": "cm",
                                             "aggregator-delta": 0.2, "bucket-size": 2}))
    assert isinstance(agg, Bucketing) and agg.inner.delta == pytest.approx(0.4)
    agg = build_aggregator(parse_run_config({**base, "aggregator": "multi-krum",
                                             "nnm": False, "bucket-size": 2}))
    assert isinstance(agg.inner, Krum) and agg.inner.delta == pytest.approx(0.2)
    X = np.random.default_rng(0).standard_normal((20, 5))
    X[0] = 1e30
    out = build_aggregator(parse_run_config({**base, "aggregator": "krum"}))(X, None)
    assert np.abs(out).max() < 100
