"""Adversarial round 66a (issue 21, areas 2, 5 and 6 on Flower and round 65a's zero-round
DP fix, tried again from scratch by someone who did not write the fixes, against 6e447b4:
``algorithms.dp._dp`` leaving a stage of 0 rounds unwrapped, ``presets._fedrep`` with gd
clients, ``pipeline.files._check_group`` casting a deployed θ). Each test below (but the
controls) failed on that code because of the defect it names, and passes since the fix: a
0-round stage keeps its DP wrapper, *idle* (no plan, no cohort check, every round refused,
no DP record), so a local-DP node still finds it and withholds its sums
(``algorithms.dp._dp`` / ``DifferentiallyPrivate(idle=True)``).

* Area 5 (privacy by value: a SuperNode under local DP sends what local DP withholds), a
  Flower stage of 0 rounds — an evaluation-only run: ``personalize.rounds = 0`` (or the
  stage left out of ``stages``) — under ``[privacy] mode = "local"`` (``clip_norm = 1``,
  ``noise_multiplier = 1``, ``clients_per_round = 4``, ``rounds = 3``) on the loopback
  ServerApp with two SuperNodes of 4 least-squares clients each (and with SecAgg+ on three
  nodes): every node sends its exact evaluation sums (the round-0 record has ``eval_loss``
  41.99 over ``eval_clients`` 8 and ``eval_withheld_nodes`` 0; a model node would also
  declare its eval-units). The same run with 1 round withholds them (``eval_withheld_nodes``
  2, no ``eval_loss``; the control): under local DP "its clients then send nothing but their
  noised updates (a SuperNode withholds its evaluation sums)" (flower/dp_policy.py) — the
  server is not trusted with exact client statistics, whatever rounds the stage has. Since
  round 65a's fix the ``dp`` wrapper's build returns the bare algorithm for a 0-round stage,
  and the node decides what it sends by looking for a local-DP wrapper in the algorithm's
  chain, so the spec's ``mode = "local"`` is forgotten. (A node with its own floor
  ``dp-min-noise`` refuses the same run instead, saying "its clients would add local-DP
  noise of multiplier 0" while the spec asks z = 1.) Expected: a node of a local-DP run
  withholds its evaluation sums at any number of rounds. Suspected root cause:
  :func:`partialfl.algorithms.dp._dp` (``if ctx.rounds == 0: return ctx.base``) with
  :func:`partialfl.flower.client.node_runtime` (``updates_only = local_dp(algorithm) is
  not None or ...``, :func:`partialfl.flower.dp_policy.local_dp` reading the wrapper chain).

Tried and held: a private stage 1 finished, then the same --out resumed with ``pretrain.rounds
= 0`` or other ``stages`` (refused: "a finished run with another configuration"); central DP
with target ε over both stages (report: ε per stage and ε ≤ 16 composed); a node with
``dp-min-noise`` and a hostile 0-round spec (refused at describe: z = 0 below the floor);
FedRep + gd in process (head_epochs = 0 refused in one line; lr = 1e308: one line "none of
the 8 client computations succeeded"; ``fast = true``, 0 rounds: run), FedRep + gd + central
or local DP in process, FedRep on the loopback ServerApp (refused as stateful in one line);
central DP at 0 rounds on Flower (nodes evaluate θ⁰, as a non-private run); central and local
DP with SecAgg+ and a crashed node (one counted failure, ε reported, local DP's evaluation
withheld by all 3 nodes); tampered evaluation replies (negative or fractional counts, an
undeclared sum, a node omitting its sums: counted ``eval-invalid``; 1.7e308 sums: finite
means). Not filed: with ``clients_per_round = 8`` in both ``[privacy]`` and the stages of a
5-client run the refusal says "the stage asks clients_per_round=5" (the stage asks 8, clipped
to the clients; the run is refused either way, in one line); FedRep with ``body_epochs =
1e11`` runs for ever (like a huge CG tau).
"""

from __future__ import annotations

import pytest
from _flower_loopback import loopback  # noqa: F401 - the fixture

LOCAL_DP = {"privacy": {"mode": "local", "clip_norm": 1.0, "noise_multiplier": 1.0,
                        "clients_per_round": 4, "rounds": 3}}


def _first_record(loopback, rounds: int, nodes: int = 2, flower=None, **spec):  # noqa: F811
    from _flower_sims import ls_run, quiet

    from partialfl.flower.server import run_server

    run = ls_run(rounds, None, eval_every=1, spec={**LOCAL_DP, **spec}, **(flower or {}))
    rep = quiet(run_server, loopback(nodes), {**run, "node-wait-timeout": 2})
    return rep.history[0]


def test_control_local_dp_nodes_withhold_their_evaluation_sums(loopback):  # noqa: F811
    h = _first_record(loopback, 1)
    assert h["eval_withheld_nodes"] == 2 and "eval_loss" not in h, h


@pytest.mark.parametrize("how", ["rounds-0", "stage-left-out", "rounds-0-secagg"])
def test_local_dp_nodes_withhold_evaluation_sums_in_a_zero_round_stage(loopback, how):  # noqa: F811
    extra = {"stages": ["pretrain", "finetune"]} if how == "stage-left-out" else {}
    nodes, flower = (3, {"secagg": True}) if how.endswith("secagg") else (2, None)
    h = _first_record(loopback, 2 if how == "stage-left-out" else 0, nodes, flower, **extra)
    assert "eval_loss" not in h and "eval_clients" not in h, h
    assert h["eval_withheld_nodes"] == nodes, h
