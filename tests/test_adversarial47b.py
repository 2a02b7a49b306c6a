"""Adversarial round 47b (issue 21 areas 1, 3, 4, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found. Each test failed on the code it was written
against (r47b at 8a349d9) because of the defect it names, and passes since the fix:
``write_node_stores`` checks every ``node-i`` folder before it writes the first, and a kept
``--work-dir`` (``flower local``, ``LocalFederation``) refuses a folder linked below it; the
app files are written atomically (a link is replaced, never followed).

Both are in the two Flower commands that write client stores and federation files outside a
run folder, which rounds 26–46 attacked only with bad counts and hosts (10, 33b):
``partialfl flower node-data CONFIG OUT`` (:func:`partialfl.flower.local.write_node_stores`)
and ``partialfl flower local CONFIG --work-dir DIR`` (:func:`partialfl.flower.local.run_local`
→ ``write_node_stores(…, DIR/node-data)`` and
:class:`partialfl.flower.deployment.LocalFederation` with ``work_dir=DIR/federation``).

* Area 8, nothing is left by a refusal: ``flower node-data`` checks each ``OUT/node-i`` only
  when it comes to write it (``StoreWriter(…, overwrite=True)`` → ``check_replaceable``). With
  a user's folder ``OUT/node-1`` (not a client store) the command is refused — one line, exit
  2, the user's folder kept — but only after ``OUT/node-0`` was written: a complete store of
  partition 0 (or, over an earlier split, partition 0 of the *new* split beside the old
  split's other nodes). ``advise`` (46b) and ``reproduce`` (45b) check before they write.
  Suspected root cause: ``write_node_stores`` does not check every ``node-i`` (replaceable:
  missing, empty or a client store, not a link) before writing the first.
* Area 8, no symlink escapes, never over a user's file: ``--work-dir DIR`` is the user's
  choice, but what ``flower local`` writes *below* it follows any link planted there:
  ``DIR/federation -> ../victim`` gets the app folder (``write_app``: ``pyproject.toml`` and
  ``README.md`` by ``Path.write_text``, over the files there), ``flwr-home/config.toml``,
  ``credentials/``, ``logs/*.log`` (opened for append) and ``superlink.db`` written into
  ``victim/``; ``DIR/node-data -> ../victim2`` gets the node stores. Seen: the user's
  ``victim/app/README.md`` replaced, exit 0, not a word. A run refuses folder links below its
  ``--out`` (41b, ``run_files.refuse_linked_folders``), a study below its ``--out`` (42b).
  Suspected root cause: ``run_local`` / ``LocalFederation.__init__`` / ``write_app`` never
  refuse links below ``work_dir`` (``refuse_linked_folders``, ``pio`` writes).

Tried and held (not tested here): area 1 — a client raising an exception that pickles and
unpickles in its worker but whose unpickling fails in the parent (``__reduce__`` keyed on the
pid) on ``ProcessBackend`` (sync rounds) and ``run_processes`` (asynchronous): a counted
failure each time, the run finishes; area 8 — ``flower node-data`` with ``OUT`` an existing
file, ``OUT/node-0`` a user's file (one line, exit 2, the file kept); ``flower local`` twice
into the same ``--work-dir`` (the second run reuses ``superlink.db`` and finishes; slower).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _adv_cli import cli as _cli
from _adv_cli import femnist_toml


def _one_line_or_ran(r) -> None:
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    if r.returncode != 0:  # refused: one line, exit 2
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-400:]


# -- area 8: a refused node-data has already written OUT/node-0 -------------------------------
def test_a_refused_node_data_writes_nothing(tmp_path, data_dir):
    (tmp_path / "c.toml").write_text(femnist_toml())
    out = tmp_path / "nodes"
    (out / "node-1").mkdir(parents=True)
    (out / "node-1" / "notes.txt").write_text("mine\n")
    r = _cli(tmp_path, data_dir, "flower", "node-data", "c.toml", "nodes", "--nodes", "2",
             "--no-progress")
    _one_line_or_ran(r)
    assert r.returncode == 2, r.stdout[-400:]  # the user's folder is not replaced
    assert (out / "node-1" / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in out.iterdir()) == ["node-1"], (
        f"a refused node-data left {sorted(p.name for p in out.iterdir())} in OUT")


# -- area 8: flower local writes through links below its --work-dir ---------------------------
@pytest.mark.timeout(200)
def test_flower_local_never_writes_through_a_link_below_its_work_dir(tmp_path, data_dir):
    pytest.importorskip("flwr")
    (tmp_path / "c.toml").write_text(femnist_toml())
    victim = tmp_path / "victim"
    (victim / "app").mkdir(parents=True)
    (victim / "app" / "README.md").write_text("mine\n")
    work = tmp_path / "work"
    work.mkdir()
    os.symlink("../victim", work / "federation")
    before = sorted(os.listdir(victim))
    r = _cli(tmp_path, data_dir, "flower", "local", "c.toml", "--nodes", "2", "--insecure",
             "--work-dir", "work", "--out", "run", "--no-progress", timeout=190)
    _one_line_or_ran(r)
    assert (victim / "app" / "README.md").read_text() == "mine\n", "the user's file replaced"
    assert sorted(os.listdir(victim)) == before, (
        f"flower local wrote {sorted(set(os.listdir(victim)) - set(before))} into victim/")
    assert Path(work / "federation").is_symlink()
