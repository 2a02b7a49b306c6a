"""Adversarial round 60a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against 64afb2f: the code of rounds 58a–59b — Flower's
asynchronous run (:func:`partialfl.flower.jobs.run_async`: ``rounds`` applied updates, the
nodes' evaluation where the in-process run evaluates, ``eval_every`` through the gcd with
K, the final record of a partial buffer), SecAgg+ (``check_nodes``, the zero-total-weight
skip of ``secagg_round``), evaluate messages with the shared numbers, ``node.screened``,
``weighting = "examples"`` on Flower). Each test below failed on that code because of the
defect it names, and passes since the fix: a step a weighing rule cannot take (weights
summing to 0) is skipped and counted as a server step in the asynchronous runtime too
(:meth:`AsyncServer.arrive`; FedBuff clears such a buffer), as a synchronous round is; in
process, a federation without any training example is refused by ``build`` in one line.

* Area 2 (the ServerApp never ends), Flower's asynchronous ServerApp loops forever when
  no reply can be applied: under ``method.weighting = "examples"`` a reply whose clients
  hold no training example has total weight 0, the asynchronous rule's step raises
  ``ZeroWeightsError`` and :meth:`AsyncServer.arrive` counts the job as *lost* — not as an
  applied update (``rounds`` counts those), not as a failure (FlowerJobs' streak and the
  failure fraction only see transport failures: the reply itself was well-formed). Over a
  federation where no sampled client holds a training example — a valid one: a user's
  model, 5 clients with 4 test examples each and no training data, 2 loopback
  SuperNodes, FFGG, ``rounds = 4`` — the synchronous run ends at once (each round's step
  skipped, "nothing to average", 20 requested updates, no failure: the rounds are
  counted), but FedAsync (``concurrency = 1``) and FedBuff (K = 2) keep sending train
  messages with no end: about 240 a second, more than 4 800 after 20 s, no failure, no
  record after step 0, nothing in the log at ERROR. SuperNodes can do the same on any
  problem: least squares (the paper's Example 1), 2 loopback SuperNodes that declare, as
  is their right, no example for their clients and send weights 0 (within the bound
  ``max(1, n_m)``): FedAsync with example weighting sends more than 400 train messages for
  ``rounds = 4`` (uniform weighting, the same replies: 4 server steps, the run ends).
  Suspected root cause: :func:`partialfl.runtime.asynchronous.loop.drive` with
  :class:`partialfl.flower.jobs.FlowerJobs` (``arrive``'s zero-weight "lost" jobs are
  neither applied updates nor counted failures, so neither ``steps`` nor the streak of
  ``max(10, 3·concurrency)`` failed tasks ever ends the loop).

Tried and held (run unless marked "read"): FedBuff on Flower against in process with
``eval_every`` not dividing K (K, ``eval_every``, ``rounds`` = 2, 3, 6; 2, 3, 7; 3, 2, 7;
2, 4, 5; 4, 6, 6; 3, 4, 9): θ bit-identical, the evaluations (``eval_loss_gap``) at the
in-process points and values, the last ``local_grads`` equal (Flower records one row per
arrival, in process one per ``eval_every``); the same FedBuff runs stopped by
``stop:round=R`` and resumed (``checkpoint-every`` 1, 2): θ and the evaluations equal to the
uninterrupted run's; FedAsync and FedBuff with example weighting over a federation where
4 of 5 clients hold no training example (ends: 8 / 4 server steps, zero-weight replies
dropped silently: 34 / 11 requests); SecAgg+ with every (nodes, shares, threshold) of
(2..8, 3..6, 2..5) tried: every round succeeds (θ within 1e-5 of plain Flower on 3 nodes);
``weighting = "examples"`` with a weighted geometric median (synchronous, and FedBuff K = 3)
and a trimmed mean (synchronous, FedBuff) on Flower against in process: θ bit-identical,
evaluations equal; FedBuff with ``eval_every`` larger than ``rounds`` (equal); FedBuff with
``concurrency`` 3 (θ differs: arrival order is real time on Flower, simulated in process —
not a defect); a synchronous Flower run whose every node crashes in one round
(``server_steps`` and the evaluation cadence with ``eval_every`` 0, 1, 2 as in process);
(read) a hostile server's duplicate client ids in a train cohort under local DP (the
copies get the same noise, ``generator(key, "dp-noise", r, m)``; the ledger counts each
copy: conservative); (read) ``node_runtime``'s code check (``code_refs`` before
``parse_run_config``; the only import paths ``model.name`` with a colon and ``plugins``);
(read) the SecAgg+ weight factor (``q_ratio`` not clipped; ``max_weight`` the cohort's
declared examples).
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture
from _flower_sims import quiet  # noqa: E402

# -- asynchronous runs whose every reply has zero weight ------------------------------------


class _Runaway(BaseException):
    """Raised by the grid once the ServerApp sent more train messages than a run of
    ``rounds`` server steps could need (what stands for "it never ends")."""


def _cold_folder(root, n=5):
    """``n`` clients' npz files (4×4 images, 3 classes), none with a training example (4
    test examples each)."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)

    def xy(m, k):
        y = (rng.integers(0, 2, k) + m) % 3
        return (rng.integers(0, 60, (k, 4, 4)) + 60 * y[:, None, None]).astype(np.uint8), y

    for m in range(n):
        tx, ty = xy(m, 0)
        ex, ey = xy(m, 4)
        np.savez(root / f"user{m}.npz", train_x=tx, train_y=ty, test_x=ex, test_y=ey)
    return root


def _cold_run(loopback, tmp_path, monkeypatch, rule, limit=400):  # noqa: F811
    from _user_project import TINY_MODEL

    from partialfl.flower.server import run_server

    d = tmp_path / "pkg"
    d.mkdir(exist_ok=True)
    (d / "advmodels60a.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")  # the server's user's own opt-in
    client = {"lr": 0.1, "batch_size": 8}
    spec = {"name": "cold", "seed": 1, "model": {"name": "advmodels60a:tiny"},
            "data": {"source": "folder", "path": str(_cold_folder(tmp_path / "data"))},
            "method": {"algorithm": "ffgg", "split": "output", "weighting": "examples"},
            "pretrain": {"rounds": 0, "client": client},
            "personalize": {"rounds": 4, "client": client}}
    if rule is not None:
        spec["asynchronous"] = {"rule": rule, "concurrency": 1}

    class Grid(loopback):
        def push_messages(self, messages):
            if sum(m.metadata.message_type == "train" for m in self.sent) > limit:
                raise _Runaway(f"more than {limit} train messages for 4 server steps")
            return super().push_messages(messages)

    grid = Grid(2, node_config={"allow-imports": True})
    try:
        return quiet(run_server, grid, {"spec": spec, "stage": "personalize",
                                         "node-wait-timeout": 3, "round-timeout": 20,
                                         "poll-interval": 0.01})
    except _Runaway as e:
        pytest.fail(f"the ServerApp does not end: {e}")


def test_control_sync_run_over_clients_without_training_data_ends(loopback, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    rep = _cold_run(loopback, tmp_path, monkeypatch, None)
    assert rep.server_steps == 4 and not rep.failures


@pytest.mark.parametrize("rule", ["fedasync", {"name": "fedbuff", "buffer": 2}],
                         ids=["fedasync", "fedbuff"])
def test_async_run_over_clients_without_training_data_ends(loopback, tmp_path,  # noqa: F811
                                                           monkeypatch, rule):
    """Found: more than 4 800 train messages after 20 s, no failure, no record after step 0
    (the synchronous run: 4 rounds, 20 requests). Expected: the run ends — its ``rounds``
    counted (as the synchronous run's skipped steps) or stopped / aborted with a reason —
    within 400 train messages (100 per server step)."""
    from partialfl.flower.report import RunAborted

    try:
        rep = _cold_run(loopback, tmp_path, monkeypatch, rule)
    except RunAborted:
        return  # refused with a reason: acceptable
    assert rep.server_steps <= 4


def test_in_process_a_federation_without_training_examples_is_refused_in_one_line(
        tmp_path, monkeypatch):
    """Found while fixing the above: the same federation in process (synchronous) ended
    ``build`` in a ``StopIteration`` traceback (the model check looked for a client with a
    training example), so ``partialfl train`` and ``--dry-run`` crashed. Expected: one
    ConfigError saying no client holds a training example."""
    from _user_project import TINY_MODEL

    from partialfl.build import build
    from partialfl.config import ConfigError
    from partialfl.spec.run import load_spec

    d = tmp_path / "pkg"
    d.mkdir()
    (d / "advmodels60a2.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    client = {"lr": 0.1, "batch_size": 8}
    spec = load_spec({"name": "cold", "seed": 1, "model": {"name": "advmodels60a2:tiny"},
                      "data": {"source": "folder",
                               "path": str(_cold_folder(tmp_path / "data"))},
                      "method": {"algorithm": "ffgg", "split": "output"},
                      "pretrain": {"rounds": 1, "client": client},
                      "personalize": {"rounds": 1, "client": client}})
    with pytest.raises(ConfigError, match="none of the 5 clients holds a training example"):
        build(spec)
