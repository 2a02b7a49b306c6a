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


# ------------------------------------------------------------- local DP: the round budget
def _local_dp_run(rounds: int = 1) -> dict:
    return ls_run(rounds, 4, spec={"privacy": {
        "name": "dp", "clip_norm": 1.0, "noise_multiplier": 2.0, "mode": "local",
        "sampling": "fixed"}})


def test_a_local_dp_node_refuses_rounds_past_the_budget(loopback):  # noqa: F811
    """A SuperNode under local DP (even with its floor ``dp-min-noise``) answered a train
    message for any round whose cohort the public sampling draws — round 1, 50 or 10⁶ of a
    run whose budget covers one round — so a hostile server got as many noisy releases of a
    client's update as it asked for and averaged the noise away, while ε was reported for
    the budget's rounds. Only the server's own sampling checked the budget. Now every client
    update checks it (:class:`~partialfl.algorithms.dp.PrivacyBudgetError`): the node
    replies with an error naming the budget, and still answers the rounds it covers."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from partialfl.flower.server import run_server
    from partialfl.sampling import draw_cohort

    grid = loopback(1, node_config={"dp-min-noise": 2.0})
    run = _local_dp_run(rounds=1)
    run_server(grid, run)  # round 0: answered (the honest run)
    sent = next(m for m in grid.sent if m.metadata.message_type == "train")
    for r in (1, 10**6):
        content = RecordDict(dict(sent.content.items()))
        task = dict(content["task"])
        task.update(round=r, clients=[int(c) for c in draw_cohort("fixed", 3, r, 8, 4)])
        content["task"] = ConfigRecord(task)
        mid, = grid.push_messages([Message(content, dst_node_id=sent.metadata.dst_node_id,
                                           message_type="train")])
        reply, = grid.pull_messages([mid])
        # the budget's own words stay in the node's log (flower.node.kept_on_node)
        assert reply.has_error() and "DP budget refuses this round" in reply.error.reason


def test_a_dp_client_update_past_the_budget_is_refused_in_process():
    """The same check in process: a client update of round ``rounds`` raises."""
    from partialfl.algorithms.base import RoundContext
    from partialfl.algorithms.dp import PrivacyBudgetError
    from partialfl.build import build
    from partialfl.flower.config import parse_run_config

    built = build(parse_run_config(_local_dp_run(rounds=2)).run)
    alg, problem = built.algorithm, built.problem
    state = alg.init(problem, problem.init_theta(np.random.default_rng(0)))
    cohort = alg.sample_cohort(3, 1, problem.num_clients)
    alg.client_update(state, problem, cohort, RoundContext(3, 1))  # round 1 of 2: fine
    with pytest.raises(PrivacyBudgetError, match="budget covers rounds=2"):
        alg.client_update(state, problem, cohort, RoundContext(3, 2))
