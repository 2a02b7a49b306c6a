"""Adversarial round 63b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against c9e6f11: round 62b's
:func:`partialfl.cli.run._clean_interrupted` cleaning only a folder of the command's own
kind, and round 62a's ``warn_diverged``). Each test below (but the controls) failed on that
code because of the defect it names, and passes since the fix: a model run cleans only an
unfinished run's folder, never the user's own entries (``preexisting.json``; ``skip`` of
:func:`partialfl.io.clean_stale_writes`); a study cleans its folder only once it accepted it
(after ``write_index`` in :func:`partialfl.pipeline.study.run_study`); a Flower closed-form
run writes its log (the folder's mark) first, as in process, so a killed one runs again.

* Area 4/8 (a command deleting the user's own files), ``partialfl train CONFIG --out RUN``
  on a model run's folder (``preexisting.json`` or ``spec.json`` there) runs
  :func:`partialfl.io.clean_stale_writes` on the WHOLE tree of RUN, without ``targets``,
  before anything else. The run's own record ``preexisting.json`` names the entries that
  were the user's before the run started (``--overwrite`` never deletes them, "the user's
  own files already there"), yet every temporary-looking file among them goes: a user's
  ``RUN/.todo.20261128.tmp`` (listed in ``preexisting.json``) and
  ``RUN/notes/.draft.abcd1234.tmp`` in the user's own sub-folder ``notes`` (listed too) —

  - when the command is REFUSED: a rerun on the finished run without ``--overwrite``
    prints "RUN holds a finished run; pass --overwrite …", exit 2, after deleting both
    (a finished run has nothing to resume; the same happens to another command's live
    write there, e.g. ``evaluate RUN --json RUN/notes/e.json``);
  - when a killed run resumes (SIGKILL at its ``metrics.json`` write): the rerun cleans its
    own ``.metrics.json.*.tmp`` — and both of the user's files.

  Round 62b fixed exactly this for a closed-form run ("a user's ``.notes.20261128.tmp``
  beside them" kept: only the temporary files of its own files are removed). Expected: a
  model run removes only temporary files of its own entries (not those named by
  ``preexisting.json``, nor below them), and a refused command leaves the folder as it was.
  Suspected root cause: ``_clean_interrupted``'s model branch (``pio.clean_stale_writes(out)``
  whole tree, before ``claim_out``'s refusal).

* Area 4/8 (the same, study against study), ``partialfl train CONFIG --seeds 5 --out S``
  into the folder of another study (``study.json`` with other runs; its worker writing run
  ``seed=1``'s checkpoint: ``S/seed=1/.stage2.ckpt.XXXXXXXX.tmp``) is refused by
  :func:`partialfl.pipeline.study.write_index` ("S holds another study (other seeds or
  sweep); choose another --out", exit 2) — after ``_clean_interrupted`` (marked by
  ``study.json``) deleted the other study's live write (its ``os.replace`` then fails and
  that run dies). The study twin of round 62b's refused closed-form run. Expected: refuse
  first, then clean. Suspected root cause: ``_clean_interrupted`` called in ``_cmd_run``
  before ``run_study`` checks the index.

* Area 4 (a killed run that cannot run again), a closed-form run on Flower (``partialfl run
  ls.toml --engine flower-sim``) killed after its federation ended — the ServerApp has
  written ``OUT/flower/{result.json, metrics.jsonl, theta.npz}`` (by reading, the same
  with ``--flower checkpoint-every=1`` from the first round on, or an aborted run's
  report), ``ls.jsonl``
  not yet written (``_records`` runs after the federation is torn down) — can never be run
  again into the same ``--out``: "OUT/flower is not this run's (no ls.jsonl beside it) but
  has the name of a file the run writes, which would replace it: move it", exit 2. The
  folder ``flower`` is the run's own. Suspected root cause:
  :func:`partialfl.flower.train.run_flower_closed_form` (``refuse_users_entries`` with
  ``ls.jsonl`` as the only mark, written last on Flower, first in process).

Tried and held: a model run's first start beside the user's entries (recorded in
``preexisting.json``, kept); a closed-form rerun; a refused study's control; a model
``train`` into a reproduction's folder (refused by its ``summary.md``); ``data convert``
with bad ``--option`` keys / types / values, ``--max-clients 3``, an input of the other
format, a folder or a text file as the npz, ``OUT`` an existing file, a FIFO, a dangling
symlink (with and without ``--overwrite``), a store nested in another store's folder (then
``--overwrite`` of the outer one refused), the umask (077 / 002) on the store folder and
files; (read) the store writer's lock / pid liveness, ``_swap``'s ``.old-`` restore,
header ``safe_file`` and sizes, offsets checks, the CRC sidecar's key; robust rules
(caf, cc, cm, gm, krum, multi-krum, mda, meamed, smea, tm; δ 0.1–0.45; plain, bucketing 2,
nnm, arc, nnm + bucketing) over k = 5–20 with ⌊tolerated⌋ Byzantine rows of ±1e300, 1e160,
1e30, alternating ±1e200, one coordinate 1e250, a shifted cluster, N(0, 1e6) at the first or
middle positions: every result finite and within the honest rows' range (~8,000 cases).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _adv_cli import _KILL_AT, LS_TOML, cli, env


def _cli(cwd, *args, timeout: float = 170):  # (no data folder, the code opt-in cleared)
    return cli(cwd, None, *args, timeout=timeout)


def _killed(cwd, tail, *args):
    (cwd / "kill_at.py").write_text(_KILL_AT)
    return subprocess.run([sys.executable, str(cwd / "kill_at.py"), *args], cwd=cwd,
                          env=env(None, KILL_CALL="replace", KILL_PATH=tail),
                          capture_output=True, text=True, timeout=170)


@pytest.fixture
def project(tmp_path):
    """A researcher's tiny model and client folder, a train config ``a.toml``, and the run
    folder ``runs/a`` prepared with the user's own entries: a notes file named like a
    temporary file at its top and a draft in the user's own sub-folder."""
    from _user_project import TINY_MODEL, client_folder, tiny_toml

    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    tiny_toml(tmp_path / "a.toml", "usermodels:tiny", data, name="a")
    run = tmp_path / "runs" / "a"
    (run / "notes").mkdir(parents=True)
    users = [run / ".todo.20261128.tmp", run / "notes" / ".draft.abcd1234.tmp"]
    for f in users:
        f.write_text("the user's own")
    return tmp_path, run, users


# ----------------------------------------------------------------------------- area 4/8
def test_control_the_users_entries_are_recorded_and_kept_by_the_run(project):
    root, run, users = project
    p = _cli(root, "train", "a.toml", "--allow-code", "--out", "runs/a", "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    import json

    assert set(json.loads((run / "preexisting.json").read_text())["names"]) == {
        ".todo.20261128.tmp", "notes"}
    assert all(f.exists() for f in users)


def test_a_refused_rerun_of_a_finished_train_keeps_the_users_files(project):
    root, run, users = project
    p = _cli(root, "train", "a.toml", "--allow-code", "--out", "runs/a", "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    p = _cli(root, "train", "a.toml", "--allow-code", "--out", "runs/a", "--no-progress")
    gone = [str(f.relative_to(run)) for f in users if not f.exists()]
    assert p.returncode == 2 and "finished run" in p.stderr, p.stderr[-300:]
    assert not gone, gone


def test_a_resumed_train_keeps_the_users_files(project):
    root, run, users = project
    p = _killed(root, "runs/a/metrics.json", "train", "a.toml", "--allow-code", "--out",
                "runs/a", "--no-progress")
    assert p.returncode == -9, (p.returncode, p.stderr[-300:])
    assert list(run.glob(".metrics.json.*.tmp"))
    p = _cli(root, "train", "a.toml", "--allow-code", "--out", "runs/a", "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    assert not list(run.glob(".metrics.json.*.tmp"))  # the run's own killed write: cleaned
    gone = [str(f.relative_to(run)) for f in users if not f.exists()]
    assert not gone, gone


# ----------------------------------------------------------------------------- area 4

# the CLI killed (SIGKILL) once the federation has ended: the ServerApp has written
# OUT/flower/{result.json, metrics.jsonl, theta.npz}, ls.jsonl is not written yet
_KILL_BEFORE_LOG = """\
import os, signal, sys
import partialfl.flower.train as ft
ft._records = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
import partialfl.cli as cli
sys.exit(cli.main(sys.argv[1:]))
"""

_FLOWER = ("run", "ls.toml", "--engine", "flower-sim", "--supernodes", "2", "--out", "F",
           "--no-progress")


@pytest.mark.slow
def test_a_killed_flower_closed_form_run_can_be_run_again(tmp_path):
    (tmp_path / "ls.toml").write_text(LS_TOML)
    (tmp_path / "kill.py").write_text(_KILL_BEFORE_LOG)
    p = subprocess.run([sys.executable, str(tmp_path / "kill.py"), *_FLOWER], cwd=tmp_path,
                       env=env(None), capture_output=True, text=True, timeout=170)
    assert p.returncode == -9, (p.returncode, p.stderr[-300:])
    assert (tmp_path / "F" / "flower" / "result.json").is_file()
    log = tmp_path / "F" / "ls.jsonl"  # no history yet (since the fix: the empty mark)
    assert not log.exists() or log.read_text() == ""
    p = _cli(tmp_path, *_FLOWER)
    assert p.returncode == 0, p.stderr[-300:]
    assert log.read_text().strip()


# ----------------------------------------------------------------------------- area 4/8
def _running_study(root):
    """The folder of a study (seeds 0 and 1) whose worker is writing run ``seed=1``'s
    checkpoint: its live atomic write ``.stage2.ckpt.XXXXXXXX.tmp``."""
    import json

    s = root / "S"
    (s / "seed=1").mkdir(parents=True)
    (s / "study.json").write_text(json.dumps({
        "format": "partialfl.study/1", "config": str(root / "a.toml"), "seeds": [0, 1],
        "sweep": {}, "runs": [{"folder": f"seed={i}", "seed": i, "set": {}} for i in (0, 1)]}))
    live = s / "seed=1" / ".stage2.ckpt.k3x9q2ab.tmp"
    live.write_bytes(b"half a checkpoint")
    return s, live


def test_control_another_study_into_a_studys_folder_is_refused(project):
    root, _, _ = project
    s, _ = _running_study(root)
    p = _cli(root, "train", "a.toml", "--allow-code", "--seeds", "5", "--out", "S",
             "--jobs", "1", "--no-progress")
    assert p.returncode == 2 and "another study" in p.stderr, p.stderr[-300:]
    assert not (s / "seed=5").exists()


def test_a_refused_study_leaves_another_studys_folder_as_it_was(project):
    root, _, _ = project
    s, live = _running_study(root)
    p = _cli(root, "train", "a.toml", "--allow-code", "--seeds", "5", "--out", "S",
             "--jobs", "1", "--no-progress")
    assert p.returncode == 2, p.stderr[-300:]
    assert live.exists(), "the other study's live write was deleted"
