"""Adversarial round 53a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes, against 16cb053: round 52a's θ⁰ leaf names). Each test failed on
that code because of the defect it names, and passes since the fix: 0-d leaves stay 0-d in
the codec and SecAgg+; θ⁰ leaf-name segments are any printable run without space, dot or
path separator (``enc-1``); parameters other than float32/float64 are refused by the build
in one line; nodes that leave SecAgg+ before their key shares reached the others are taken
out of the round (``secagg._drop_unkeyed``); and a ServerApp process a SuperLink started
exits once that SuperLink is gone (``env.exit_with_parent``; the orphan described below, now
tested directly).

* Area 2, a user's model with a scalar (0-d) parameter never trains on Flower: a
  temperature / logit scale ``nn.Parameter(torch.tensor(1.0))`` (CLIP's ``logit_scale``) in
  θ. :func:`partialfl.flower.codec.params_to_record` writes each leaf through
  ``np.ascontiguousarray``, which returns an array of ``ndim >= 1`` — θ's ``temp`` of shape
  ``()`` goes out as shape ``(1,)`` — and every honest SuperNode then refuses the server's θ
  ("PrivacyError: the server's θ leaf 'temp' is torch.float32 [1]; this run's θ is
  torch.float32 []"): every train and evaluation task fails and the run ends in
  ``RunAborted: 4 of 4 requested client updates failed``. The same model trains in process
  (``partialfl train … --allow-code``: exit 0). Suspected root cause: ``params_to_record``
  (``np.ascontiguousarray`` on a 0-d leaf; ``flwr.app.Array`` keeps shape ``()`` itself).
* Area 2, round 52a's fix is partial: a θ⁰ leaf name's segments must still match
  ``[A-Za-z0-9_]+`` (:data:`partialfl.flower.codec._LEAF_NAME`), but torch names a
  ``ModuleDict`` child by its key, any string without a dot — ``nn.ModuleDict({"enc-1": …})``
  gives ``layers.enc-1.weight``. The honest federation never starts: ``RuntimeError: no
  SuperNode holds 1 partition(s) (0) after 3.0s ... (last refusal: θ⁰ leaf name
  'layers.enc-1.weight' is not a parameter name)``; in process the model trains (exit 0).
  Suspected root cause: ``_LEAF_NAME`` in :mod:`partialfl.flower.codec` (a character class
  narrower than the names ``named_parameters`` yields).
* Area 8 (found with the brief's "unusual dtypes"), a ``bfloat16`` user model is a traceback:
  ``partialfl train cfg.toml --allow-code`` ends in ``TypeError: Got unsupported ScalarType
  BFloat16`` with a full traceback, exit 1, from the run fingerprint
  (:func:`partialfl.runtime.checkpoint.content_digest` → :func:`partialfl.arrays.to_numpy`:
  ``tensor.numpy()`` has no bfloat16); on Flower the SuperNode's describe fails the same way
  and the node is left out. Either the model trains or it is refused in one line, exit 2.
  Suspected root cause: ``arrays.to_numpy`` (no bfloat16 path) and no dtype check of the
  user's model where it is built.

* Area 2, one SuperNode that drops out of a SecAgg+ round in its first two stages fails
  the round of EVERY node: with 3 or 4 loopback SuperNodes (least squares, shares 3,
  threshold 2), partition 1's ClientApp raising on the ``setup`` (or ``share_keys``) message
  — a node that crashed, or a hostile one — makes every honest node fail at ``unmask``
  with ``KeyError: <the dropped node's id>`` (Flower's workflow lists the dropped node
  among the "dead" neighbours, whose key shares the honest nodes never received), and
  ``secagg_round``
  records the round against every partition: ``RunAborted: 10 of 10 requested client
  updates failed ... partitions lost: [0, 2, 3]`` (4 nodes, k = 5, 2 rounds,
  ``max_failure_fraction`` 0.9: the honest partitions lost), 0 server steps. A drop-out
  at ``collect_masked_vectors`` or ``unmask`` is that node's own failure and the run
  finishes (held), as round 16 requires of a malformed masked-vector
  reply ("only partition 1 is counted, the run finishes"). SecAgg+ exists to tolerate
  drop-outs; one node crashing at the wrong stage is not the semi-honest caveat.
  Suspected root cause: :func:`partialfl.flower.secagg.secagg_round` runs Flower's
  ``SecAggPlusWorkflow`` as is — its ``sampled_node_ids`` keep nodes that never sent keys
  (or shares), so ``unmask`` asks the honest nodes for shares they cannot have; the round
  could be restricted to the nodes that completed ``share_keys`` (or retried without the
  dropped node).

Tried and held (run unless marked "read"): over loopback SuperNodes, user models with a
``float64`` model, tied (aliased) submodules, buffers and BatchNorm running statistics, a
frozen (``requires_grad=False``) weight — each runs both stages (pretrain, personalize),
plain and under SecAgg+ (3 nodes); a SecAgg+ node dropping out at ``collect_masked_vectors``
or ``unmask`` (its own failure, the run finishes); ``partialfl flower local`` killed with
SIGKILL right after a round (SuperLink, SuperNodes and ServerApp gone within seconds) and
rerun into the same ``--out`` (finishes; the unfinished stage starts again, as documented:
"a rerun continues from the finished stages"); SIGTERM right after a round line (nothing
left behind). (read) Flower's ``start_parent_process_monitor`` (SIGINT to the ServerApp when
its SuperExec dies).

Observed, not filed as a test (timing-dependent: 3 of 8 tries left one — a SIGTERM by
``timeout`` late in a run, and twice 5 s into round 3; a test of it passed alone and then
failed to reproduce in the whole file): area 1/4 (the brief's "live kill under ``partialfl
flower local``"), an interrupted ``partialfl flower local`` leaves its ServerApp behind:
SIGTERM to the command (``timeout``, a job scheduler, ``kill``) while a round is in flight
prints ``partialfl: interrupted`` and stops the SuperLink and SuperNodes, but the ``flwr-
serverapp`` of the run (the SuperLink's grandchild, running partialfl's ServerApp with
``out-dir`` = the run folder's ``stage1/flower``) lives on, ppid 1, its federation folder
deleted — seen for 13 minutes until killed. Its stack: partialfl's ``federation.exchange`` →
``pull`` → ``http_grid.pull_messages`` → Flower's retrying ``pull_objects``, whose threads
wait forever on the dead SuperLink; Flower's parent monitor had already raised its SIGINT.
docs/flower.md says "a killed run leaves no SuperLink, SuperNode or ServerApp behind
(writing into the run folder a rerun uses)". Suspected root cause:
:class:`partialfl.flower.deployment.LocalFederation` ends only its own children (the death
signal does not reach the SuperLink's grandchildren) and the ServerApp
(:func:`partialfl.flower.server.run_server`) has no guard of its own that ends it when its
SuperLink is gone (Flower's graceful SIGINT waits on the retrying pull).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
from _user_project import client_folder, train_user_model

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class Scalar(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.a = nn.Linear(16, 6)
            self.temp = nn.Parameter(torch.tensor(1.0))
            self.head = nn.Linear(6, num_classes)

        def forward(self, x):
            return self.head(torch.relu(self.a(x.flatten(1)))) * self.temp


    class Dict(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.layers = nn.ModuleDict({"enc-1": nn.Linear(16, 6),
                                         "out": nn.Linear(6, num_classes)})

        def forward(self, x):
            return self.layers["out"](torch.relu(self.layers["enc-1"](x.flatten(1))))


    class BF16(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.body = nn.Linear(16, 6).to(torch.bfloat16)
            self.head = nn.Linear(6, num_classes).to(torch.bfloat16)

        def forward(self, x):
            return self.head(torch.relu(self.body(x.flatten(1).to(torch.bfloat16)))).float()


    def scalar(num_classes=3):
        return Scalar(num_classes)


    def moduledict(num_classes=3):
        return Dict(num_classes)


    def bf16(num_classes=3):
        return BF16(num_classes)
''')


def _spec(tmp_path, monkeypatch, model: str) -> dict:
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "advmodels53a.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")  # the server's user's own opt-in
    monkeypatch.delitem(sys.modules, "advmodels53a", raising=False)
    data = client_folder(tmp_path / "data")
    client = {"lr": 0.1, "batch_size": 8}
    return {"name": "tiny", "model": {"name": f"advmodels53a:{model}"},
            "data": {"source": "folder", "path": str(data)},
            "method": {"algorithm": "ffgg", "split": "output"},
            "pretrain": {"rounds": 2, "clients_per_round": 2, "client": client},
            "personalize": {"rounds": 1, "clients_per_round": 2, "client": client}}


def _run(loopback, spec):  # noqa: F811
    from partialfl.flower.server import run_server

    grid = loopback(2, node_config={"allow-imports": True})
    logging.disable(logging.WARNING)
    try:
        return run_server(grid, {"spec": spec, "stage": "pretrain", "node-wait-timeout": 3,
                                 "round-timeout": 10, "poll-interval": 0.01})
    finally:
        logging.disable(logging.NOTSET)


def test_a_scalar_parameter_model_trains_on_flower(loopback, tmp_path, monkeypatch):  # noqa: F811
    """Found: ``RunAborted: 4 of 4 requested client updates failed`` (every node: "the
    server's θ leaf 'temp' is torch.float32 [1]; this run's θ is torch.float32 []").
    Expected: the honest federation of two SuperNodes runs its rounds without a failure."""
    rep = _run(loopback, _spec(tmp_path, monkeypatch, "scalar"))
    assert not rep.failures


def test_control_a_scalar_leaf_survives_the_codec():
    """Where it breaks: the record of a 0-d leaf; flwr's Array itself keeps shape ()."""
    import numpy as np
    from flwr.app import Array

    assert Array(np.array(1.0, dtype=np.float32)).numpy().shape == ()


def test_a_moduledict_user_model_runs_on_flower(loopback, tmp_path, monkeypatch):  # noqa: F811
    """Found: ``RuntimeError: no SuperNode holds 1 partition(s) (0) after 3.0s ... (last
    refusal: θ⁰ leaf name 'layers.enc-1.weight' is not a parameter name)``. Expected: the
    run's rounds (torch's own parameter names of a valid user model)."""
    rep = _run(loopback, _spec(tmp_path, monkeypatch, "moduledict"))
    assert not rep.failures


def _cli_train(tmp_path, model: str) -> subprocess.CompletedProcess:
    return train_user_model(tmp_path, "advmodels53a", MODELS, model, "t53a")


def test_control_the_same_models_train_in_process(tmp_path):
    """The scalar and ModuleDict models are valid: in process they train (exit 0)."""
    for model in ("scalar", "moduledict"):
        p = _cli_train(tmp_path / model, model)
        assert p.returncode == 0, p.stderr[-600:]


def test_a_bfloat16_model_trains_or_is_refused_in_one_line(tmp_path):
    """Found: ``TypeError: Got unsupported ScalarType BFloat16`` with a traceback, exit 1
    (``runtime.checkpoint.content_digest``). Expected: exit 0, or exit 2 with one line."""
    p = _cli_train(tmp_path, "bf16")
    assert p.returncode == 0 or (p.returncode == 2 and "Traceback" not in p.stderr
                                 and len(p.stderr.strip().splitlines()) == 1), p.stderr[-600:]


def _dropping_app(stage: str, partition: int = 1):
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    from partialfl.flower.client import app as real

    def app(msg, ctx):
        if (int(ctx.node_config["partition-id"]) == partition
                and RECORD_KEY_CONFIGS in msg.content.keys()
                and msg.content[RECORD_KEY_CONFIGS].get(Key.STAGE) == stage):
            raise RuntimeError("node crashed")  # a drop-out: Flower's error reply
        return real(msg, ctx)
    return app


def _secagg_with_dropout(loopback, stage):  # noqa: F811
    import warnings

    from _flower_sims import ls_run

    from partialfl.flower.server import run_server

    run = ls_run(2, 5, secagg=True, secagg_clip=64.0, spec={"max_failure_fraction": 0.9})
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_server(loopback(4, client_app=_dropping_app(stage)), run)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("stage", ["setup", "share_keys"])
def test_a_secagg_dropout_in_the_key_stages_is_that_nodes_own_failure(loopback, stage):  # noqa: F811
    """Found: ``RunAborted: 10 of 10 requested client updates failed (100% >
    max-failure-fraction 0.9) ... partitions lost: [0, 2, 3]`` — the honest nodes' errors
    ``KeyError: 1001``. Expected: only partition 1 counted, both rounds applied."""
    report = _secagg_with_dropout(loopback, stage)
    assert report.server_steps == 2 and not report.aborted
    assert {f.partition for f in report.failures} == {1}


@pytest.mark.parametrize("stage", ["collect_masked_vectors", "unmask"])
def test_control_a_secagg_dropout_in_the_later_stages_is_that_nodes_own(loopback, stage):  # noqa: F811
    report = _secagg_with_dropout(loopback, stage)
    assert report.server_steps == 2 and not report.aborted
    assert {f.partition for f in report.failures} <= {1}


def test_a_serverapp_process_exits_once_its_superlink_is_gone(tmp_path, monkeypatch):
    """The orphan described above (a SuperLink killed mid-round left its ``flwr-serverapp``
    waiting for good): a ServerApp process a SuperLink started now watches its parent and
    exits once it is gone (:func:`partialfl.flower.env.exit_with_parent`). Here a parent
    starts a grandchild that watches it, and is killed with SIGKILL."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from _adv_cli import SRC
    from _procs import alive

    from partialfl.flower import env as fenv

    grand = ("from partialfl.flower.env import exit_with_parent\nexit_with_parent(0.1)\n"
             "import time\ntime.sleep(60)\n")
    child = ("import subprocess, sys, time\n"
             f"p = subprocess.Popen([sys.executable, '-c', {grand!r}])\n"
             "print(p.pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    pid = int(proc.stdout.readline())
    try:
        time.sleep(1.0)  # the grandchild is watching
        assert alive(pid)  # alive while its parent is
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        assert not alive(pid), "the watching process outlived its killed parent"
    finally:
        for p in (pid, proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # only a process a SuperLink started watches (never a researcher's own script)
    monkeypatch.setattr(sys, "argv", ["/x/bin/flwr-serverapp"])
    assert fenv.started_by_superlink()
    monkeypatch.setattr(sys, "argv", ["/x/bin/python", "my_script.py"])
    assert not fenv.started_by_superlink()
