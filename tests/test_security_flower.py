"""Flower security (issues 13, 21): one SuperNode can neither break nor crash the ServerApp.
Every reply is checked against what the server sent (leaves, shapes, dtype, finite values,
declared extras, weights bounded by the node's declared example counts, the asked clients); a
bad reply is a counted failure of its node (report and ``clients_failed``), never an
exception."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_sims import ls_run

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from partialfl.flower.codec import (  # noqa: E402
    WireFormatError,
    decode_describe,
    decode_eval,
    decode_theta0,
    decode_updates,
    encode_updates,
    params_to_record,
)
from partialfl.types import ClientUpdates  # noqa: E402

THETA = {"theta": np.zeros(4)}


def _content(k=3, dtype=np.float64):
    rng = np.random.default_rng(0)
    return encode_updates(ClientUpdates({"theta": rng.standard_normal((k, 4)).astype(dtype)},
                                        np.ones(k), np.arange(k), 1), THETA)


@pytest.mark.parametrize("bad,match", [(np.nan, "reply weight must be finite"),
                                       (np.inf, "reply weight must be finite"),
                                       (-1.0, "weights must be 3 finite numbers >= 0")])
def test_codec_refuses_bad_weights(bad, match):
    content = _content()
    content["update"]["weights"] = [1.0, bad, 1.0]
    with pytest.raises(WireFormatError, match=match):
        decode_updates(content, THETA, np.arange(3))


def test_codec_refuses_wrong_dtypes_and_weights_above_the_declared_example_counts():
    """Issue 21: float64 vectors for a float32 θ (θ would turn float64 and every later
    ClientApp fail); a weight of 1e39 (finite in float64, inf in float32: NaN θ under
    'examples' weighting) — refused, naming the client and the bound."""
    theta32 = {"theta": np.zeros(4, np.float32)}
    with pytest.raises(WireFormatError, match="dtype float64, θ is float32"):
        decode_updates(_content(dtype=np.float64), theta32, np.arange(3))
    up, _ = decode_updates(_content(dtype=np.float32), theta32, np.arange(3),
                           max_weights=[1.0, 1.0, 1.0])
    assert up.vectors["theta"].dtype == np.float32
    content = _content()
    content["update"]["weights"] = [30.0, 1e39, 1.0]
    with pytest.raises(WireFormatError, match="client 1 sent 1e.39, bound 50"):
        decode_updates(content, THETA, np.arange(3), max_weights=[30.0, 50.0, 1.0])
    content["update"]["weights"] = [30.0, 50.0, 1.0]  # at the bound: accepted
    decode_updates(content, THETA, np.arange(3), max_weights=[30.0, 50.0, 1.0])


class _Declares:
    """An algorithm that declares the extra payload 'dc' (as Scaffold sends Δc)."""

    extra_names = ("dc",)


def test_codec_accepts_declared_extras_only_theta_shaped_and_finite():
    content = _content()
    content["extra.aux"] = params_to_record({"theta": np.zeros((3, 4))})
    with pytest.raises(WireFormatError, match=r"unexpected \['extra.aux'\]"):
        decode_updates(content, THETA, np.arange(3))  # nothing declared
    with pytest.raises(WireFormatError, match=r"lacks record\(s\) \['extra.dc'\]"):
        decode_updates(_content(), THETA, np.arange(3), algorithm=_Declares())
    for tree, match in (({"theta": np.full((3, 4), np.nan)}, "not finite for clients"),
                        ({"w": np.zeros((3, 2))}, "leaves differ from θ's"),
                        ({"theta": np.zeros((3, 5))}, "has shape"),
                        ({"theta": np.zeros((3, 4), np.float32)}, "dtype float32")):
        content = _content()
        content["extra.dc"] = params_to_record(tree)
        with pytest.raises(WireFormatError, match=match):
            decode_updates(content, THETA, np.arange(3), algorithm=_Declares())
    content = _content()
    content["extra.dc"] = params_to_record({"theta": np.ones((3, 4))})
    up, _ = decode_updates(content, THETA, np.arange(3), algorithm=_Declares())
    assert set(up.extra) == {"dc"}


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c.__setitem__("vectors", ConfigRecord({"theta": "x"})), "must be a ArrayRecord"),
    (lambda c: c.__setitem__("update", MetricRecord({"weights": 1.0})), "must be a ConfigRecord"),
    (lambda c: c["update"].__setitem__("grad-evals", "many"), "grad-evals must be an integer"),
    (lambda c: c["update"].__setitem__("cohort", [0, 1, True]), "cohort id must be an integer"),
    (lambda c: c["update"].__setitem__("weights", ["1", "1", "1"]), "must be one number"),
    (lambda c: c["update"].__setitem__("weights", [10 ** 400] * 3), "must be finite"),
    (lambda c: c.__setitem__("vectors", ArrayRecord({"theta": Array(np.array(["a"] * 12))})),
     "not a float dtype"),
    (lambda c: c.__setitem__("vectors", ArrayRecord({"theta": Array(
        dtype="float64", shape=(3, 4), stype="numpy.ndarray", data=b"\x80\x04junk")})),
     "does not decode"),
    (lambda c: c.__setitem__("metrics", ConfigRecord({"loss.sum": "w as text"})),
     "must be a MetricRecord"),
    (lambda c: c.__setitem__("metrics", MetricRecord({"loss.sum": 1.0, "loss.count": 4})),
     r"loss.count' must be an integer in \[0, 3\]"),
])
def test_codec_refuses_malformed_records_with_one_line(mutate, match):
    content = _content()
    mutate(content)
    with pytest.raises(WireFormatError, match=match) as e:
        decode_updates(content, THETA, np.arange(3))
    assert "\n" not in str(e.value)


def test_describe_and_initial_model_are_checked():
    def info(**kw):
        base = {"partition-id": 1, "num-partitions": 2, "num-clients": 8,
                "clients": [4, 5, 6, 7], "num-examples": [10.0] * 4, "eval-units": [40.0, 40.0],
                "torch": 0}
        return RecordDict({"info": ConfigRecord({**base, **kw})})

    assert decode_describe(info())["clients"] == [4, 5, 6, 7]
    for kw, match in (({"clients": [0, 1, 2, 3]}, "clients of partition 1 must be 4..7"),
                      ({"partition-id": 2}, "partition-id must be an integer in"),
                      ({"num-examples": [1e39] * 4}, "num-examples must be in"),
                      ({"eval-units": [1e39, 1.0]}, "eval-units must be in"),
                      ({"eval-units": [float("nan"), 1.0]}, "eval-units"),
                      ({"eval-units": [1.0]}, "eval-units"),
                      ({"num-clients": 10 ** 12}, "num-clients must be an integer in"),
                      ({"torch": "yes"}, "torch must be an integer")):
        with pytest.raises(WireFormatError, match=match):
            decode_describe(info(**kw))
    with pytest.raises(WireFormatError, match="not finite"):
        decode_theta0(params_to_record({"theta": np.array([np.nan])}))
    with pytest.raises(WireFormatError, match="not a float dtype"):
        decode_theta0(params_to_record({"theta": np.array([1, 2])}))


def test_evaluation_replies_of_another_shape_are_refused():
    ok = {"clients": 4.0, "loss.sum": 2.0, "loss-gap.sum": 1.0}
    assert decode_eval(RecordDict({"eval": MetricRecord(ok)}), kind="least-squares",
                       min_clients=2, max_clients=4) == ok
    for rec, match in (({**ok, "acc.hist": [1.0] * 7}, "are not allowed"),
                       ({"clients": 4.0, "loss.sum": 2.0}, "are not allowed"),
                       ({**ok, "clients": 5.0}, "the node holds 4"),
                       ({**ok, "clients": 1.0}, "fewer than eval-min-clients = 2"),
                       ({**ok, "loss.sum": [1.0, 1.0]}, "no per-client list")):
        with pytest.raises(WireFormatError, match=match):
            decode_eval(RecordDict({"eval": MetricRecord(rec)}), kind="least-squares",
                        min_clients=2, max_clients=4)


# -- end to end: a hostile SuperNode against a real ServerApp (in process, no Ray) -----------
def _set_vectors_dtype(c):
    c["vectors"] = params_to_record({n: a.numpy().astype(np.float32)
                                     for n, a in c["vectors"].items()})


TAMPER = {
    # θ vectors in another dtype (the float64-into-float32 case of issue 21, mirrored: LS θ
    # is float64)
    "dtype": ("train", _set_vectors_dtype),
    # an extra record the algorithm does not declare (crashed the ServerApp with KeyError)
    "extra": ("train", lambda c: c.__setitem__(
        "extra.aux", params_to_record({n: a.numpy() for n, a in c["vectors"].items()}))),
    # a weight far above the node's declared example counts ('examples' weighting)
    "weight": ("train", lambda c: c["update"].__setitem__(
        "weights", [1e39] * len(c["update"]["weights"]))),
    # a record of the wrong kind (AttributeError in the old decoder)
    "record": ("train", lambda c: c.__setitem__("vectors", ConfigRecord({"theta": "x"}))),
    # an evaluation with a histogram of another length / keys the server does not expect
    "eval": ("evaluate", lambda c: c["eval"].__setitem__("acc.hist", [1.0] * 7)),
}


@pytest.mark.parametrize("attack", sorted(TAMPER))
def test_a_hostile_supernode_is_counted_never_breaks_the_server(loopback, attack):
    from partialfl.flower.server import run_server

    kind, fn = TAMPER[attack]

    def tamper(partition, mtype, content):
        if partition == 1 and mtype == kind:
            fn(content)

    run = ls_run(3, eval_every=1, spec={"method": {"weighting": "examples"},
                                        "max_failure_fraction": 0.6})
    report = run_server(loopback(2, tamper=tamper), run)
    clean = run_server(loopback(2), {**run, "fault-injection": "crash:partition=1,round=-1"})
    assert report.server_steps == 3 and not report.aborted
    kinds = {f.kind for f in report.failures}
    assert kinds == ({"eval-invalid"} if kind == "evaluate" else {"invalid"})
    assert all(f.partition == 1 and "\n" not in f.reason for f in report.failures)
    theta = report.theta["theta"]
    assert theta.dtype == np.float64 and np.isfinite(theta).all()
    if kind == "train":  # node 1 counted as lost, in the report and in the JSONL counters
        assert report.failed_client_updates == 3 * 4
        assert [h["clients_failed"] for h in report.history] == [0, 4, 8, 12]
        np.testing.assert_array_equal(theta, clean.theta["theta"])  # = node 1 dropped
    else:  # training untouched; evaluation from node 0 alone
        assert report.failed_client_updates == 0
        assert all(h["eval_clients"] == 4 for h in report.history)


def test_nan_weight_client_is_rejected_counted_and_skipped(flower_runs):
    _, report, _ = flower_runs["nan"]
    (f,) = report.failures
    assert (f.round, f.kind, f.partition, f.clients) == (1, "invalid", 1, [4, 5, 6, 7])
    assert "reply weight must be finite" in f.reason
    assert report.server_steps == 3 and np.isfinite(report.theta["theta"]).all()
    assert report.history[2]["failed_clients"] == 4 and report.history[2]["clients"] == 4
    assert report.history[2]["clients_failed"] == 4  # the JSONL fault counter too


@pytest.mark.parametrize("attack", ["dtype", "extra", "record"])
def test_a_hostile_supernode_in_async_mode_is_counted(loopback, attack):
    """The asynchronous transport decodes replies through the same checks: every task sent
    to the hostile node is lost and counted, the others are applied."""
    from partialfl.flower.server import run_server

    kind, fn = TAMPER[attack]

    def tamper(partition, mtype, content):
        if partition == 1 and mtype == kind:
            fn(content)

    run = ls_run(6, eval_every=1, spec={"asynchronous": {"rule": "fedasync", "concurrency": 2},
                                        "personalize": {"server": {"lr": 0.05}},
                                        "max_failure_fraction": 0.9})
    report = run_server(loopback(2, tamper=tamper), run)
    assert report.server_steps == 6 and report.failures
    assert all((f.kind, f.partition, len(f.clients)) == ("invalid", 1, 1)
               for f in report.failures)
    assert report.history[-1]["clients_failed"] == len(report.failures)
    assert report.theta["theta"].dtype == np.float64 and np.isfinite(report.theta["theta"]).all()
