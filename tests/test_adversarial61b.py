"""Adversarial round 61b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against afee7a8: round 60b's ``evaluate --json`` guard
— :func:`partialfl.pipeline.run_files.refuse_run_file` now resolving the path with
``Path.resolve()``, :func:`~partialfl.pipeline.run_files.refuse_foreign` with
:func:`partialfl.pipeline.runs.is_evaluation_json` — ``study._check_kept`` by ``identity()``,
``clean_stale_writes(targets=...)`` matching exactly, and round 60a's zero-weight
asynchronous step), entered through the other commands that write a user-named output
(``run --out``, ``compare --out``, ``report``, ``advise --out``, ``data convert``, ``flower
credentials`` / ``node-data``) and odd paths. Each test below its controls failed on that
code because of the defect it names, and passes since the fix: ``refuse_users_entries``
refuses a folder holding another command's record (``run_files.json``, ``preexisting.json``,
``study.json``, ``reproduction.json``); the CLI gives pathlib's "Symlink loop" RuntimeError
(Python < 3.13) one line and exit 2, as the OSError (ELOOP) it stands for;
``certs.generate`` cleans only the temporary files of its own credential files.

* Area 4/8 (another command's files replaced by a closed-form run), ``partialfl run
  CONFIG --out DIR`` (a closed-form problem) guards DIR with
  :func:`partialfl.pipeline.run_files.refuse_users_entries`: it refuses to write
  ``NAME.png`` / ``summary.md`` over existing files *unless* ``NAME.jsonl`` is there, which it
  takes as the mark of an earlier ``partialfl run`` of the same name ("its own files,
  rewritten"). Nothing checks that the folder is not another command's: with the
  config's ``name`` equal to one of a finished ``partialfl train`` run's logs (``name =
  "stage2"`` or ``"stage2_train"``: ``--set name=stage2``), ``partialfl run ls.toml --set
  name=stage2 --out runs/b`` prints "results written to runs/b/ (stage2.jsonl, stage2.png,
  summary.md)", exit 0 — the run's stage-2 log ``stage2.jsonl`` (listed in its
  ``run_files.json``: what ``report`` rebuilds the report and plots from, and what ``compare``
  reads) is replaced by the closed-form history. Likewise in a reproduction's folder
  (``reproduce ls-tau --quick --out R``): ``run ls.toml --set name=ffgg-tau1 --out R``
  replaces the reproduction's ``ffgg-tau1.jsonl`` *and its* ``summary.md``, exit 0. The same
  commands with a name that has no ``.jsonl`` there (``learning_curves`` beside the train
  run's ``learning_curves.png``, the default ``ls`` in ``R``) are refused in one line (the
  controls), and ``evaluate --json runs/b/stage2.jsonl`` / ``--json R/summary.md`` are refused
  since rounds 58b / 60b. Expected: one line, exit 2, the files kept. Suspected root cause:
  ``refuse_users_entries`` (the mark trusted without ``refuse_run_file`` / a look at the
  folder's records ``run_files.json``, ``reproduction.json``, ``study.json``); the Flower
  closed-form path (:func:`partialfl.flower.train.run_flower_closed_form`) uses the same
  check.

* Area 8 (a traceback for a bad path), round 60b made ``refuse_run_file`` call
  ``Path.resolve()``, which on Python 3.11 and 3.12 raises ``RuntimeError("Symlink loop from
  ...")`` for a path through a symbolic-link loop (3.13 no longer raises); the CLI turns
  ``OSError`` ("a symlink loop") into one line but re-raises every ``RuntimeError`` that is not
  a Flower / study failure. ``partialfl evaluate RUN --json loop/x.json`` (``loop -> loop``)
  and ``--json loop`` now end in a full traceback, exit 1 — before 60b the same input was one
  line. The same holds for the older ``resolve()`` calls on user paths: ``evaluate RUN --data
  loop`` (:func:`partialfl.pipeline.train.evaluate_train_run`), ``run CONFIG --engine flower
  --out loop`` (:func:`partialfl.flower.train.run_flower_closed_form`) and ``flower local
  CONFIG --work-dir loop`` (:func:`partialfl.flower.local.run_local`). ``train --out loop``,
  ``compare loop``, ``report loop``, ``flower credentials loop`` are one line (controls).
  Expected: one line, exit 2. Suspected root cause: ``Path.resolve()`` on user paths without
  turning its ``RuntimeError`` into an ``OSError`` (or the CLI's ``RuntimeError`` branch).

* Area 4/8 (a command deleting files that are not its own), ``partialfl flower credentials
  OUT`` cleans OUT with :func:`partialfl.io.clean_stale_writes` *without* ``targets``
  (:func:`partialfl.flower.certs.generate`): every file of OUT named like a temporary
  file (``.X.XXXXXXXX.tmp``) goes, whatever wrote it — a user's ``.notes.20261128.tmp``, or the
  live temporary file of another command writing into the same folder (``evaluate --json
  OUT/eval.json``). ``compare``, ``report`` and ``evaluate --json`` clean only the temporary
  files of their own outputs (rounds 58b–60b; 60b made that match exact), the rationale of
  ``targets`` being "a command cleaning its own files in a folder others may write to".
  Expected: only the temporary files of ``ca.crt``, ``server.pem``, ``server.key`` and the
  ``supernode-i`` keys removed. Suspected root cause: ``certs.generate`` (no ``targets``).

Tried and held (run unless marked "read"): ``evaluate --json`` naming a folder (refused:
"not an earlier output"), a dangling link (refused), an earlier ``evaluate --json`` output
(replaced, its purpose); ``compare --out RUN/deploy.safetensors`` (one line: "File exists");
``report`` of a folder that is not a run (one line, the user's ``report.md`` kept);
``run ls.toml --out runs/b`` with a name that collides with nothing (new files beside the
train run, none replaced); ``train a.toml --out cf`` into a closed-form folder (refused:
``summary.md``); ``train`` / ``run --out loop``, ``compare loop``, ``report loop``,
``flower credentials loop``, ``flower node-data CFG loop`` (one line each); ``advise --out``
(its own checks first); (read) ``is_evaluation_json`` against the JSON files other commands
write (``metrics.json``, ``new_clients.json``, ``advisor.json``, ``reproduction.json``:
none has the four keys in every value); (read) the in-process asynchronous runtime's
zero-weight step (``skipped_step(old)``, as the synchronous ``_server_step``; only Flower
and closed forms run asynchronously, and a closed form's clients all hold examples);
(read) ``flower node-data OUT`` replacing only client stores (``check_replaceable``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from _adv_cli import LS_TOML, cli


def _cli(cwd, *args, timeout: float = 170):  # (no data folder, the code opt-in cleared)
    return cli(cwd, None, *args, timeout=timeout)




@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A finished ``partialfl train`` run (``runs/a``), a reproduction (``R``) and a
    closed-form config (``ls.toml``) in one folder."""
    from _user_project import TINY_MODEL, client_folder, tiny_toml

    root = tmp_path_factory.mktemp("adv61b")
    (root / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(root / "data", clients=6)
    tiny_toml(root / "a.toml", "usermodels:tiny", data, name="a")
    (root / "ls.toml").write_text(LS_TOML)
    p = _cli(root, "train", "a.toml", "--allow-code", "--out", "runs/a", "--no-progress")
    assert p.returncode == 0, p.stderr[-600:]
    p = _cli(root, "reproduce", "ls-tau", "--quick", "--out", "R", "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]
    return root


def _copy(root, src, name):
    import shutil

    dst = root / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(root / src, dst)
    return dst


# ----------------------------------------------------------------------------- area 4/8
def test_control_a_closed_form_run_beside_a_train_runs_plot_is_refused(root):
    run = _copy(root, "runs/a", "runs/c0")
    before = (run / "learning_curves.png").read_bytes()
    p = _cli(root, "run", "ls.toml", "--set", "name=learning_curves", "--out", "runs/c0",
             "--no-progress")
    assert p.returncode == 2 and (run / "learning_curves.png").read_bytes() == before


def test_control_a_closed_form_run_into_a_reproduction_is_refused(root):
    rep = _copy(root, "R", "R0")
    before = (rep / "summary.md").read_bytes()
    p = _cli(root, "run", "ls.toml", "--out", "R0", "--no-progress")
    assert p.returncode == 2 and (rep / "summary.md").read_bytes() == before


@pytest.mark.parametrize("name", ["stage2", "stage2_train"])
def test_a_closed_form_run_never_replaces_a_train_runs_log(root, name):
    """Found: "results written to runs/cN/ (stage2.jsonl, stage2.png, summary.md)", exit 0,
    the train run's ``stage2.jsonl`` replaced. Expected: one line, exit 2, the log kept."""
    run = _copy(root, "runs/a", f"runs/c-{name}")
    log = run / f"{name}.jsonl"
    before = log.read_bytes()
    p = _cli(root, "run", "ls.toml", "--set", f"name={name}", "--out", f"runs/c-{name}",
             "--no-progress")
    kept = log.read_bytes() == before
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-120:])


def test_a_closed_form_run_never_replaces_a_reproductions_results(root):
    """Found: "results written to R1/ (ffgg-tau1.jsonl, ffgg-tau1.png, summary.md)", exit
    0, the reproduction's summary and results replaced. Expected: one line, exit 2."""
    rep = _copy(root, "R", "R1")
    files = ("summary.md", "ffgg-tau1.jsonl")
    before = {f: (rep / f).read_bytes() for f in files}
    p = _cli(root, "run", "ls.toml", "--set", "name=ffgg-tau1", "--out", "R1",
             "--no-progress")
    kept = all((rep / f).read_bytes() == before[f] for f in files)
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-120:])


# ----------------------------------------------------------------------------- area 8
def _loop(root):
    link = root / "loop"
    if not link.is_symlink():
        os.symlink("loop", link)  # loop -> loop
    return "loop"


@pytest.mark.parametrize("args", [
    ("train", "a.toml", "--allow-code", "--no-progress", "--out", "loop"),
    ("compare", "loop"),
    ("report", "loop"),
])
def test_control_a_symlink_loop_is_one_line(root, args):
    _loop(root)
    p = _cli(root, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-300:]


_FLOWER = pytest.mark.skipif(importlib.util.find_spec("flwr") is None,
                             reason="flwr is not installed")


@pytest.mark.parametrize("args", [
    ("evaluate", "runs/a", "--allow-code", "--no-progress", "--json", "loop/x.json"),
    ("evaluate", "runs/a", "--allow-code", "--no-progress", "--json", "loop"),
    ("evaluate", "runs/a", "--allow-code", "--no-progress", "--data", "loop"),
    pytest.param(("run", "ls.toml", "--engine", "flower", "--no-progress", "--out", "loop"),
                 marks=_FLOWER),
    pytest.param(("flower", "local", "ls.toml", "--nodes", "2", "--insecure", "--no-progress",
                  "--work-dir", "loop", "--out", "lf"), marks=_FLOWER),
])
def test_a_path_through_a_symlink_loop_is_one_line(root, args):
    """Found: ``RuntimeError: Symlink loop from '.../loop/x.json'`` with a full traceback,
    exit 1. Expected: one line, exit 2 (as ``train --out loop``)."""
    _loop(root)
    p = _cli(root, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, \
        (p.returncode, p.stderr.strip()[-200:])


# ----------------------------------------------------------------------------- area 4/8
@pytest.mark.skipif(importlib.util.find_spec("cryptography") is None,
                    reason="cryptography is not installed")
def test_flower_credentials_removes_only_its_own_temporary_files(tmp_path):
    """Found: ``flower credentials OUT`` deletes ``OUT/.notes.20261128.tmp`` (a user's) and
    ``OUT/.eval.json.abcd1234.tmp`` (another command's write), exit 0. Expected: both kept
    (only the temporary files of its own credential files go)."""
    out = tmp_path / "creds"
    out.mkdir()
    theirs = [out / ".notes.20261128.tmp", out / ".eval.json.abcd1234.tmp"]
    for f in theirs:
        f.write_text("not the command's")
    mine = out / ".ca.crt.zz99yy88.tmp"  # a killed write of its own: may go
    mine.write_text("x")
    p = _cli(tmp_path, "flower", "credentials", "creds", "--nodes", "1")
    assert p.returncode == 0, p.stderr[-300:]
    assert not mine.exists()
    assert all(f.exists() for f in theirs), [f.name for f in theirs if not f.exists()]
