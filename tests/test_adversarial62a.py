"""Adversarial round 62a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against 5dc803d), going wide over entry points not
covered recently: Flower's own run-config keys as ``partialfl run|train --flower`` passes
them, the model pipeline's stages on Flower, node-side client stores, DP and the other
algorithms on Flower, the node's run-config parsing and the ServerApp's files. Each test
below failed on that code because of the defect it names, and passes since the fix: a
relative ``audit-dir`` is made absolute against the working folder (``flower.train.
_server_keys``; ``--flower out-dir=`` is refused in one line, as the keys partialfl sets);
a local federation's processes get the config's folder on their ``PYTHONPATH``
(``build.code.CONFIG_FOLDERS``); a diverged Flower stage 1 is warned about as in process
(``pipeline.stages.warn_diverged``) and ends the run in one line without marking the stage
done.

* Area 5 (the audit of what the server learns) / careless user: ``--flower
  audit-dir=DIR`` with a relative DIR is silently lost. ``partialfl run|train --engine
  flower-sim|flower`` (and ``partialfl flower local``) make ``out-dir`` absolute before
  handing it to the ServerApp (which runs in the federation's work folder, a temporary
  folder removed afterwards), but pass ``audit-dir`` as the user typed it: the ServerApp
  writes the audit relative to ITS working folder, which is deleted when the command ends.
  The command prints "results written to …" and exits 0; the audit the user asked for —
  every message the server received — is nowhere (an absolute path works: 10 files for a
  2-round least-squares run on 2 SuperNodes). Expected: the audit is in DIR under the
  user's working folder, or the relative path is refused in one line before anything runs.
  Suspected root cause: :func:`partialfl.flower.train._audit` / :func:`stage_run_config`
  and :func:`partialfl.cli.run._flower_options` (``audit-dir`` is not resolved against the
  user's working folder as ``out-dir`` and ``data.path`` are).

* Area 6 (code the user allowed on their own machine) / careless user: a model module
  beside the config (``proj/usermodels.py``, ``model.name = "usermodels:tiny"``) is
  imported by the in-process run started from another folder (``partialfl train
  proj/cfg.toml --allow-code``: the config's folder is put on ``sys.path``,
  :func:`partialfl.build.config_folder_on_path`), but ``--engine flower-sim`` (and
  ``flower``, ``partialfl flower local``) from the same folder fails: exit 1, "the Flower
  run failed: RuntimeError: no SuperNode answered the describe query (last refusal: …
  model.name: cannot import model module 'usermodels': No module named 'usermodels')" —
  the SuperNodes it starts itself get ``PYTHONPATH`` = the working folder only. Started
  from ``proj/`` the same run trains. docs/flower.md: "The processes partialfl starts run
  in folders of their own, so it gives them absolute paths: ``data.path``, … and
  ``PYTHONPATH``." Expected: the Flower run imports what the in-process run imports.
  Suspected root cause: :class:`partialfl.flower.deployment.LocalFederation` (its
  ``PYTHONPATH`` is ``os.getcwd()`` and the caller's, never the config's folder that
  :func:`partialfl.cli.common.load_spec` put on ``sys.path``).

* Area 2 / a diverged run says so: stage 1 diverging on Flower (``pretrain.server.lr =
  1e30``, ``pretrain.client.lr = 1e10`` on the 5-client folder; in process: "stage 1
  diverged: θ has non-finite values …" and stage 2's one-line error at once) is kept as a
  finished stage by ``partialfl train --engine flower-sim``: the ServerApp's report says
  ``stopped_early: "diverged: …"`` but :func:`partialfl.flower.train.run_flower_train` saves
  its infinite θ as ``stage1/theta.safetensors`` and starts stage 2, whose SuperNodes build
  θ⁰ from that ``init-from``; the server refuses partition 0's θ⁰ and waits the whole
  ``node-wait-timeout`` (120 s by default), then: exit 1, "no SuperNode holds 1
  partition(s) (0) after 120.0s; … (last refusal: initial model leaf '1.weight' is not
  finite)" — no word of the divergence (stderr never says "diverged"). Expected: the run
  says stage 1 diverged, as the in-process run does (and need not wait for the nodes).
  Suspected root cause: :func:`partialfl.flower.train.run_flower_train` /
  ``_stage_files`` (the report's ``stopped_early`` and θ's finiteness are not looked at;
  the in-process stage calls ``pipeline.stages._check_finite``).

Tried and held (run unless marked "read"): FedAvg, Local FFGG, stateless FedAlt and FedSim
with a gd client on loopback Flower against in process (least squares, 3 rounds, k = 4,
``eval_every`` 1): θ and the evaluations bit-identical, FFGG within 5e-13; L2GD and
Scaffold straight to ``run_server`` (no CLI check): every node refuses them as stateful,
one error after ``node-wait-timeout`` (known); ``partialfl flower node-data`` with
``--nodes`` 0, -1, more than the training clients, OUT an existing file (one line each)
and with ``data.holdout = 1`` (the held-out client is in no store); an absolute
``--flower audit-dir`` (every message written); (read) ``code_refs`` against every place a
spec can name code (the partitioners are fixed flwr-datasets classes, trackers import only
wandb/mlflow, resnet weights load with ``weights_only=True``); (read) ``node_runtime``'s
code check on ``spec`` and ``set`` as :func:`parse_run_config` decodes them (a
non-string ``spec`` from a message decodes to ``{}`` there and is refused by the parse);
(read) the node's evaluation floor counting clients with test data, the server's eval
checks (correct ≤ total, declared eval-units); (read) the split of stage 2 is not
data-dependent (θ⁰ of stage 2 carries no client value). Not filed: a node store written
from another configuration (e.g. ``data.holdout`` 0 vs 1) is served without a check — the
server does not hold the clients' ids to compare (nodes declare indices); a hostile server
asking a stage-2 node for ``stage = "pretrain"`` gets full-model FedAvg updates, which
stage 1 releases anyway (the stage is the server's to choose).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _adv_cli import LS_SMALL_TOML, env
from _user_project import TINY_MODEL, client_folder, tiny_toml


def _run_with_audit(tmp_path, audit: str):
    pytest.importorskip("flwr", reason="flwr is not installed")
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray")
    (tmp_path / "ls.toml").write_text(LS_SMALL_TOML)
    return subprocess.run([sys.executable, "-m", "partialfl", "run", "ls.toml", "--engine",
                           "flower-sim", "--supernodes", "2", "--flower", f"audit-dir={audit}",
                           "--out", "runs/ls", "--no-progress"], cwd=tmp_path,
                          env=env(None), capture_output=True, text=True, timeout=170)


@pytest.mark.slow
def test_a_relative_audit_dir_is_kept_or_refused(tmp_path):
    """Found: exit 0, "results written to runs/ls/", no ``aud`` folder anywhere (it was
    written relative to the ServerApp's working folder, the federation's temporary one).
    Expected: the audit in ``aud`` under the user's working folder, or exit 2 with one
    line refusing the relative path."""
    p = _run_with_audit(tmp_path, "aud")
    if p.returncode == 2:
        assert "audit-dir" in p.stderr and "Traceback" not in p.stderr
        return
    assert p.returncode == 0, p.stderr[-800:]
    assert len(list((tmp_path / "aud").glob("*.bin"))) >= 6


def _model_beside_config(tmp_path):
    pytest.importorskip("flwr", reason="flwr is not installed")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "usermodels.py").write_text(TINY_MODEL)
    tiny_toml(tmp_path / "proj" / "cfg.toml", "usermodels:tiny",
              client_folder(tmp_path / "data"))
    return subprocess.run([sys.executable, "-m", "partialfl", "train", "proj/cfg.toml",
                           "--allow-code", "--out", "runs/t", "--no-progress"],
                          cwd=tmp_path, env=env(None), capture_output=True, text=True,
                          timeout=170)


def test_control_a_model_beside_the_config_trains_in_process(tmp_path):
    """In process, from the config's parent folder: trained (metrics.json)."""
    p = _model_beside_config(tmp_path)
    assert p.returncode == 0, p.stderr[-800:]
    assert (tmp_path / "runs" / "t" / "metrics.json").is_file()


# Found on flower-sim: exit 1, "no SuperNode answered the describe query (last refusal: …
# cannot import model module 'usermodels' …)"; expected: the run as in process. Checked by
# tests/test_adversarial63a.py::test_a_diverged_flower_run_says_so, whose flower-sim run has
# its model beside the config (one Flower start for both rounds' checks).


@pytest.mark.slow
def test_a_diverged_flower_stage_1_says_so(tmp_path):
    """Found: exit 1, "no SuperNode holds 1 partition(s) (0) after 30.0s; … (last refusal:
    initial model leaf '1.weight' is not finite)", no "diverged" anywhere in stderr.
    Expected: stderr says the run (stage 1) diverged, as in process."""
    pytest.importorskip("flwr", reason="flwr is not installed")
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray")
    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    tiny_toml(tmp_path / "cfg.toml", "usermodels:tiny", client_folder(tmp_path / "data"))
    p = subprocess.run([sys.executable, "-m", "partialfl", "train", "cfg.toml", "--allow-code",
                        "--engine", "flower-sim", "--flower", "node-wait-timeout=30",
                        "--set", "pretrain.server.lr=1e30", "--set", "pretrain.client.lr=1e10",
                        "--out", "runs/t", "--no-progress"], cwd=tmp_path, env=env(None),
                       capture_output=True, text=True, timeout=170)
    assert p.returncode != 0
    assert "diverged" in p.stderr, p.stderr[-800:]
