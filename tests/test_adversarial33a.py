"""Adversarial round 33a (issue 21, areas 2 and 5, tried again from scratch by someone who did
not write the fixes). Each test failed on the code it was written against (adv33a at
f71a6a9) because of the defect it names, and passes since the fix.

* Area 5, local DP against the server (Flower): a SuperNode whose operator set the floor
  ``dp-min-noise`` and a release ledger with ``dp-max-releases`` is documented to send "at
  most R updates of a client, so the per-client guarantee (R releases at noise z) then holds
  whatever the server asks" (docs/flower.md), and a local-DP client "sends nothing else: its
  exact training loss ... is not part of the mechanism and stays on the client"
  (docs/dp.md). But ``flower.client.evaluate`` answers every ``evaluate`` message — at any
  θ the server picks, as often as it asks, after the node's release cap refused training —
  with the *exact*, noise-free sums of its clients' personalized losses (w fine-tuned on
  the node: f_m(θ, w_m(θ)), ``loss-gap`` too), neither noised nor counted by the ledger: an
  unbounded channel derived from the clients' data and w that the DP mechanism does not
  cover.
* Area 5, the node's release ledger (``dp-ledger``): ``NodeRuntime.context`` counts a train
  request under the round number the server's message gives, ``int(task["round"])`` of any
  number — a float such as 1e20 included — and ``ReleaseLedger.request`` writes the tag
  ``<digest>:<round>`` of its 21 digits; ``ReleaseLedger._read`` accepts at most 19 digits,
  so from then on the node calls its own ledger "damaged" and refuses every request of
  every run: one hostile message makes the operator choose between a dead node and deleting
  the record of the releases it has made.
"""

from __future__ import annotations

import warnings

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run  # noqa: E402


def _local_dp(z: float, rounds: int = 1, **flower) -> dict:
    return ls_run(rounds, 4, eval_every=1, spec={"privacy": {
        "name": "dp", "clip_norm": 1.0, "noise_multiplier": z, "mode": "local",
        "sampling": "fixed"}}, **flower)


def _ask(grid, sent, mtype: str, theta=None):
    """The reply of ``sent``'s node to a copy of ``sent`` (θ replaced by ``theta``)."""
    from flwr.app import Message, RecordDict

    from partialfl.flower.codec import params_to_record

    content = RecordDict(dict(sent.content.items()))
    if theta is not None:
        content["theta"] = params_to_record(theta)
    mid, = grid.push_messages([Message(content, dst_node_id=sent.metadata.dst_node_id,
                                       message_type=mtype)])
    reply, = grid.pull_messages([mid])
    return reply


def test_a_local_dp_node_past_its_release_cap_sends_no_exact_evaluation(
        loopback, tmp_path):  # noqa: F811
    """2 loopback SuperNodes (4 least-squares clients each), both with the floor
    ``dp-min-noise = 2`` and a ledger capping each client at ONE released update; the
    server runs one honest local-DP round (z = 2). The node then refuses a further train
    request (its cap). Expected: what the server may still get from the node about its
    clients is bounded by the same policy — an ``evaluate`` message at a θ the server picks
    is withheld or refused, never the exact sums Σ_m f_m(θ, w_m(θ)). Found: every evaluate is
    answered, exactly (the same θ twice: bit-identical sums; any θ: a new exact value)."""
    from partialfl.flower.server import run_server

    node = {"dp-min-noise": 2.0, "dp-ledger": str(tmp_path / "ledger.json"),
            "dp-max-releases": 1}
    grid = loopback(2, node_config=node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_server(grid, _local_dp(2.0))
    train = next(m for m in grid.sent if m.metadata.message_type == "train")
    again = _ask(grid, train, "train")
    assert again.has_error() and "dp-max-releases" in again.error.reason  # the cap holds
    ev = next(m for m in grid.sent if m.metadata.message_type == "evaluate"
              and m.metadata.dst_node_id == train.metadata.dst_node_id)
    theta = {n: a.numpy() for n, a in ev.content["theta"].items()}
    exact = []
    for shift in (0.0, 0.0, 1.0, -3.0):  # θ of the server's choosing, asked again and again
        reply = _ask(grid, ev, "evaluate", {n: v + shift for n, v in theta.items()})
        if not reply.has_error() and len(reply.content["eval"]):
            exact.append(dict(reply.content["eval"]))
    assert not exact, (f"{len(exact)} of 4 evaluate messages past the node's release cap got "
                       f"its clients' exact loss sums, e.g. {exact[0]} (twice the same: "
                       f"{exact[0] == exact[1] if len(exact) > 1 else None})")


def test_one_train_message_does_not_break_a_nodes_release_ledger(
        loopback, tmp_path):  # noqa: F811
    """2 loopback SuperNodes with a ledger (cap 5 releases per client) and the floor
    ``dp-min-noise = 2``; one honest local-DP round. The server then sends one train message
    whose round is the float 1e20 (the node's DP budget refuses it: fine). Expected: the
    node still answers honest requests afterwards (within its cap) — its ledger stays
    readable. Found: the ledger holds a tag of 21 digits its reader refuses, and the node
    refuses every later request as a damaged ledger."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from partialfl.flower.server import run_server

    node = {"dp-min-noise": 2.0, "dp-ledger": str(tmp_path / "ledger.json"),
            "dp-max-releases": 5}
    grid = loopback(2, node_config=node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_server(grid, _local_dp(2.0))
    train = next(m for m in grid.sent if m.metadata.message_type == "train")

    def ask(round_):
        content = RecordDict(dict(train.content.items()))
        content["task"] = ConfigRecord({**dict(train.content["task"]), "round": round_})
        mid, = grid.push_messages([Message(content, dst_node_id=train.metadata.dst_node_id,
                                           message_type="train")])
        reply, = grid.pull_messages([mid])
        return reply

    ask(1e20)  # refused by the node's DP budget (or any other way): the server's business
    honest = ask(0)  # the run's own round, asked again: the cap allows it
    assert not honest.has_error() or "damaged" not in honest.error.reason, \
        honest.error.reason
