"""Adversarial round 69a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes, against 8e425b0: round 68a's refusal of a ``name`` key among a
registered model's or a source's options, then wide over every place a component's options
meet its name and over the SuperNode's own settings). Each test below (but the controls)
failed on that code because of the defect it names, and passes since the fix: a SuperNode
refuses a ``--node-config`` key it does not know, naming the closest one and the allowed keys
(``flower.node.NODE_KEYS`` / ``node_options``), so a misspelt floor can no longer be dropped.

* Area 5 (a node's privacy policy silently off), a SuperNode's own settings
  (:func:`partialfl.flower.node.node_options`, read from its ``--node-config``) are the
  operator's protection against the server: ``eval-min-clients`` (the evaluation floor),
  ``dp-min-noise`` (the local-DP floor), ``dp-ledger`` / ``dp-max-releases`` (the release
  cap). ``node_options`` reads each by its exact kebab-case key and ignores every other key
  of the node config without a word — whereas the run config refuses an unknown key in one
  line ("unknown run-config key(s) 'eval_min_clients' (did you mean 'eval-min-clients'?)")
  and ``--flower`` takes both spellings (round 63a). So a node started with ``--node-config
  'partition-id=0 num-partitions=2 eval_min_clients=50'`` (or ``dp_min_noise=1.0``, or a
  typo such as ``dp-min-nosie``) runs with no floor at all: on two loopback SuperNodes of a
  least-squares run (8 clients), the first record has ``eval_clients = 8`` and the nodes'
  evaluation sums, while ``eval-min-clients = 50`` withholds them (``eval_withheld_nodes =
  2``) and ``dp-min-noise = 1.0`` refuses the non-private run at describe. Expected: a
  node-config key the node does not know (or knows in the other spelling) is either read as
  the run config reads it or refused in one line — never a policy the operator set that is
  silently not applied. Suspected root cause: :func:`partialfl.flower.node.node_options`
  (``node_config.get("eval-min-clients", 1)`` etc., no check of the remaining keys).

Tried and held: ``model.options`` with ``name`` under the hyphen spelling of a registered
model's name (refused), with ``Name`` (refused at build, one line "unknown key
'model.Name'"); ``data.options.name`` (refused); ``[method] name = …`` (unknown key: the
algorithm's options are checked); ``[problem]`` / ``[data.partition]`` tables with a second
name-like key (unknown key); every registry kind's ``Options`` holding no field called
``name`` / ``kind`` / ``options`` (so :meth:`Component.to_dict` cannot be redirected on a round
trip such as Flower's ``encode_spec`` → the node's ``decode_spec``); ``component()`` on a
dataclass of options shared by several entries (refused: "give the name"); the SuperNode's
``check_code`` against ``set`` overrides naming a ``module:callable`` model (checked after
the overrides, before any import); a ``set`` text that does not decode (``_spec_dict`` gives
``{}`` but parsing then refuses it); the server's ``fault-injection`` reply faults
(``extra``/``dtype``/``nan`` built from the already screened θ rows: no w-derived value);
the evaluation reply (always over all of the node's clients, no server-chosen subset: no
differencing). Not filed: ``[logging.wandb]`` options with ``name`` / ``dir`` / ``config``
(the user's own tracker; wandb is not installed here); ``deploy.safetensors`` metadata
``split_options`` holding ``name`` (the rebuilt split is checked against the file's
global/personal names).
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture


def _first_record(loopback, node_config):  # noqa: F811
    """The first record of a 1-round least-squares run evaluated at every round, on two
    loopback SuperNodes with ``node_config``; None when the run is refused."""
    from _flower_sims import ls_run, quiet

    from partialfl.flower.server import run_server

    run = ls_run(1, None, eval_every=1)
    try:
        rep = quiet(run_server, loopback(2, node_config=node_config),
                    {**run, "node-wait-timeout": 2})
    except Exception:  # noqa: BLE001 - a refused run (the floor applied)
        return None
    return rep.history[0]


def test_control_node_policies_in_kebab_case_apply(loopback):  # noqa: F811
    plain = _first_record(loopback, {})
    assert plain is not None and plain["eval_clients"] == 8 and "eval_loss" in plain, plain
    floor = _first_record(loopback, {"eval-min-clients": 50})
    assert floor is not None and floor["eval_withheld_nodes"] == 2, floor
    assert "eval_loss" not in floor, floor
    assert _first_record(loopback, {"dp-min-noise": 1.0}) is None  # refused at describe


@pytest.mark.parametrize("node_config", [{"eval_min_clients": 50}, {"dp_min_noise": 1.0},
                                         {"dp-min-nosie": 1.0}],
                         ids=["eval_min_clients", "dp_min_noise", "typo"])
def test_node_privacy_floor_is_never_silently_dropped(loopback, node_config):  # noqa: F811
    h = _first_record(loopback, node_config)
    assert h is None or "eval_loss" not in h, (
        f"node config {node_config} was ignored: the nodes sent their evaluation sums "
        f"over {h.get('eval_clients')} clients with no floor applied")
