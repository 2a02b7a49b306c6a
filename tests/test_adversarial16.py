"""Adversarial round 16 (issue 21, tried again from scratch): regression tests of what broke.

Each test failed on the code before its fix (checked with ``--runxfail``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _flower_sims import ls_run


# -- area 2: the initial model θ⁰ of the SuperNode of partition 0 ----------------------------
def _theta0(kind):
    if kind == "names":
        return {"zzz": np.zeros(10)}
    if kind == "shape":
        return {"theta": np.zeros(3)}
    if kind == "values":
        return {"theta": np.full(10, 1e300)}  # finite
    return {"theta": np.zeros(10, dtype=np.float16)}  # θ of the spec's problem is float64


@pytest.mark.parametrize("kind", ["names", "shape", "dtype", "values"])
def test_an_initial_model_unlike_the_servers_problem_is_refused_or_ignored(loopback, kind):
    """A closed-form run: the ServerApp rebuilds the problem (``server_parts``), so it knows
    θ's leaves, shapes and dtype — and θ⁰ itself (``problem.init_theta(generator(seed,
    "init"))``, what every node computes) — yet it takes the θ⁰ that the node claiming
    partition 0 sends, checked only to be finite floats. Other leaf names crashed the
    ServerApp with ``KeyError: 'theta'`` (closed_form_metrics), another shape with a numpy
    broadcast ValueError; a float16 θ⁰ made θ float16 and a 1e300 θ⁰ made every update
    non-finite, so every honest node's reply was refused and the run aborted blaming all
    partitions. Expected: either the description is refused with one line naming the initial
    model, or the server's own θ⁰ is used (the run equals the clean one)."""
    from flwr.app import RecordDict

    from partialfl.flower.codec import params_to_record
    from partialfl.flower.server import run_server

    def tamper(partition, mtype, content: RecordDict):
        if partition == 0 and mtype == "query.describe":
            content["theta0"] = params_to_record(_theta0(kind))

    run = ls_run(2, eval_every=1)
    clean = run_server(loopback(2), run)
    try:
        report = run_server(loopback(2, tamper=tamper), run)
    except (RuntimeError, ValueError) as e:  # (a KeyError is neither)
        assert "initial model" in str(e) and "\n" not in str(e), str(e)
        return
    assert not report.aborted and not report.failures
    np.testing.assert_array_equal(report.theta["theta"], clean.theta["theta"])


# -- area 3: BR-FFGG after an honest client fails --------------------------------------------
class _Send:
    """Every Byzantine client sends 1e30 (finite)."""

    def __call__(self, honest, own, rng):
        return np.full_like(own, 1e30)


@pytest.mark.parametrize("rule", ["tm", "meamed", "mda"])
@pytest.mark.parametrize("how", ["raise", "nan"])
def test_one_failing_honest_client_never_lets_an_attacker_within_delta_through(rule, how):
    """k = 10 per round, δ = 0.1 (f = 1), one Byzantine client (fraction 0.1 = δ) sending 1e30:
    protected as configured. When one *honest* client fails (raises, or sends NaN), 9 replies
    remain, f = ⌊0.9⌋ = 0, and ``ByzantineRobust._protection`` runs the rule unprotected
    with a warning although ``allow_unprotected`` is False: θ reached 2.4e28 in 3 rounds.
    :func:`partialfl.runtime.sync` skips the step in this case for a robust aggregator
    outside ByzantineRobust (θ stays, ``rounds_unprotected``); the Byzantine-robust algorithm
    must not be less safe: θ stays bounded (the round skipped, or refused with one line)."""
    from partialfl.aggregation.protection import UnprotectedError
    from partialfl.algorithms.byzantine import ByzantineConfig, br_ffgg
    from partialfl.build import make_aggregator, make_solver
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.runtime.faults import FaultInjector

    p = LeastSquaresProblem(LeastSquaresSpec(num_clients=10, n=40, d_theta=3, d_w=2, seed=0))
    alg = br_ffgg(make_solver("exact"), 1 / p.L, make_aggregator(rule, delta=0.1),
                  ByzantineConfig((3,), _Send()), clients_per_round=10)
    alg = FaultInjector(alg, at={(r, 5): how for r in range(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            res = run_rounds(p, alg, 3, clients_per_round=10, seed=0)
        except UnprotectedError as e:  # a one-line refusal is fine too
            assert "\n" not in str(e)
            return
    assert np.abs(res.state.theta["theta"]).max() < 1e3


# -- area 2: the message audit names its files by what a SuperNode claims ---------------------
@pytest.mark.parametrize("mtype", ["x" * 300, "é" * 200, "train"])
def test_a_reply_with_a_long_message_type_never_breaks_the_audit(loopback, tmp_path, mtype):
    """With run-config ``audit-dir`` every received message is written to
    ``NNNNNN-TYPE-NODE.bin``, TYPE the reply's ``metadata.message_type`` with non-alphanumeric
    characters replaced — but its length is what the node sent, and a reply's type is not
    checked against the request's (the SuperLink does not either). Partition 1 replying with
    a 300-character type (or 200 'é': alphanumeric, 400 bytes) crashed ``run_server`` with
    ``OSError: [Errno 36] File name too long``. Expected: the run finishes; the audit keeps
    one file per received message."""
    from partialfl.flower.server import run_server

    class Grid(loopback):
        def push_messages(self, messages):
            ids = super().push_messages(messages)
            for i in ids:
                reply = self.replies[i]
                if reply.metadata.src_node_id == 1001:  # the node of partition 1
                    reply.metadata.__dict__["_message_type"] = mtype
            return ids

    audit = tmp_path / "audit"
    report = run_server(Grid(2), ls_run(2, eval_every=1, audit_dir=str(audit)))
    assert report.server_steps == 2 and not report.aborted
    assert len(list(audit.glob("*.bin"))) == 2 + 2 * 2 + 2 * 3  # describe, train, evaluate


# -- area 2: a SecAgg+ masked-vector reply missing Flower's FitRes records -------------------
def _drop(key):
    def fn(content):
        del content[key]
    return fn


def _masked_as_floats(content):
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    cfg = content[RECORD_KEY_CONFIGS]
    cfg[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(bytes_to_ndarray(b).astype(np.float64))
                                  for b in cfg[Key.MASKED_PARAMETERS]]


def _status_code(content):
    from flwr.app import ConfigRecord

    content["fitres.status"] = ConfigRecord({"code": "zz", "message": ""})


@pytest.mark.parametrize("tamper", [
    pytest.param(_drop("fitres.num_examples"), id="no-num-examples"),
    pytest.param(_drop("fitres.status"), id="no-status"),
    pytest.param(_drop("fitres.parameters"), id="no-parameters"),
    pytest.param(_status_code, id="bad-status-code"),
    pytest.param(_masked_as_floats, id="float-masked-vectors"),  # refused by check_reply: held
])
def test_one_node_with_a_malformed_secagg_reply_is_its_own_failure(loopback, tamper):
    """SecAgg+ over 3 SuperNodes: partition 1's masked-vector reply without
    ``fitres.num_examples`` (or ``fitres.status`` / ``fitres.parameters``, or with a status
    code that is not a Code) passed :func:`partialfl.flower.secagg.check_reply` — it checks
    only that no other record is there — and Flower's workflow raised KeyError / ValueError
    on it: ``secagg_round`` then records the failed round against *every* partition, every
    round, and the run aborts. A reply the check refuses (here: masked vectors as floats) is
    that node's dropout, and the other two nodes' round goes on. Expected for all: only
    partition 1 is counted, the run finishes."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    from partialfl.flower.server import run_server

    def hostile(partition, mtype, content):
        if (partition == 1 and RECORD_KEY_CONFIGS in content.keys()
                and Key.MASKED_PARAMETERS in content[RECORD_KEY_CONFIGS].keys()):
            tamper(content)

    run = ls_run(2, 5, secagg=True, secagg_clip=64.0, spec={"max_failure_fraction": 0.9})
    report = run_server(loopback(3, tamper=hostile), run)
    assert report.server_steps == 2 and not report.aborted
    assert report.failures and {f.partition for f in report.failures} == {1}
