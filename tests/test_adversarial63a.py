"""Adversarial round 63a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against c9e6f11: round 62a's fixes — a relative
``--flower audit-dir`` made absolute (:func:`partialfl.flower.train._server_keys`),
``--flower out-dir=`` refused, the config's folder on a local federation's ``PYTHONPATH``
(``build.code.CONFIG_FOLDERS``), a diverged Flower stage 1 ending the run in one line
(``_stage_files``, ``pipeline.stages.warn_diverged``) —, then Flower's entry points as a
careless user meets them). Each test below failed on that code because of the defect it
names, and passes since the fix: ``_server_keys`` takes both spellings of every key; a
Flower run (``train --engine flower*``, ``flower local``) that diverged says so and exits 1
(``cli.run.diverged_status``, as in process); ``flower local`` records the config
(``source.json``) and takes ``--overwrite``; a local federation refuses a folder whose name
holds ``os.pathsep`` instead of splitting it on ``PYTHONPATH``.

* Area 5 (the audit of what the server learns) / careless user, round 62a's fix is
  partial: ``--flower audit_dir=aud`` (the underscore spelling, which every ``--flower``
  key accepts: :func:`partialfl.flower.train.stage_run_config` turns ``_`` into ``-``, and
  :func:`partialfl.cli.run._flower_options` refuses ``out_dir`` as ``out-dir``) is still
  lost: ``partialfl run ls.toml --engine flower-sim --flower audit_dir=aud`` exits 0,
  "results written to runs/ls/", and no ``aud`` exists anywhere (written relative to the
  ServerApp's temporary work folder, removed afterwards). ``_server_keys`` (and
  ``_audit``, which also gives each model stage its own subfolder) look only at the key
  ``"audit-dir"``; the key is normalised later, by ``stage_run_config``. Expected: the
  audit in ``aud`` under the working folder, as with ``audit-dir=aud``. Suspected root
  cause: :func:`partialfl.flower.train._server_keys` / ``_audit`` (keys not normalised
  first).

* A diverged run says so (area 8, on Flower's entry points): ``partialfl train
  --engine flower-sim`` whose final losses are not finite (here stage 3's
  ``finetune.lr = 3e38`` on the tiny user model: ``metrics.json`` has ``test_loss`` and
  ``train_loss`` ``inf``, and ``report.md`` says "Warning: the run diverged") exits 0 with
  nothing on stderr about it. The same command in process exits 1 with "partialfl:
  warning: the run diverged: test_loss, train_loss not finite at the end; …". The
  Flower branch of :func:`partialfl.cli.run._run_model` prints the summary and returns 0
  without :func:`partialfl.pipeline.train_report.divergence_line` (``partialfl flower
  local``'s :func:`partialfl.cli.flower._cmd_flower_local` likewise returns 0 after
  ``run_local``, read). Expected: exit 1 and the divergence line, as in process.

* Area 6 (code the user allowed, on their own machine) / careless user: a run of
  ``partialfl flower local proj/cfg.toml --allow-code`` (the model module
  ``proj/usermodels.py`` beside the config; since 62a the local federation imports it)
  cannot be evaluated as the same run in process can: ``partialfl evaluate runs/fl
  --allow-code`` from the same working folder exits 2, "model.name: cannot import model
  module 'usermodels': No module named 'usermodels'" (from ``proj/`` it works). The
  in-process run and ``partialfl train --engine flower-sim`` record the config in
  ``source.json`` (``run_built(config=…)``), which ``evaluate --allow-code`` reads to put the
  config's folder on the path; ``flower local`` never passes the config
  (:func:`partialfl.cli.flower._cmd_flower_local` → :func:`partialfl.flower.local.run_local`
  → ``run_flower_train(…)`` without ``config=``), so its run folder has no ``source.json``.
  Expected: evaluated as the in-process run is.

* Area 6 (configs never run code the user did not opt into), round 62a's
  ``CONFIG_FOLDERS`` on a local federation's ``PYTHONPATH``: a config in a folder whose name
  holds ``os.pathsep`` (``proj/a:b/cfg.toml``, a legal folder name on Linux/macOS) with its
  model module ``a:b/usermodels.py`` beside it. In process (``partialfl train a:b/cfg.toml
  --allow-code``) ``sys.path`` gets the folder itself and ``a:b/usermodels.py`` is imported.
  With ``--engine flower-sim`` :class:`partialfl.flower.deployment.LocalFederation` joins
  the folders with ``os.pathsep`` into ``PYTHONPATH``, which splits this one into
  ``proj/a`` and a relative ``b``: every SuperNode imports ``proj/a/usermodels.py`` — a
  module in a folder the user never named, here one that writes a marker file when
  imported (two markers after the run, none in process), and the run exits 0, trained on
  another module than the one the config names. Expected: the nodes import what the
  in-process run imports, or the run is refused in one line before anything starts — no
  code from ``proj/a`` runs. Suspected root cause: ``LocalFederation.__init__``
  (``os.pathsep.join(..., *CONFIG_FOLDERS, ...)`` without refusing a folder that contains
  ``os.pathsep``; ``build.code.config_folder_on_path``).

* Careless user, ``partialfl flower local`` into a folder holding its own finished run says
  "… holds a finished run; pass --overwrite to run it again (or choose another --out)", and
  ``partialfl flower local … --overwrite`` is "unrecognized arguments: --overwrite" (exit 2,
  the usage line): the advice names an option the command does not have
  (:func:`partialfl.pipeline.train.claim_out`'s message; ``flower local``'s parser in
  :func:`partialfl.cli.flower.add_commands` has no ``--overwrite``, and ``run_local`` passes
  none to ``run_flower_train``). Expected: the command the message names accepts the
  option (or the message does not name it).

Tried and held (run unless marked "read"): a diverged Flower stage 2 whose θ is not finite
(``personalize.server.lr = 1e30``, ``client.lr = 1e10``): warned and exit 2 in one line
("theta_stage2.safetensors: '1.weight' is not finite (a diverged or damaged stage); delete
it to re-run its stage"; in process also exit 2, deploy.safetensors); a diverged Flower
stage 1 (one line, exit 1, no θ kept), then an in-process rerun with sane learning rates
into the same ``--out`` (trains, exit 0, the Flower stage's records replaced); (read)
``CONFIG_FOLDERS`` reaches a federation's processes only when the spec names code and
the user gave ``--allow-code`` (``config_folder_on_path`` is called only then), and it
grants those processes what the in-process run's ``sys.path[0]`` already does; (read)
``--flower out-dir=``/``out_dir=`` refused in one line; ``partialfl flower local
proj/cfg.toml --allow-code --insecure`` with the model beside the config, run from the
parent folder (trains since 62a, exit 0). Not filed: ``--flower resume=true`` is passed to
both model stages, so a run killed in stage 1 and resumed with it continues stage 1 and
then refuses stage 2 in one line ("no checkpoint at …/flower/checkpoint.safetensors"; a
rerun without it finishes — read, area 4); the testing key ``fault-injection=stop:round=1``
did not stop a model run's stage (``server_steps`` 2 of 2, exit 0; testing only).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _adv_cli import env
from _user_project import TINY_MODEL, client_folder, tiny_toml


def _needs_sim():
    pytest.importorskip("flwr", reason="flwr is not installed")
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray")


def test_a_relative_audit_dir_spelt_with_an_underscore_is_kept(tmp_path, monkeypatch):
    """Found (end to end, ``run ls.toml --engine flower-sim --flower audit_dir=aud``): exit
    0, "results written to runs/ls/", no ``aud`` folder. Expected: the audit in ``aud``
    under the working folder, as ``audit-dir=aud`` since 62a (whose end-to-end test shows
    the messages land there) — checked where the keys enter: both spellings, made absolute."""
    from partialfl.flower.train import _server_keys

    monkeypatch.chdir(tmp_path)
    assert _server_keys({"audit_dir": "aud", "round_timeout": 5}) == {
        "audit-dir": str(tmp_path / "aud"), "round-timeout": 5}


def _diverging_train(tmp_path, *engine: str):
    """A user's model beside its config in ``proj/`` (round 62a's case: the Flower engines
    must import it from there), fine-tuned with a learning rate that overflows."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "usermodels.py").write_text(TINY_MODEL)
    tiny_toml(tmp_path / "proj" / "cfg.toml", "usermodels:tiny",
              client_folder(tmp_path / "data"))
    return subprocess.run([sys.executable, "-m", "partialfl", "train", "proj/cfg.toml",
                           "--allow-code", *engine, "--set", "finetune.lr=3e38", "--out",
                           "runs/t", "--no-progress"], cwd=tmp_path, env=env(None),
                          capture_output=True, text=True, timeout=170)


def test_control_a_diverged_run_says_so_in_process(tmp_path):
    """In process: exit 1, "partialfl: warning: the run diverged: …"."""
    p = _diverging_train(tmp_path)
    assert p.returncode == 1, p.stderr[-800:]
    assert "the run diverged" in p.stderr


@pytest.mark.slow
def test_a_diverged_flower_run_says_so(tmp_path):
    """Found: exit 0, only the summary line ("flower-sim: test accuracy 50.00% …"), while
    ``metrics.json`` has ``test_loss`` = ``train_loss`` = inf. Expected: exit 1 and "the
    run diverged" on stderr, as in process. The model lives beside the config, so the
    same run also holds round 62a's fix (stages 1 and 2 on Flower import it: metrics.json
    exists only after they finished) — one Flower start for both checks."""
    _needs_sim()
    p = _diverging_train(tmp_path, "--engine", "flower-sim")
    assert (tmp_path / "runs" / "t" / "metrics.json").is_file(), p.stderr[-800:]
    assert p.returncode == 1, p.stdout[-400:]
    assert "the run diverged" in p.stderr


def test_a_flower_local_run_with_a_model_beside_the_config_can_be_evaluated(tmp_path,
                                                                           monkeypatch):
    """Found (end to end, two minutes of live processes): ``flower local proj/cfg.toml
    --allow-code`` trained (exit 0), then ``evaluate runs/fl --allow-code`` exited 2,
    "cannot import model module 'usermodels'": the command never handed its config to the
    run, so no ``source.json`` named it. Expected: the config (and ``--overwrite``) reach
    :func:`~partialfl.flower.train.run_flower_train`, which records ``source.json`` as for
    the other engines — checked where they are handed over, the federation a stand-in."""
    pytest.importorskip("flwr", reason="flwr is not installed")
    import partialfl.build.code as code
    import partialfl.cli.flower as cli_flower
    import partialfl.flower.deployment as deployment
    import partialfl.flower.train as flower_train
    from partialfl.cli import main

    class Federation:  # what run_local starts, without processes
        description = "stand-in"

        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

    seen: dict = {}
    monkeypatch.setattr(deployment, "LocalFederation", Federation)
    monkeypatch.setattr(flower_train, "run_flower_train",
                        lambda spec, out, **kw: seen.update(kw) or "trained")
    monkeypatch.setattr(cli_flower, "diverged_status", lambda out: 0, raising=False)
    monkeypatch.setattr(code, "CONFIG_FOLDERS", [])  # (this test's folder stays its own)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "advmodels63a.py").write_text(TINY_MODEL)
    tiny_toml(tmp_path / "proj" / "cfg.toml", "advmodels63a:tiny",
              client_folder(tmp_path / "data"))
    try:
        assert main(["flower", "local", "proj/cfg.toml", "--allow-code", "--insecure",
                     "--nodes", "2", "--out", "runs/fl", "--no-progress", "--overwrite"]) == 0
    finally:
        sys.modules.pop("advmodels63a", None)
    assert Path(seen["config"]).resolve() == (tmp_path / "proj" / "cfg.toml").resolve()
    assert seen["overwrite"] is True


def test_flower_local_accepts_the_overwrite_its_refusal_names():
    """Found: "unrecognized arguments: --overwrite". Expected: ``flower local`` takes the
    ``--overwrite`` that its "holds a finished run" refusal tells the user to pass."""
    from partialfl.cli import build_parser

    args, unknown = build_parser().parse_known_args(["flower", "local", "cfg.toml",
                                                     "--overwrite"])
    assert unknown == [] and args.overwrite


HOSTILE_SIBLING = """
import os, pathlib
pathlib.Path(__file__).parent.parent.joinpath(f"MARKER_{os.getpid()}").write_text("ran")
from torch import nn


def tiny(num_classes: int = 3, width: int = 6):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, width), nn.ReLU(),
                         nn.Linear(width, num_classes))
"""


def _config_in_a_folder_with_a_colon(tmp_path, *engine: str):
    (tmp_path / "a:b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a:b" / "usermodels.py").write_text(TINY_MODEL)
    (tmp_path / "a" / "usermodels.py").write_text(HOSTILE_SIBLING)  # never named by the user
    tiny_toml(tmp_path / "a:b" / "cfg.toml", "usermodels:tiny", client_folder(tmp_path / "data"))
    return subprocess.run([sys.executable, "-m", "partialfl", "train", "a:b/cfg.toml",
                           "--allow-code", *engine, "--out", "runs/t", "--no-progress"],
                          cwd=tmp_path, env=env(None), capture_output=True, text=True,
                          timeout=170)


@pytest.mark.skipif(sys.platform == "win32", reason="':' is not a folder-name character")
def test_control_in_process_imports_the_module_beside_the_config(tmp_path):
    """In process: trained, ``a:b/usermodels.py`` imported, nothing from ``a/`` ran."""
    p = _config_in_a_folder_with_a_colon(tmp_path)
    assert p.returncode == 0, p.stderr[-800:]
    assert not list(tmp_path.glob("MARKER_*"))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="':' is not a folder-name character")
def test_flower_sim_runs_no_code_from_a_folder_the_user_did_not_name(tmp_path):
    """Found: exit 0 and two ``MARKER_*`` files (each virtual SuperNode imported
    ``a/usermodels.py``). Expected: no marker — the nodes import ``a:b/usermodels.py`` as
    in process, or the run is refused in one line."""
    _needs_sim()
    p = _config_in_a_folder_with_a_colon(tmp_path, "--engine", "flower-sim")
    assert "Traceback" not in p.stderr, p.stderr[-800:]
    assert not list(tmp_path.glob("MARKER_*")), p.stdout[-300:]
