"""Adversarial round 44b (issue 21 areas 1, 3, 4, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found. Each test failed on the code it was written
against (adv44b at f4634cd) because of the defect it names, and passes since the fix:
``evaluate`` says which runs diverged (stderr, exit 1, a warning in its table, ``diverged`` in
``--json``); a later command's entry in a finished run (``report --tensorboard``,
``compare``) is listed in ``run_files.json`` (:func:`partialfl.pipeline.run_files.
record_added`), and a run refuses to start in a folder holding a user's entry named like one
it writes (:data:`~partialfl.pipeline.run_files.RUN_NAMES`).

* Area 8, a diverged run says so — in ``partialfl evaluate``: round 39b's fix warns in
  ``train`` (stderr, exit 1), round 40b's in a study and in ``compare`` (a warning naming the
  diverged runs), and ``report`` rebuilds the run's "the run diverged" warning — but
  ``partialfl evaluate RUN`` (:func:`partialfl.cli.runs` → :mod:`partialfl.pipeline.evaluation`)
  of a run whose losses ended non-finite (personalize server lr 1e30; its ``report.md`` says
  "the run diverged") prints the new clients' table (2.78% before and after fine-tuning,
  per-client rows), exit 0, not a word of divergence on stdout or stderr; ``--json`` prints
  ``"loss": NaN`` among the numbers. The same for a study folder (every run in it
  evaluated). Suspected root cause: ``evaluation`` / ``cli.runs._cmd_evaluate`` never look
  at the run's ``metrics.json`` (``train_report.divergence_line``) as ``compare`` does.
* Area 4/8, ``--overwrite`` and ``run_files.json`` bookkeeping — ``partialfl report RUN
  --tensorboard`` ("also (re)write TensorBoard scalars to RUN/tensorboard") writes
  ``RUN/tensorboard/`` into a finished run whose config had TensorBoard off, and does not add
  it to ``run_files.json`` (a run with ``tensorboard = true`` lists ``tensorboard`` there). A
  later ``partialfl train NEW --out RUN --overwrite`` deletes the recorded names only, and
  :func:`partialfl.pipeline.run_files.record_start` then records ``tensorboard`` — the old
  run's scalars, written by partialfl — as *the user's own file* in ``preexisting.json``. From
  then on the folder is never the run's again: a new config with ``tensorboard = true``
  writes its scalars into it (the old events file deleted) but leaves ``tensorboard`` out of
  its ``run_files.json``, and no later ``--overwrite`` deletes it (the same symptom as round
  40b's wedged removal, through a new entry point). Suspected root cause:
  ``cli.runs._cmd_report`` / ``train_report.write_report(tensorboard=True)`` do not record the
  folder they create in ``run_files.json``.
* Area 8, a run deletes the user's own files: ``--out`` holding the user's own
  ``tensorboard/`` folder (say their own TensorBoard logs,
  ``tensorboard/events.out.tfevents.1700000000.laptop.1.0``, and ``notes.txt``) and a config
  with ``logging.tensorboard = true``: the run records ``tensorboard`` in
  ``preexisting.json`` as the user's — and then
  :func:`partialfl.pipeline.train_report.write_tensorboard` unlinks every
  ``events.out.tfevents.*`` in it ("ours only: derived from the JSONL"), the user's file
  among them, exit 0 (``notes.txt`` kept). ``partialfl report RUN --tensorboard`` does the
  same. ``--overwrite`` never deletes a name of ``preexisting.json``; the run itself does.
  Suspected root cause: ``write_tensorboard`` assumes the folder is the run's (it should
  refuse, or write elsewhere, when ``tensorboard`` is one of the user's names).

Tried and held (not tested here): area 8 — ``evaluate`` inputs (``--json`` into a missing
folder (created), onto a folder or ``/proc/version``, ``--data`` a missing file / a config /
a folder, ``--lr`` NaN / −1, ``--finetune-epochs`` −3: one line, exit 2; 10²⁰ epochs runs, as
asked); ``data convert`` (out a link to a store, with and without ``--overwrite``; a dangling
link; ``--option`` ``max_clients`` / ``path`` / ``progress`` / a JSON object: one line, exit
2, nothing written); a closed-form run with server lr 1e6 ("the run diverged", exit 1) and
``--seeds`` on a closed form (one line, exit 2); area 4 — kill -9 of ``partialfl report`` at
the commit of ``report.md`` (the stale temporary file is cleaned by the next ``train``, refused
or ``--overwrite``), of ``partialfl compare`` of a study at ``compare.md`` (cleaned by the next
study command, even a refused one); ``report --tensorboard`` through a planted
``tensorboard -> ../victim`` link (refused, one line, the victim's files kept); ``evaluate
--data`` of a FEMNIST npz with labels 100 / −1, 14×14 images, a client index past
``writers`` (one line each); ``--seeds 0 0``, ``--sweep`` with a repeated value, a key given
twice, ``seed=…``, an empty value (one line, exit 2); backend options ``workers = true``,
``task_timeout = true``, threads ``workers = 1.0`` (one line, exit 2), processes with
``task_timeout = 0.001`` (fork: every result arrived before the next liveness poll, the run
finished); the umask 077 over a run with TensorBoard, ``evaluate --json FILE`` and
``compare`` (600 / 700 throughout); ``data convert`` into a folder below an existing store
(written; ``--overwrite`` of the outer store then refused by ``check_replaceable``); (read)
the worker pool's waits (``next`` bounded by ``poll``, ``close`` by its timeout, the
thread backend's ``close`` resetting its executor). Observed, not filed: ``partialfl compare
RUN`` writes ``compare.md`` / ``compare.png`` into the run folder (its default ``--out``) and
a later ``--overwrite`` records them as the user's own (the user asked for them there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _adv_cli import cli as _cli

_CFG = """\
name = "ow"
stages = ["personalize"]
seed = 0
device = "cpu"
backend = "sequential"
[model]
name = "emnist_cnn"
[data]
source = "femnist"
num_clients = 6
holdout = 2
[method]
algorithm = "ffgg"
split = "output"
[personalize]
rounds = ROUNDS
clients_per_round = 4
eval_every = 1
client = { lr = 0.01, epochs = 1, batch_size = 32 }
server = { optimizer = "sgd", lr = LR }
[finetune]
lr = 0.01
epochs = 1
batch_size = 32
[logging]
tensorboard = false
progress = false
"""


def _config(tmp_path: Path, name: str, lr: str, rounds: int = 1, tb: str = "false") -> str:
    (tmp_path / name).write_text(_CFG.replace("LR", lr).replace("ROUNDS", str(rounds))
                            .replace("tensorboard = false", f"tensorboard = {tb}"))
    return name


# -- area 8: evaluate of a diverged run ------------------------------------------------------
@pytest.mark.parametrize("where", ["run", "study"])
def test_evaluate_of_a_diverged_run_says_so(tmp_path, data_dir, where):
    d = _config(tmp_path, "d.toml", "1e30", rounds=3)
    if where == "run":
        r = _cli(tmp_path, data_dir, "train", d, "--out", "dv", "--no-progress")
        folder = tmp_path / "dv"
    else:
        r = _cli(tmp_path, data_dir, "train", d, "--seeds", "0", "--out", "dv",
                 "--no-progress")
        folder = tmp_path / "dv" / "seed=0"
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    assert "diverg" in (folder / "report.md").read_text().lower()  # the run did diverge
    r = _cli(tmp_path, data_dir, "evaluate", "dv", "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    assert r.returncode in (0, 1), (r.returncode, r.stderr[-300:])
    said = (r.stdout + r.stderr).lower()
    assert "diverg" in said, f"exit {r.returncode}, no word of divergence:\n{r.stdout[-500:]}"


# -- area 4/8: report --tensorboard and --overwrite ------------------------------------------
def test_report_tensorboard_is_never_recorded_as_the_users_file(tmp_path, data_dir):
    a = _config(tmp_path, "a.toml", "0.05")
    b = _config(tmp_path, "b.toml", "0.2")
    out = tmp_path / "exp"
    r = _cli(tmp_path, data_dir, "train", a, "--out", "exp", "--no-progress")
    assert r.returncode == 0, r.stderr[-400:]
    r = _cli(tmp_path, data_dir, "report", "exp", "--tensorboard")
    assert r.returncode == 0, r.stderr[-400:]
    assert (out / "tensorboard").is_dir()
    r = _cli(tmp_path, data_dir, "train", b, "--out", "exp", "--no-progress", "--overwrite")
    assert r.returncode == 0, r.stderr[-400:]
    assert json.loads((out / "spec.json").read_text())["personalize"]["server"]["lr"] == 0.2
    mine = json.loads((out / "preexisting.json").read_text())["names"]
    assert mine == [], f"the old run's files recorded as the user's own: {mine}"


# -- area 8: a run deletes the user's own TensorBoard files ----------------------------------
def test_a_run_never_deletes_the_users_own_tensorboard_files(tmp_path, data_dir):
    tb = _config(tmp_path, "tb.toml", "0.05", tb="true")
    mine = tmp_path / "exp" / "tensorboard" / "events.out.tfevents.1700000000.laptop.1.0"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"my own TensorBoard scalars")
    (mine.parent / "notes.txt").write_text("my notes\n")
    r = _cli(tmp_path, data_dir, "train", tb, "--out", "exp", "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    if r.returncode == 0:  # it ran: the folder was recorded as the user's
        names = json.loads((tmp_path / "exp" / "preexisting.json").read_text())["names"]
        assert names == ["tensorboard"], names
    else:  # or it refused the folder, one line
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-400:]
    assert (mine.parent / "notes.txt").is_file()
    assert mine.is_file(), "the run deleted the user's own TensorBoard events file"
    assert mine.read_bytes() == b"my own TensorBoard scalars"
