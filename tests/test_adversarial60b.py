"""Adversarial round 60b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 64afb2f: round 59b's fixes — ``evaluate --json``
guarding every run record and unfinished runs with ``..`` resolved, a resumed ``train``
recording its spec once accepted, ``study._check_kept``, ``clean_stale_writes(targets=...)``,
the closed-form warning counting worker deaths). Each test below its control failed on that
code because of the defect it names, and passes since the fix: ``refuse_run_file`` resolves
the path as the write reaches it (``Path.resolve``: links, then ``..``); ``evaluate --json
FILE`` replaces an existing FILE only when it holds an earlier ``evaluate --json`` output
(:func:`partialfl.pipeline.run_files.refuse_foreign` with
:func:`partialfl.pipeline.runs.is_evaluation_json`: a whitelist, so no other command's file
needs its own guard); ``_check_kept`` compares the specs' ``identity()``; and
``clean_stale_writes(targets=...)`` matches a target's temporary name exactly (the round's
side note, tested last).

* Area 8 (a symbolic link escaping the guard of a run's files), round 59b made
  :func:`partialfl.pipeline.run_files.refuse_run_file` resolve ``..`` — *lexically*
  (``os.path.abspath``), while the write that follows (``io.write_text`` → ``atomic_write``:
  ``mkdir`` of the parent, ``mkstemp`` in it, ``os.replace``) lets the operating system
  resolve it *physically*: ``LINK/..`` is the parent of the link's target, not the folder
  holding the link. With a link to a sub-folder of a finished run (``latest ->
  runs/b/stage1``, or any link into ``runs/b/personalized``), ``partialfl evaluate runs/b
  --json latest/../deploy.safetensors`` is checked as ``./deploy.safetensors`` (no run
  there: accepted), prints "metrics written to latest/../deploy.safetensors", exit 0 — and
  the run's trained model ``runs/b/deploy.safetensors`` is replaced by the evaluation's JSON
  (the exact case round 58b fixed). The same path without the link (``runs/b/stage1/../
  deploy.safetensors``) is refused (the control). Expected: one line, exit 2, the model
  kept. Suspected root cause: ``refuse_run_file`` (``os.path.abspath`` where
  ``Path.resolve()`` — symbolic links followed, a missing tail resolved lexically, as the
  write will — is what the write reaches).

* Area 8 (the same guard, other runs' results), ``refuse_run_file`` knows a run's files
  only through ``run_files.json`` (a ``train`` run's) and ``preexisting.json`` (an
  unfinished one); a closed-form ``partialfl run`` folder (``NAME.jsonl``, ``NAME.png``,
  ``summary.md``: no record) and a reproduction's folder (``reproduction.json``, its only
  guarded entry, beside ``summary.md``, the ``*.jsonl`` results and plots) have neither, so
  ``partialfl evaluate RUN --json OUT/summary.md`` (or ``OUT/NAME.jsonl``,
  ``R/ffgg-tau1.jsonl``) prints "metrics written to ...", exit 0, and the closed-form run's
  report / history or the reproduction's summary / results are replaced by the evaluation's
  JSON — while ``--json R/reproduction.json`` is refused (the control). Likewise a study's
  ``compare.md`` (``partialfl compare st`` writes it into the study folder, its default
  ``--out``; in a run folder ``compare`` records it in ``run_files.json`` and the guard
  refuses it, in a study folder nothing records it). Expected: one line, exit 2, the file
  kept, as for a ``train`` run's ``report.md`` or ``compare.md``. Suspected root cause:
  ``refuse_run_file`` (no notion of a closed-form run's files — the marks
  ``closed_form.run_and_report`` / ``refuse_users_entries`` use — nor of the entries of a
  folder a reproduction claimed with ``claim_folder``).

* Area 4 (an interrupted study refused by its own finished runs), round 59b's
  :func:`partialfl.pipeline.study._check_kept` compares a finished run's whole
  ``spec.json`` with the study's spec — ``logging`` (``progress``, ``tensorboard``),
  ``device`` and ``name`` included — while a run's resume compares
  :meth:`~partialfl.spec.run.RunSpec.identity` (the spec "without what does not change
  results (device, logging, progress)"). A study ``train a.toml --seeds 0 1`` interrupted
  in its seed 1 (killed before its ``report.md``), resumed as ``train a.toml --seeds 0 1
  --set logging.tensorboard=true`` (or ``logging.progress``: to watch it this time) ends
  with "partialfl: error: st/seed=0 holds a finished run of another configuration than
  a.toml gives it: this folder holds another study; pass --overwrite ...", exit 2 — a false
  message (the folder holds this study), whose remedy deletes the finished run; the same
  ``--set`` resumes a single interrupted run (exit 0), and the same command without it
  completes the study (the controls). Expected: the study completes (seed 0 kept, seed 1
  resumed), exit 0. Suspected root cause: ``_check_kept`` (``to_dict()`` where
  ``identity()`` is what a resume must match).

Tried and held (no test): ``evaluate --json st/seed=0`` (a study's run folder: one line,
exit 2, no temporary file left); ``evaluate --json`` through a link to the run folder itself
(``M -> runs/b``, ``--json M/metrics.json``: refused, the records read through the link);
``[asynchronous] fedbuff`` buffer 4 with ``tm`` δ 0.2 (f = 0: refused by ``--dry-run`` in one
line; buffer 5 runs); ``evaluate --lr nan`` / ``inf`` (one line, exit 2), ``--lr 1e308``
(diverged, warned, exit 1), ``--finetune-epochs -1`` (one line) / ``0`` (before = after);
a resumed ``train`` with another ``[finetune]`` after ``metrics.json`` was written
(``config.json``'s identity covers every stage: refused in one line). Read in the code, not
run: the closed-form warning's counters (``FaultLog`` counts are cumulative, so a loss in an
early round is still in the last record); ``method.weighting = "examples"`` with ``mean``
(``weighted`` false: refused), ``gm`` ``weighted = true`` (tolerates 0: the attack fraction
is refused), a wrapper chain (``inner`` walked to the rule, bucketing refused); L2GD under
per-client backends (each client's steps depend on the round's coin only; a dropped
update's client-state row is not committed: ``receive`` then ``result.updates.cohort``).
"""

from __future__ import annotations

import os

import pytest
from _adv_cli import LS_TOML, cli, copy_run, evaluate_json, trained_user_run


def _cli(cwd, *args, timeout: float = 170):  # (no data folder, the code opt-in cleared)
    return cli(cwd, None, *args, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_user_run(tmp_path_factory.mktemp("ev60b"))




def test_control_dotdot_through_the_runs_own_sub_folder_is_refused(trained):
    run = copy_run(trained, "c0")
    model = (run / "deploy.safetensors").read_bytes()
    p = evaluate_json(trained, run, f"runs/{run.name}/stage1/../deploy.safetensors")
    assert p.returncode == 2 and (run / "deploy.safetensors").read_bytes() == model


def test_control_a_link_to_the_run_folder_is_refused(trained):
    run = copy_run(trained, "c1")
    metrics = (run / "metrics.json").read_bytes()
    link = trained / "to-c1"
    if not link.is_symlink():
        os.symlink(run, link)
    p = evaluate_json(trained, run, "to-c1/metrics.json")
    assert p.returncode == 2 and (run / "metrics.json").read_bytes() == metrics


def test_evaluate_json_through_a_link_and_dotdot_keeps_the_model(trained):
    """Found: exit 0, "metrics written to latest/../deploy.safetensors", the run's
    ``deploy.safetensors`` replaced by the JSON. Expected: one line, exit 2, model kept."""
    run = copy_run(trained, "c2")
    model = (run / "deploy.safetensors").read_bytes()
    link = trained / "latest"
    if not link.is_symlink():
        os.symlink(run / "stage1", link)  # a user's shortcut into the run
    p = evaluate_json(trained, run, "latest/../deploy.safetensors")
    kept = (run / "deploy.safetensors").read_bytes() == model
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-100:])


# ----------------------------------------------------------------------------- area 8


@pytest.fixture(scope="module")
def others(trained):
    """A closed-form run (``cf/``) and a reproduction (``R/``) beside the trained run."""
    (trained / "ls.toml").write_text(LS_TOML)
    p = _cli(trained, "run", "ls.toml", "--out", "cf", "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    p = _cli(trained, "reproduce", "ls-tau", "--quick", "--out", "R", "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    p = _cli(trained, "train", "a.toml", "--allow-code", "--seeds", "0", "1", "--out", "st",
             "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    p = _cli(trained, "compare", "st")  # its default --out: the study folder
    assert p.returncode == 0 and (trained / "st" / "compare.md").is_file(), p.stderr[-400:]
    return trained


def test_control_a_reproductions_record_is_refused(others):
    rec = (others / "R" / "reproduction.json").read_bytes()
    p = evaluate_json(others, others / "runs" / "a", "R/reproduction.json")
    assert p.returncode == 2 and (others / "R" / "reproduction.json").read_bytes() == rec


@pytest.mark.parametrize("target", ["cf/summary.md", "cf/ls.jsonl", "R/summary.md",
                                    "R/ffgg-tau1.jsonl", "st/compare.md"])
def test_evaluate_json_never_replaces_another_commands_results(others, target):
    """Found: exit 0, "metrics written to cf/summary.md" (each target), the file replaced
    by the evaluation's JSON. Expected: one line, exit 2, the file kept."""
    before = (others / target).read_bytes()
    p = evaluate_json(others, others / "runs" / "a", target)
    kept = (others / target).read_bytes() == before
    if not kept:  # the next parametrization finds the folder as it was
        (others / target).write_bytes(before)
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-100:])


# ----------------------------------------------------------------------------- area 4
def _interrupted_study(root, name):
    import shutil

    study = root / name
    shutil.rmtree(study, ignore_errors=True)
    p = _cli(root, "train", "a.toml", "--allow-code", "--seeds", "0", "1", "--out", name,
             "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    for f in ("report.md", "run_files.json"):  # seed 1 killed before its report
        (study / "seed=1" / f).unlink()
    return study


def test_control_an_interrupted_study_completes(trained):
    study = _interrupted_study(trained, "st0")
    p = _cli(trained, "train", "a.toml", "--allow-code", "--seeds", "0", "1", "--out", "st0",
             "--no-progress")
    assert p.returncode == 0 and (study / "seed=1" / "report.md").is_file(), p.stderr[-300:]


def test_control_a_run_resumes_with_other_logging(trained):
    import shutil

    run = trained / "runs" / "r0"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(trained / "runs" / "a", run)
    for f in ("report.md", "run_files.json"):
        (run / f).unlink()
    p = _cli(trained, "train", "a.toml", "--allow-code", "--out", "runs/r0", "--no-progress",
             "--set", "logging.tensorboard=true")
    assert p.returncode == 0 and (run / "report.md").is_file(), p.stderr[-300:]


def test_an_interrupted_study_resumes_with_other_logging(trained):
    """Found: "st1/seed=0 holds a finished run of another configuration than a.toml gives
    it: this folder holds another study; pass --overwrite ...", exit 2. Expected: exit 0,
    seed 1 finished, seed 0 kept."""
    study = _interrupted_study(trained, "st1")
    p = _cli(trained, "train", "a.toml", "--allow-code", "--seeds", "0", "1", "--out", "st1",
             "--no-progress", "--set", "logging.tensorboard=true")
    assert p.returncode == 0 and (study / "seed=1" / "report.md").is_file(), \
        p.stderr.strip()[-300:]


def test_cleaning_one_targets_temporary_file_keeps_another_files(tmp_path):
    """Reported by the round (not filed): ``clean_stale_writes(targets=("a",))`` matched
    by prefix, so it removed the temporary file of a write to ``a.json`` in the same folder
    too. Expected: only ``.a.XXXXXXXX.tmp``."""
    from partialfl import io as pio

    mine, other = tmp_path / ".a.abcd1234.tmp", tmp_path / ".a.json.abcd1234.tmp"
    mine.write_text("x")
    other.write_text("y")
    assert pio.clean_stale_writes(tmp_path, recursive=False, targets=("a",)) == [mine]
    assert other.exists() and not mine.exists()
