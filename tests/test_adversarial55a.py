"""Adversarial round 55a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against d8b3d3a: the new code of rounds 50–54 —
``report.check_failures``, ``FlowerJobs``' streak horizon, ``secagg._drop_unkeyed`` and the
exact share-keys check, the θ⁰ leaf names, ``env.exit_with_parent``, 0-d leaves). Each test
failed on that code because of the defect it names, and passes since the fix: a setup reply
with two equal public keys is that node's own failure; θ⁰ leaf names are any printable
name of non-empty dot-separated segments (torch's ``ModuleDict`` keys with spaces or
slashes); a resumed asynchronous run sets its failure horizon at the next failure; an even
``secagg-shares`` below the node count is passed to Flower as the next odd count (its
neighbour groups are odd); a threshold above what each node can hold is refused.

* Area 2, one SuperNode whose SecAgg+ ``setup`` reply carries two EQUAL public keys
  (``pk2 = pk1``: well-formed, both load) fails the round of EVERY node — the ``setup`` twin
  of round 54a's short share-keys reply: with 4 loopback SuperNodes (least squares, shares
  3, threshold 2, 2 rounds), partition 1's tampered reply passes
  :func:`partialfl.flower.secagg.check_reply` (its ``SETUP`` branch checks that each key
  loads, not that the two differ), is forwarded at ``share_keys`` to its neighbours, and
  each honest neighbour's ``secaggplus_mod._share_keys`` raises ``ValueError: Some public
  keys are identical``: 0 server steps, the honest partitions blamed (``max_failure_fraction``
  0.9: ``RunAborted: 10 of 10 requested client updates failed ... partitions lost: [0, 2,
  3]``; with 1.0: failures ``(0, 'error', 'Some public keys are identical')``, ``(2, ...)``,
  ``(3, ...)``). The server sees both keys of the reply, so it can refuse it as that node's
  own ``invalid`` failure (a drop-out at ``setup``, which ``_drop_unkeyed`` handles).
  Suspected root cause: ``secagg._check_reply``'s ``SETUP`` branch (no ``pk1 != pk2`` check;
  a key equal to another node's would be the same check across the stage's replies).
* Area 2, round 53a's leaf-name fix still refuses names torch gives a valid model: a
  ``nn.ModuleDict`` keyed ``"enc 1"`` (a space) or ``"task/a"`` (a slash: per-task heads
  keyed by task names) — ``named_parameters`` yields ``layers.enc 1.weight`` /
  ``layers.task/a.weight`` — trains in process (``partialfl train cfg.toml --allow-code``:
  exit 0, both) but on Flower the honest federation never starts: ``RuntimeError: no
  SuperNode holds 1 partition(s) (0) after 3.0s; partitions present: 1 (last refusal: θ⁰ leaf
  name 'layers.enc 1.weight' is not a parameter name)`` — after ``node-wait-timeout`` (120 s
  by default), blaming the federation, not the model. Nothing on the server uses a leaf name
  as a path (the same names go into the in-process run's files). Suspected root cause:
  ``_LEAF_NAME`` / ``_decode_theta0`` in :mod:`partialfl.flower.codec` (a ``[^\\s./\\\\]``
  class; torch forbids only ``.`` and the empty name). (If such names are to stay refused,
  the build should say so in one line before the federation starts.)
* Area 2, round 51a's streak horizon is lost on resume: :meth:`partialfl.flower.jobs.
  FlowerJobs.restore` restores ``streak`` from the checkpoint but not ``horizon`` (0 in a
  fresh object), and ``_done`` sets the horizon only when the streak is 0 — so after a
  resume from a checkpoint taken with a non-zero streak (a pull holding a success and then
  failures: seen 1 and 2 here), no job in flight is "dispatched before the run of failures
  began", and one fast-failing node stops the run exactly as before round 51a's fix: the
  asynchronous run of round 51a (FedAsync, concurrency 6, 3 SuperNodes, partition 0
  answering every train message at once with NaN weights, the honest ones after 0.2 s,
  ``max_failure_fraction`` 1) checkpointed every step and stopped after step 2
  (``stop:round=1``), then resumed: ``stopped = "18 consecutive client tasks failed (last:
  invalid: reply weight must be finite, got nan)"``, 0 steps after the resume (2 of 12),
  with 5 honest tasks in flight. Uninterrupted, the same run finishes its 12 steps (round
  51a's test); resumed with ``horizon`` patched past every job it finishes too. Suspected
  root cause: ``FlowerJobs.restore`` (or ``_done``: the horizon of a streak that began before
  the restart should be the jobs sent since the restart).
* Area 2, an EVEN ``secagg-shares`` below the number of SuperNodes (``4`` with 5, 6 or 8
  nodes; accepted: "an integer >= 3") fails every round of an honest federation: Flower's
  ``SecAggPlusWorkflow.setup_stage`` builds the setup message's ``SHARE_NUMBER`` (4) before
  it rounds an even share count up to odd (5 neighbours), so every node's
  ``secaggplus_mod._share_keys`` indexes past its 4 shares: ``IndexError: list index out of
  range``, every partition lost, ``RunAborted: 16 of 16 requested client updates failed``
  (with 4 nodes and shares 4, or any odd count, it trains). Expected: an even
  ``secagg-shares`` refused in one line (``ConfigError``), or made odd before Flower sees it.
  Suspected root cause: the ``secagg-shares`` field in :mod:`partialfl.flower.config` (no
  oddness check) / ``secagg_round`` passing it to Flower as is.
* Area 2, a ``secagg-threshold`` above the number of SuperNodes (4 nodes, shares 7,
  threshold 6: accepted, 6 < 7) can never reconstruct: every node raises "Available
  neighbours number smaller than threshold" at ``share_keys`` and the run ends ``RunAborted:
  16 of 16 requested client updates failed ...; failures by kind {'timeout': 8}, partitions
  lost: [0, 1, 2, 3]`` — every honest node blamed as "dropped out of the SecAgg+ round". The
  ServerApp knows the node count after discovery and already refuses SecAgg+ with one node
  there (``ConfigError: secagg: SecAgg+ needs at least 2 SuperNodes``). Suspected root cause:
  :func:`partialfl.flower.server.run_server` (no ``secagg-threshold <= len(fed.nodes)``
  check beside that one).

Tried and held (run unless marked "read"): SecAgg+ over honest loopback SuperNodes with
(nodes, shares, threshold) = (5, 3, 2), (7, 3, 2), (3, 5, 2), (2, 3, 2), (4, 4, 2), (6, 5, 3)
— the exact share-keys check never refuses an honest node (its neighbours always include
itself: offset 0 of Flower's ring; ``_drop_unkeyed`` keeps neighbour sets within the
active nodes); a setup reply copying partition 0's keys (the run finishes, partitions 0
and 1 lose rounds: the server cannot tell which of two equal keys is the copy; observed,
not filed); θ⁰ leaf names ``layers.énc.weight`` and ``layers.a:b.weight`` (accepted, train);
the 0-d parameter model (``nn.Parameter(torch.tensor(1.0))``) over 3 loopback SuperNodes in
both stages with evaluation every round under local DP, central DP, SecAgg+, and SecAgg+
with central DP (no failure; adaptive clipping refused by the node's default DP budget at
describe: a node's own policy, known). (read) ``check_failures``: ``running`` after
``MIN_ATTEMPTS``, ``end`` only when none succeeded and the fraction is below 1, ``stalled``
whatever the count — as ``FaultLog.check`` / ``check_end`` / ``check_stalled``. (read)
``exit_with_parent``: in flwr 1.42 every ``flwr-serverapp`` / ``flwr-simulation`` is started
by ``flower-superexec`` with ``--parent-pid`` of itself (Flower's own monitor ends it with
its parent too), so exiting with the parent is no false exit. Observed, not filed: a
model whose parameter name is longer than 200 characters (``ModuleDict`` key of 195) is
refused as a θ⁰ leaf name on Flower and trains in process (a bound against huge names).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from _user_project import client_folder, train_user_model

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import ls_run, quiet  # noqa: E402
from test_adversarial50a import _nan_weights, _run, _Timed  # noqa: E402

# -- SecAgg+ setup reply with two equal public keys ------------------------------------------


def _equal_keys(partition, mtype, content):
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    if partition != 1 or RECORD_KEY_CONFIGS not in content.keys():
        return
    cfg = content[RECORD_KEY_CONFIGS]
    if Key.PUBLIC_KEY_1 in cfg.keys():
        cfg[Key.PUBLIC_KEY_2] = cfg[Key.PUBLIC_KEY_1]


def test_a_setup_reply_with_equal_public_keys_is_that_nodes_own_failure(loopback):  # noqa: F811
    """Found: 0 server steps; every honest partition fails with "ValueError: Some public keys
    are identical" (with fraction 0.9: ``RunAborted ... partitions lost: [0, 2, 3]``).
    Expected: only partition 1 counted, both rounds applied."""
    from partialfl.flower.server import run_server

    run = ls_run(2, 5, secagg=True, secagg_clip=64.0, spec={"max_failure_fraction": 1.0})
    rep = quiet(run_server, loopback(4, tamper=_equal_keys), run)
    assert rep.server_steps == 2, [(f.partition, f.reason) for f in rep.failures]
    assert {f.partition for f in rep.failures} == {1}


def test_control_the_honest_secagg_federation_finishes(loopback):  # noqa: F811
    from partialfl.flower.server import run_server

    run = ls_run(2, 5, secagg=True, secagg_clip=64.0, spec={"max_failure_fraction": 1.0})
    rep = quiet(run_server, loopback(4), run)
    assert rep.server_steps == 2 and not rep.failures


# -- θ⁰ leaf names torch allows --------------------------------------------------------------

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class Dict(nn.Module):
        def __init__(self, key, num_classes=3):
            super().__init__()
            self.key = key
            self.layers = nn.ModuleDict({key: nn.Linear(16, 6),
                                         "out": nn.Linear(6, num_classes)})

        def forward(self, x):
            return self.layers["out"](torch.relu(self.layers[self.key](x.flatten(1))))


    def space(num_classes=3):
        return Dict("enc 1", num_classes)


    def slash(num_classes=3):
        return Dict("task/a", num_classes)
''')


def _spec(tmp_path, monkeypatch, model: str) -> dict:
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "advmodels55a.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")  # the server's user's own opt-in
    monkeypatch.delitem(sys.modules, "advmodels55a", raising=False)
    data = client_folder(tmp_path / "data")
    client = {"lr": 0.1, "batch_size": 8}
    return {"name": "tiny", "model": {"name": f"advmodels55a:{model}"},
            "data": {"source": "folder", "path": str(data)},
            "method": {"algorithm": "ffgg", "split": "output"},
            "pretrain": {"rounds": 2, "clients_per_round": 2, "client": client},
            "personalize": {"rounds": 1, "clients_per_round": 2, "client": client}}


@pytest.mark.parametrize("model", ["space", "slash"])
def test_moduledict_keys_torch_allows_run_on_flower(loopback, tmp_path, monkeypatch,  # noqa: F811
                                                    model):
    """Found: ``RuntimeError: no SuperNode holds 1 partition(s) (0) after 3.0s ... (last
    refusal: θ⁰ leaf name 'layers.enc 1.weight' is not a parameter name)`` (``'layers.task/
    a.weight'``). Expected: the honest federation of two SuperNodes runs its rounds."""
    from partialfl.flower.server import run_server

    grid = loopback(2, node_config={"allow-imports": True})
    rep = quiet(run_server, grid, {"spec": _spec(tmp_path, monkeypatch, model),
                                    "stage": "pretrain", "node-wait-timeout": 3,
                                    "round-timeout": 10, "poll-interval": 0.01})
    assert rep.server_steps == 2 and not rep.failures


def test_control_those_models_train_in_process(tmp_path):
    """The same models (and data) train in process: ``partialfl train --allow-code``, exit 0."""
    for model in ("space", "slash"):
        p = train_user_model(tmp_path / model, "advmodels55a", MODELS, model, "t55a")
        assert p.returncode == 0, p.stderr[-600:]


# -- the streak horizon after a resume -------------------------------------------------------


def _async(out, **kw) -> dict:
    spec = {"asynchronous": {"rule": "fedasync", "concurrency": 6},
            "personalize": {"server": {"lr": 0.05}}, "max_failure_fraction": 1.0}
    return ls_run(12, spec=spec, node_wait_timeout=5, round_timeout=5, poll_interval=0.01,
                  checkpoint_every=1, out_dir=str(out), **kw)


def _interrupted_then_resumed(tmp_path, tamper):
    from partialfl.flower.report import ServerStopped

    try:
        _run(_Timed(3, tamper=tamper), _async(tmp_path, fault_injection="stop:round=1"))
    except ServerStopped:
        pass
    return _run(_Timed(3, tamper=tamper), _async(tmp_path, resume=True))


def test_control_an_honest_resumed_async_run_finishes(loopback, tmp_path):  # noqa: F811
    rep = _interrupted_then_resumed(tmp_path, None)
    assert rep.resumed_from == 2 and rep.server_steps == 12 and not rep.stopped


def test_a_fast_failing_node_does_not_stop_a_resumed_async_run(loopback, tmp_path):  # noqa: F811
    """Found: ``stopped = "18 consecutive client tasks failed (last: invalid: reply weight
    must be finite, got nan)"``, 2 of 12 steps (none after the resume), honest tasks in
    flight. Expected: as uninterrupted (round 51a), the run finishes its 12 steps."""
    rep = _interrupted_then_resumed(tmp_path, _nan_weights)
    assert rep.resumed_from == 2
    assert rep.server_steps == 12, (rep.server_steps, rep.stopped)
    assert {f.partition for f in rep.failures} == {0}


# -- SecAgg+ parameters an honest federation cannot run --------------------------------------


def test_an_even_secagg_shares_is_refused_or_trains(loopback):  # noqa: F811
    """Found: every round fails at every node (``IndexError: list index out of range``),
    ``RunAborted: 16 of 16 requested client updates failed``. Expected: a ConfigError in
    one line, or the honest federation training."""
    from partialfl.flower.config import ConfigError
    from partialfl.flower.server import run_server

    run = ls_run(2, 8, secagg=True, secagg_clip=64.0, secagg_shares=4, secagg_threshold=2,
                 spec={"max_failure_fraction": 1.0})
    try:
        rep = quiet(run_server, loopback(5), run)
    except ConfigError:
        return
    assert rep.server_steps == 2 and not rep.failures, rep.failures[:2]


def test_control_odd_shares_and_as_many_shares_as_nodes_train(loopback):  # noqa: F811
    from partialfl.flower.server import run_server

    for nodes, shares in ((5, 3), (5, 5), (4, 4)):
        run = ls_run(2, 8, secagg=True, secagg_clip=64.0, secagg_shares=shares,
                     secagg_threshold=2)
        rep = quiet(run_server, loopback(nodes), run)
        assert rep.server_steps == 2 and not rep.failures


def test_a_secagg_threshold_above_the_node_count_is_a_config_error(loopback):  # noqa: F811
    """Found: ``RunAborted: 16 of 16 requested client updates failed ...; failures by kind
    {'timeout': 8}, partitions lost: [0, 1, 2, 3]`` (every honest node "dropped out").
    Expected: one ConfigError (the threshold cannot be met by 4 SuperNodes), as SecAgg+
    with one node is refused."""
    from partialfl.flower.config import ConfigError
    from partialfl.flower.report import RunAborted
    from partialfl.flower.server import run_server

    run = ls_run(2, 8, secagg=True, secagg_clip=64.0, secagg_shares=7, secagg_threshold=6)
    try:
        quiet(run_server, loopback(4), run)
    except RunAborted as e:
        pytest.fail(f"the honest nodes were blamed: {e}")
    except ConfigError:
        return
    pytest.fail("the run neither trained nor was refused")
