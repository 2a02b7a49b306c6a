"""Adversarial round 67b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against e7715d9: round 66b's ``claim_folder`` and
``x_scale_problem``, then wide — every key of the run spec given a value of the wrong type,
``data convert`` beside the user's own folders and killed mid-way, pools at edge timeouts,
odd δ in the Byzantine reproduction). Each test below (but the controls) failed on that code
because of the defect it names, and passes since the fix: ``config._coerce`` checks a key
typed ``dict[...]`` as it checks a nested table (a table with string keys, else one line
naming the key); the store writer's ``clean_stale`` removes only folders named exactly as a
writer names them (``.NAME.tmp-PID-HEX12`` / ``.NAME.old-PID-HEX12``, or an older writer's
``.NAME.tmp-HEX12``).

* Area 8 (a bad TOML value is one line and exit 2), a key typed as a table — ``[model]
  options``, ``[data] options``, ``[logging] wandb`` / ``mlflow`` — takes ANY value:
  :func:`partialfl.config._coerce` has a branch for unions, literals, lists, tuples,
  dataclasses, float, int, bool and str, but none for ``dict[...]`` (the value falls through
  to ``return value``). So ``[model] options = [1]`` (or ``true``, ``1.5``, ``-1``) makes
  ``partialfl run CFG --dry-run`` print a traceback, exit 1 (``TypeError: cannot convert
  dictionary update sequence element #0 to a sequence`` in
  :func:`partialfl.build.task.build_model`'s ``dict(model_spec.options)``); ``[data] options
  = "x"`` (any non-table) the same from :func:`partialfl.build.task.build_data`'s
  ``**d.options`` (``TypeError: 'str' object is not a mapping``); ``[model] options = "x"``
  exits 2 with Python's "dictionary update sequence element #0 has length 1; 2 is required"
  (no key named). ``[logging] wandb = 1.5`` passes the dry run (exit 0), the whole run
  trains, and only then: "partialfl: error: logging.wandb: TypeError: 'float' object is not
  iterable (the run itself is complete in runs/w)", exit 1; ``mlflow = 1.5`` is refused
  first, but as "logging: 'float' object is not iterable" (its ``__post_init__`` iterating
  it). Expected: "KEY: expected a table, got …", exit 2, before anything runs. Suspected
  root cause: :func:`partialfl.config._coerce` (no ``dict`` / ``Mapping`` origin check).

* Area 7 (a store's writer deleting what is not its own), :func:`partialfl.data.store.
  writer.clean_stale` — run by every :class:`StoreWriter` (``partialfl data convert``,
  ``reproduce femnist-table --store``) before it writes — removes every folder next to the
  store whose name starts with ``.NAME.tmp-`` or ``.NAME.old-`` and whose "writer" it does
  not find alive: no lock file, and the text between the last two dashes not the pid of a
  live process. The writer's own names are exactly ``.NAME.tmp-<pid>-<12 hex>`` /
  ``.NAME.old-<pid>-<12 hex>``, but nothing checks that shape: ``partialfl data convert
  femnist-npz … st/mystore`` deletes the user's ``st/.mystore.old-backup/`` and
  ``st/.mystore.tmp-backup/`` (with the files in them), and a ``.mystore.old-…`` folder of
  the user's holding a ``header.json`` is even MOVED into the store's place when the store
  does not exist yet (``st/.mystore.old-keep/`` becomes ``st/mystore/``, then the convert is
  refused: "st/mystore exists; pass --overwrite to replace it"). Round 60b/61b made
  :func:`partialfl.io.clean_stale_writes` match a target's temporary name exactly for this
  reason (a command cleaning files that are not its own). Expected: only folders named as
  the writer names them are touched. Suspected root cause: ``clean_stale`` (prefix match;
  ``_writer_alive``'s pid parsing treats any non-digit text as a dead writer).

Tried and held (run): every key of the run spec's tables (top level, ``[model]``,
``[data]``, ``[method]``, ``[pretrain]``, ``[personalize]`` and their ``server`` / ``stop``,
``[finetune]``, ``[validation]``, ``[finetune_grid]``, ``[asynchronous]``, ``[logging]``)
and the options of ``backend``, ``aggregation``, ``attack``, ``privacy``, ``faults``, the
client and the split given a string, list, table, bool, float, −1, NaN, inf, 10^30 and ""
(refused in one line, exit 2, or a valid value; but the keys above); ``--set`` / ``--sweep``
with empty, dotted-twice and table keys, ``--seeds`` −1 / 2^64 / repeated, ``--jobs 0``,
``--device cuda:99``; a ``processes`` backend with ``task_timeout`` 1e-9 / 5e-324 (tasks
finish before the poll: no failure), 100 000 workers (processes and threads: capped, exit
0), ``spawn`` with ``task_timeout`` 1e-300; :class:`WorkerPool` with ``start_timeout`` 1e-6
/ 1e-300 (one ``WorkerStartError``, no worker left); ``[faults]`` ``die`` at rate 1 / 0.5 on
the sequential and threads backends (exit 1 in one line / exit 0); ``data convert``
SIGKILLed at the store's swap and at the lock's removal, with and without ``--overwrite``
(the rerun restores or replaces, no temporary folder left); ``advise CFG --out`` SIGKILLed
at each of stage 1's checkpoint, θ, config and log writes and at ``advice.md`` /
``advice.json`` (the rerun finishes, nothing temporary left); a ``--seeds 0 1`` study
SIGKILLed at seed 1's ``metrics.json`` then rerun with ``--jobs 1``, other logging
(resumed), ``--seeds 0 1 2``, ``--seeds 1 0``, another ``--set``, ``--threads 2``, a
``--sweep`` (refused in one line); a train run killed at ``stage2.ckpt`` and resumed with
``checkpoint_every``, ``max_failure_fraction``, ``eval_every``, ``stages`` changed (refused)
or ``tensorboard`` / ``device`` changed (metrics equal to the uninterrupted run's), or with
``stage1`` / ``personalized`` replaced by a link out of the run (refused); ``report`` /
``compare`` / ``evaluate`` over a finished run missing each of its records
(``run_files.json``, ``preexisting.json``, ``spec.json``, ``config.json``, ``metrics.json``,
…: exit 0 or one line); files under umask 002 / 077 (``data convert``, ``advise``,
``train``); the Byzantine reproduction (``reproduce byzantine --quick``, 56 s) and its grid
with δ = 0.07, 0.049 (Krum refuses ⌊δk⌋ = 0), 1/3 and 0.26 (bucketing s·δ ≥ 0.5 refused);
``aggregation`` δ = 5e-324, 0.4999999999999 (refused), bucketed CM at s·δ just under 0.5.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _adv_cli import cli
from _user_project import TINY_MODEL, client_folder, tiny_toml

FEMNIST_NPZ = Path(os.environ.get("PARTIALFL_DATA_DIR", "/work/shared/data"),
                   "femnist_leaf_subset.npz")
needs_femnist = pytest.mark.skipif(not FEMNIST_NPZ.is_file(), reason="no FEMNIST subset")


# ----------------------------------------------------------------------------- area 8
@pytest.fixture
def project(tmp_path):
    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    tiny_toml(tmp_path / "a.toml", "usermodels:tiny", data, name="a")
    return tmp_path


def _with(project, table: str, line: str):
    text = (project / "a.toml").read_text()
    head = f"[{table}]\n"
    assert head in text
    (project / "b.toml").write_text(text.replace(head, head + line + "\n", 1))
    return cli(project, None, "run", "b.toml", "--dry-run", "--allow-code")


def test_control_a_table_valued_key_given_a_table_runs(project):
    p = _with(project, "model", "options = { width = 5 }")
    assert p.returncode == 0, p.stderr[-600:]


@pytest.mark.parametrize(("table", "line"), [
    ("model", "options = [1]"),
    ("model", "options = true"),
    ("data", "options = \"x\""),
    ("logging", "wandb = 1.5"),
], ids=["model-options-list", "model-options-bool", "data-options-str", "logging-wandb"])
def test_a_table_valued_key_of_another_type_is_one_line_and_exit_2(project, table, line):
    p = _with(project, table, line)
    key = f"{table}.{line.split(' =')[0]}"
    assert "Traceback" not in p.stderr, p.stderr[-600:]
    assert p.returncode == 2, (p.returncode, p.stderr[-600:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines


# ----------------------------------------------------------------------------- area 7
def _convert(root, *extra):
    return cli(root, None, "data", "convert", "femnist-npz", str(FEMNIST_NPZ), "st/mystore",
               "--max-clients", "2", "--no-progress", *extra)


@needs_femnist
def test_control_a_killed_writers_folders_are_cleaned(tmp_path):
    (tmp_path / "st" / ".mystore.tmp-4194302-0123456789ab").mkdir(parents=True)
    p = _convert(tmp_path)
    assert p.returncode == 0, p.stderr[-600:]
    assert sorted(x.name for x in (tmp_path / "st").iterdir()) == ["mystore"]


@needs_femnist
def test_data_convert_keeps_the_users_folders_beside_the_store(tmp_path):
    st = tmp_path / "st"
    for name in (".mystore.old-backup", ".mystore.tmp-backup"):
        (st / name).mkdir(parents=True)
        (st / name / "notes.txt").write_text("mine\n")
    p = _convert(tmp_path)
    assert p.returncode == 0, p.stderr[-600:]
    left = sorted(x.name for x in st.iterdir())
    assert left == [".mystore.old-backup", ".mystore.tmp-backup", "mystore"], left
