"""Adversarial round 9 (issue 21): regression tests for what the ninth independent round found
(a reviewer who did not write the fixes) — a SuperNode crashing the ServerApp through a
SecAgg+ reply, and a local-DP SuperNode releasing rounds past its privacy budget."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - fixture
from _flower_sims import ls_run

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")


# ------------------------------------------------------- SecAgg+: a hostile node's replies
def _configs(content):
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return content[RECORD_KEY_CONFIGS]


def _set_metric(key, value):
    def tamper(content):
        if "fitres.metrics" in content:
            content["fitres.metrics"][key] = value
    return tamper


def _set_config(key, value):
    def tamper(content):
        if key in _configs(content):
            _configs(content)[key] = value(_configs(content)[key])
    return tamper


def _drop_configs(content):
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if "fitres.metrics" in content:
        del content[RECORD_KEY_CONFIGS]


SECAGG_TAMPERS = {
    "grad-evals-inf": _set_metric("grad-evals", float("inf")),  # OverflowError before
    "grad-evals-nan": _set_metric("grad-evals", float("nan")),  # ValueError
    "grad-evals-huge": _set_metric("grad-evals", 1e300),  # PrivacyError
    "grad-evals-negative": _set_metric("grad-evals", -5),  # counted as -5 gradients
    "no-configs-record": _drop_configs,  # KeyError in Flower's workflow
    "public-key-garbage": _set_config("pk1", lambda v: b"not a key"),
    "destinations-unpaired": _set_config("dsts", lambda v: v[:-1]),  # zip(strict) ValueError
    "share-owner-foreign": _set_config("nids", lambda v: [12345] * len(v)),  # KeyError
    "masked-vector-of-another-shape": _set_config(
        "masked_params", lambda v: v[:1] + [v[1][: len(v[1]) // 2]] + v[2:]),
    "shares-garbage": _set_config("shares", lambda v: [b"\x00" * 5] * len(v)),
}


@pytest.mark.parametrize("name", list(SECAGG_TAMPERS))
def test_a_hostile_secagg_reply_is_a_counted_failure_not_a_crash(loopback, name):  # noqa: F811
    """Flower's SecAgg+ workflow reads every reply unchecked, and the ServerApp read the
    node's ``grad-evals`` with ``int()``: one SuperNode sending ``grad-evals`` = inf, NaN or
    1e300, a reply without its SecAgg+ record, a public key that does not load, destinations
    without their ciphertexts, key shares of a node not in the round or that do not combine
    ended the ServerApp with an exception (OverflowError, ValueError, KeyError, PrivacyError);
    a key that does not load failed the round blaming every node as a drop-out, and a
    negative count passed. Now each reply is checked against its request
    (:func:`partialfl.flower.secagg.check_reply`) before the workflow sees it — refused, it is
    a counted ``invalid`` failure of that node (to the workflow, a drop-out) — and what only
    the workflow can see (shares that do not combine) fails the round, counted; θ stays
    finite and the run ends normally."""
    from partialfl.flower.server import run_server

    tamper = SECAGG_TAMPERS[name]

    def hostile(partition, message_type, content):
        if partition == 1 and message_type == "train":
            tamper(content)

    run = ls_run(2, 5, secagg=True, secagg_clip=64.0, spec={"max_failure_fraction": 1.0})
    rep = run_server(loopback(3, tamper=hostile), run)
    assert rep.failure_counts.get("invalid", 0) >= 1
    assert any(f.kind == "invalid" and f.partition == 1 for f in rep.failures)
    assert all(np.isfinite(v).all() for v in rep.theta.values())


def test_an_honest_secagg_round_passes_the_reply_checks(loopback):  # noqa: F811
    """The checks refuse nothing an honest node sends: no failure, every round a step."""
    from partialfl.flower.server import run_server

    rep = run_server(loopback(3), ls_run(2, 5, secagg=True, secagg_clip=64.0))
    assert not rep.failures and rep.server_steps == 2
