"""Adversarial round 45b (issue 21 areas 1, 3, 4, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found. Each test failed on the code it was written
against (r45b at fdc39bc) because of the defect it names, and passes since the fix: a
closed-form run refuses a user's entry named like one it writes
(:func:`partialfl.pipeline.run_files.refuse_users_entries`), a reproduction claims its
``--out`` (new, empty or its own: :func:`~partialfl.pipeline.run_files.claim_folder`, which
also removes its killed writes' temporary files), a closed-form Flower run refuses linked
folders, and ``report`` refuses an interrupted run (one line).

* Area 8, a run writes over the user's own file — a *closed-form* run: round 44b's fix makes
  a train run refuse to start in a folder holding a user's entry named like one it writes
  (:data:`partialfl.pipeline.run_files.RUN_NAMES`, checked by ``record_start``). ``partialfl
  run CONFIG`` of a closed-form spec (:func:`partialfl.cli.run._run_closed_form` →
  :func:`partialfl.pipeline.closed_form.run_and_report`) never calls ``record_start``: run
  with ``--out .`` in a folder holding the user's own ``summary.md`` (a common name), it
  replaces it with its own summary, exit 0, not a word (likewise a user's ``NAME.jsonl``,
  truncated by the ``JsonlLogger``, and ``NAME.png``). ``partialfl reproduce ls-tau --quick
  --out .`` does the same to ``summary.md``. Suspected root cause: ``_run_closed_form`` /
  ``run_and_report`` (and ``flower.train.run_flower_closed_form``, the reproductions'
  writers) do not check the folder for the user's entries as ``run_built`` does.
* Area 4, stale temporary files — a killed reproduction: ``partialfl reproduce ls-tau
  --quick --out o`` killed at the commit of ``o/summary.md`` leaves
  ``o/.summary.md.XXXXXXXX.tmp``; the same command run again finishes (exit 0) and keeps it
  for good. ``partialfl run`` / ``train`` clean their folder before they resume
  (:func:`partialfl.cli.run._clean_interrupted`); no ``reproduce`` path calls
  :func:`partialfl.io.clean_stale_writes`. Suspected root cause: the ``reproduce`` command
  (``cli`` / :mod:`partialfl.reproductions`) never cleans its ``--out``.
* Area 8, no symlink escapes, no writes (or deletes) outside the run folder — a closed-form
  run on Flower: ``partialfl run CONFIG --engine flower-sim`` of a closed-form spec
  (:func:`partialfl.flower.train.run_flower_closed_form`) has the ServerApp write its
  ``result.json``, ``metrics.jsonl`` and ``theta.npz`` into ``OUT/flower`` — through a
  symbolic link ``flower -> ../victim`` planted in a received or shared folder — and
  :meth:`partialfl.flower.deployment.LocalFederation.run` first *unlinks* the victim
  folder's own ``result.json`` / ``theta.npz`` ("only this submission's result counts").
  Exit 0. A model run refuses such a link (round 41b's ``refuse_linked_folders``, called by
  ``run_built`` and ``run_flower_train``); the closed-form path never calls it. Suspected
  root cause: ``run_flower_closed_form`` (no ``refuse_linked_folders(out)`` before the
  federation runs).
* Area 4, crash consistency — ``partialfl report`` of an interrupted run finishes it for
  good: a train run killed after ``metrics.json`` but before its end (here at the commit of
  ``new_clients.json``: the held-out clients not evaluated yet, no ``report.md``, no
  ``run_files.json``) is an unfinished run that the same ``partialfl train`` resumes. ``partialfl
  report RUN`` ("rebuild report.md and the plots of a train run from its logs") of that folder
  succeeds (exit 0, a report without the new clients' row) and writes ``report.md`` — which,
  with ``spec.json``, is what :func:`partialfl.pipeline.train.finished` takes for a finished
  run. From then on the resume is refused ("holds a finished run; pass --overwrite"), the new
  clients are never evaluated (``new_clients.json`` missing although ``data.holdout`` = 2), the
  run has no ``run_files.json`` and keeps the killed write's ``.new_clients.json.*.tmp``;
  only ``--overwrite`` (the whole run trained again) gets out. Suspected root cause:
  ``cli.runs`` ``report`` / ``train_report.write_report`` write ``report.md`` into a run that
  has not finished (it should refuse, one line, or leave the run resumable).

Tried and held (not tested here): area 8 — ``evaluate``, ``compare``, ``report`` of a
closed-form run's folder, of ``/proc``, ``/dev/null``, a reproduction's folder, ``compare . .``
without ``--out`` (one line, exit 2 each); a local closed-form run's ``NAME.jsonl`` through a
link (refused: ``O_NOFOLLOW``), its plot and summary (``atomic_write`` replaces the link, the
target kept); (read) ``record_added`` / ``record_start`` / ``remove_run`` with names holding
``/``, ``..``, NUL (refused by ``_names``), ``compare`` into a folder without a record (nothing
recorded); area 7 (read) — the store opens field files by fixed names, checks sizes and CRCs
before use, the sidecar keyed by inode/size/mtime/ctime and read with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _adv_cli import cli as _cli
from _adv_cli import femnist_toml, killed

_CF = """\
name = "cf"
seed = 0
[problem]
name = "least-squares"
num_clients = 4
n = 100
d_theta = 5
d_w = 3
seed = 0
[method]
algorithm = "ffgg"
w_init = "zero"
[personalize]
rounds = 2
eval_every = 1
client = { name = "cg", tau = 5 }
server = { optimizer = "sgd", lr = "1/L" }
"""


# -- area 8: a closed-form run (or a reproduction) writes over the user's summary.md ---------
@pytest.mark.parametrize("cmd", [("run", "cf.toml"), ("reproduce", "ls-tau", "--quick")],
                         ids=["run", "reproduce"])
def test_closed_form_run_never_writes_over_the_users_summary(tmp_path, cmd):
    (tmp_path / "cf.toml").write_text(_CF)
    (tmp_path / "summary.md").write_text("my own notes\n")
    r = _cli(tmp_path, None, *cmd, "--out", ".", "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    if r.returncode != 0:  # refused: one line, exit 2
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-400:]
    assert (tmp_path / "summary.md").read_text() == "my own notes\n", \
        f"exit {r.returncode}: the user's summary.md was replaced by the command's"


# -- area 4: a killed reproduction's temporary file is never cleaned -------------------------
def test_reproduce_cleans_the_temporary_file_of_a_killed_write(tmp_path):
    r = killed(tmp_path, None, "replace", "/o/summary.md", "reproduce", "ls-tau", "--quick",
               "--out", "o", "--no-progress")
    assert r.returncode == -9, (r.returncode, r.stderr[-400:])
    assert list((tmp_path / "o").glob(".summary.md.*.tmp"))  # the killed write's
    r = _cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--out", "o", "--no-progress")
    assert r.returncode == 0, r.stderr[-400:]
    assert (tmp_path / "o" / "summary.md").is_file()
    left = sorted(p.name for p in (tmp_path / "o").glob(".*.tmp"))
    assert not left, f"stale temporary files kept for good: {left}"


# -- area 8: a closed-form Flower run writes and deletes through a planted link --------------
def test_closed_form_flower_run_refuses_a_linked_flower_folder(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "result.json").write_text('{"mine": 1}\n')
    run = tmp_path / "r"
    run.mkdir()
    (run / "flower").symlink_to("../victim")
    (tmp_path / "cf.toml").write_text(_CF)
    r = _cli(tmp_path, None, "run", "cf.toml", "--out", "r", "--engine", "flower-sim",
             "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    assert (victim / "result.json").is_file(), \
        f"exit {r.returncode}: the file behind the link was deleted"
    assert (victim / "result.json").read_text() == '{"mine": 1}\n', \
        f"exit {r.returncode}: the file behind the link was replaced"
    assert sorted(os.listdir(victim)) == ["result.json"], \
        f"exit {r.returncode}: written through the link: {sorted(os.listdir(victim))}"
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, \
        (r.returncode, r.stderr[-400:])


# -- area 4: `partialfl report` of an interrupted run makes it "finished" --------------------
def test_report_of_an_interrupted_run_leaves_it_resumable(tmp_path, data_dir):
    (tmp_path / "c.toml").write_text(
        femnist_toml().replace("num_clients = 4", "num_clients = 6")
        .replace("holdout = 0", "holdout = 2"))
    out = tmp_path / "r"
    r = killed(tmp_path, data_dir, "replace", "/r/new_clients.json", "train", "c.toml",
               "--out", "r", "--no-progress")
    assert r.returncode == -9, (r.returncode, r.stderr[-400:])
    assert (out / "metrics.json").is_file() and not (out / "report.md").exists()
    r = _cli(tmp_path, data_dir, "report", "r")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    assert r.returncode in (0, 2), (r.returncode, r.stderr[-400:])
    r = _cli(tmp_path, data_dir, "train", "c.toml", "--out", "r", "--no-progress")
    assert r.returncode == 0, f"the resume is refused: {r.stderr.strip()[-300:]}"
    assert (out / "new_clients.json").is_file()
    assert (out / "run_files.json").is_file()
    assert not list(out.glob(".*.tmp")), sorted(p.name for p in out.glob(".*.tmp"))
    assert len(json.loads((out / "new_clients.json").read_text())["client_ids"]) == 2
    assert Path(out / "report.md").is_file()
