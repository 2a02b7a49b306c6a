"""Adversarial round 62b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 5dc803d: round 61b's
:func:`partialfl.pipeline.run_files.refuse_users_entries` refusing a folder that holds
another command's record, the CLI's one line for pathlib's "Symlink loop" RuntimeError,
``flower credentials`` cleaning only its own temporary files and
``clean_stale_writes(targets=...)`` matching ``name[1:-13]``). Each test below failed on
that code because of the defect it names, and passes since the fix: ``_clean_interrupted``
cleans only a folder of the command's own kind, by its marks — a closed-form run only the
temporary files of its own three files, never in a folder holding another command's record
(refused later, untouched); a model run by its start record or spec; a study by its
record.

* Area 4/8 (a refused command deleting another command's files), ``partialfl run CONFIG
  --out DIR`` calls :func:`partialfl.cli.run._clean_interrupted` *before* anything else:
  when DIR holds ``preexisting.json``, ``spec.json``, ``study.json`` or ``NAME.jsonl`` it
  runs :func:`partialfl.io.clean_stale_writes` on DIR — recursively and without
  ``targets`` — and only then does a closed-form spec reach round 61b's
  ``refuse_users_entries``. So ``partialfl run ls.toml --out S``, S the folder of a study
  (``study.json``; its worker processes write their runs' files in S's sub-folders while it
  runs), prints "S holds the files of another command (study.json): choose another --out",
  exit 2 — after deleting every ``.X.XXXXXXXX.tmp`` in S and below: the live atomic writes
  of the study's runs (their ``os.replace`` then fails: the run dies) and any file of the
  user's named like one. The same with the folder of a ``train`` still running
  (``preexisting.json`` without ``run_files.json``). Expected: a refused command leaves the
  folder as it was (refuse first, then clean). Suspected root cause:
  :func:`partialfl.cli.run.main`'s call to ``_clean_interrupted`` before the closed-form
  branch (its marks ``preexisting.json`` / ``spec.json`` / ``study.json`` are a model run's
  or a study's, not a closed-form run's, whose only mark is ``NAME.jsonl``).

* Area 4 (a command cleaning files that are not its own), the same
  ``_clean_interrupted`` on a closed-form run's own folder (``NAME.jsonl`` there: a rerun,
  which round 61b keeps allowed) removes every temporary-looking file of the whole tree
  below ``--out``, not those of the three files the run writes (``NAME.jsonl``,
  ``NAME.png``, ``summary.md``): a user's ``.notes.20261128.tmp`` beside them, and the live
  temporary file of another command writing in a sub-folder (``evaluate RUN --json
  DIR/sub/eval.json``, or a ``train --out DIR/sub`` running). Round 61b fixed exactly this
  for ``flower credentials`` (the rationale of ``targets``: "a command cleaning its own
  files in a folder others may write to"); a closed-form run's folder is not its own
  either (it refuses only the three names it writes). Expected: only the temporary files of
  ``NAME.jsonl``, ``NAME.png`` and ``summary.md`` removed. Suspected root cause:
  ``_clean_interrupted`` (``pio.clean_stale_writes(out)`` without ``targets`` for a
  closed-form spec).

Tried and held: a closed-form run rerun into its own folder (exit 0, files rewritten);
``compare CF``, ``report CF``, ``evaluate CF --json CF/x.json`` on a closed-form folder (one
line each, nothing recorded there, so the rerun still runs); (read) ``refuse_users_entries``
with the Flower closed form (the ServerApp's ``flower/`` sub-folder holds no top-level
record); (read) ``certs._OWN`` with ``n[1:-13]`` of names shorter than 13 characters (the
empty string matches nothing); (read) ``clean_stale_writes`` ``name[1:-13]`` together with
``_STALE`` (a user's ``.a.json.abcdefgh.tmp`` is not a write of ``a``); (read) the store
header: every file name through ``safe_file`` (plain names, links only inside the folder,
loops refused), sizes checked against dtype × shape, ``header_crc32``, x_scale bounded,
rows checked for non-finite floats and labels outside 0..C-1 after reads, the CRC sidecar
keyed by inode/size/mtime/ctime; (read) ``check_delta`` (NaN, bool, ≥ 0.5 refused),
``count`` (⌊δk⌋ with a 1e-9 guard: never fewer trimmed than claimed).
"""

from __future__ import annotations

import json

import pytest
from _adv_cli import LS_TOML, cli


def _cli(cwd, *args, timeout: float = 170):  # (no data folder, the code opt-in cleared)
    return cli(cwd, None, *args, timeout=timeout)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "ls.toml").write_text(LS_TOML)
    return tmp_path


def _study_in_progress(root):
    """The folder of a study whose worker is writing a run's checkpoint (its live atomic
    write: ``.NAME.XXXXXXXX.tmp`` beside the target) and a user's own file there."""
    s = root / "S"
    (s / "seed0").mkdir(parents=True)
    (s / "study.json").write_text(json.dumps({"runs": [{"folder": "seed0"}]}))
    live = s / "seed0" / ".stage2.ckpt.k3x9q2ab.tmp"
    live.write_bytes(b"half a checkpoint")
    notes = s / ".notes.20261128.tmp"
    notes.write_text("mine")
    return s, [live, notes]


def test_control_a_closed_form_run_into_a_study_is_refused(root):
    s, _ = _study_in_progress(root)
    p = _cli(root, "run", "ls.toml", "--out", "S", "--no-progress")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-300:]
    assert not (s / "ls.jsonl").exists()


def test_a_refused_closed_form_run_leaves_a_studys_folder_as_it_was(root):
    """Found: "S holds the files of another command (study.json): choose another --out",
    exit 2 — and ``S/seed0/.stage2.ckpt.k3x9q2ab.tmp`` (a worker's write in progress) and
    ``S/.notes.20261128.tmp`` gone. Expected: exit 2, both kept."""
    s, files = _study_in_progress(root)
    p = _cli(root, "run", "ls.toml", "--out", "S", "--no-progress")
    gone = [str(f.relative_to(s)) for f in files if not f.exists()]
    assert p.returncode == 2 and not gone, (p.returncode, gone)


def test_a_refused_closed_form_run_leaves_a_running_trains_folder_as_it_was(root):
    """A ``train`` still running in ``runs/a`` (``preexisting.json``, no ``run_files.json``)
    writing ``stage2.jsonl``. Found: refused (exit 2), its temporary file deleted."""
    run = root / "runs" / "a"
    run.mkdir(parents=True)
    (run / "preexisting.json").write_text(json.dumps({"names": []}))
    (run / "spec.json").write_text("{}")
    live = run / ".stage2.jsonl.p0w7c1zz.tmp"
    live.write_text('{"round": 1}\n')
    p = _cli(root, "run", "ls.toml", "--out", "runs/a", "--no-progress")
    assert p.returncode == 2 and live.exists(), (p.returncode, live.exists(), p.stderr[-200:])


def test_control_a_closed_form_rerun_cleans_its_own_killed_writes(root):
    p = _cli(root, "run", "ls.toml", "--out", "cf", "--no-progress")
    assert p.returncode == 0, p.stderr[-300:]
    own = [root / "cf" / f".{n}.abcd1234.tmp" for n in ("ls.jsonl", "ls.png", "summary.md")]
    for f in own:
        f.write_text("killed")
    p = _cli(root, "run", "ls.toml", "--out", "cf", "--no-progress")
    assert p.returncode == 0 and not any(f.exists() for f in own), p.stderr[-300:]


def test_a_closed_form_rerun_cleans_only_its_own_temporary_files(root):
    """Found: the rerun (exit 0) removed the user's ``cf/.notes.20261128.tmp`` and the live
    write ``cf/sub/.eval.json.abcd1234.tmp`` of another command. Expected: both kept."""
    p = _cli(root, "run", "ls.toml", "--out", "cf", "--no-progress")
    assert p.returncode == 0, p.stderr[-300:]
    (root / "cf" / "sub").mkdir()
    others = [root / "cf" / ".notes.20261128.tmp", root / "cf" / "sub" / ".eval.json.abcd1234.tmp"]
    for f in others:
        f.write_text("not the run's")
    p = _cli(root, "run", "ls.toml", "--out", "cf", "--no-progress")
    gone = [f.name for f in others if not f.exists()]
    assert p.returncode == 0 and not gone, (p.returncode, gone)
