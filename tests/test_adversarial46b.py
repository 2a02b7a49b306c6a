"""Adversarial round 46b (issue 21 areas 1, 3, 4, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found. Each test failed on the code it was written
against (r46b at cac5ff1) because of the defect it names, and passes since the fix:
``run_advisor`` checks its options before it writes, then claims ``--out`` like a
reproduction (:func:`partialfl.pipeline.run_files.claim_folder`: new, empty or its own
``advisor.json``; linked folders refused; stale temporary files removed).
All four are in ``partialfl advise`` (:mod:`partialfl.reproductions.advise`:
``_cmd`` → ``run_advisor``), a command with an ``--out`` folder that rounds 26–45 never
attacked: it writes ``advice.md``, ``advice.json`` and (without ``--theta``) a stage-1
pre-training in ``OUT/stage1`` with none of the guards the other writing commands got
(``record_start`` / ``refuse_users_entries`` / ``claim_folder`` of 44b–45b,
``refuse_linked_folders`` of 41b, ``clean_stale_writes``).

* Area 8, a command writes over the user's own file: ``partialfl advise har
  --pretrain-rounds 0 --out u`` into a folder holding the user's ``advice.md`` and
  ``advice.json`` replaces both with its own (exit 0, not a word). ``partialfl reproduce``
  claims its ``--out`` (new, empty or its own: ``claim_folder``), a closed-form run refuses a
  user's entry named like one it writes (``refuse_users_entries``), a train run likewise
  (``record_start``); ``advise`` does none of it (``run_advisor`` goes
  ``out_dir.mkdir(exist_ok=True)`` → ``pio.write_text``). ``--out`` of a finished train run
  also gets its ``stage1/config.json`` replaced by the advisor's pre-training.
* Area 8, no symlink escapes: ``OUT/stage1 -> ../victim`` planted in a received or shared
  folder: ``advise --pretrain-rounds 0 --out OUT`` writes the whole stage-1 pre-training
  (``theta.safetensors``, ``config.json``, ``stage1.jsonl``, ``timing.json``, …) into
  ``victim/``, outside ``OUT``, exit 0. A train run refuses such a link
  (``refuse_linked_folders``, called by ``run_built`` / ``run_flower_train`` and since 45b
  by ``run_flower_closed_form``). Suspected root cause: ``run_advisor`` (no
  ``refuse_linked_folders(out_dir)`` before ``pretrain(..., out_dir / "stage1", ...)``).
* Area 4, stale temporary files: ``advise ... --out k`` killed (SIGKILL) at the commit of
  ``k/advice.md`` leaves ``k/.advice.md.XXXXXXXX.tmp``; the same command run again finishes
  (exit 0) and keeps it for good — round 45b's defect of ``reproduce``, in the command that
  did not get its fix. Suspected root cause: ``run_advisor`` never calls
  :func:`partialfl.io.clean_stale_writes` on its folder.
* Area 8 (minor), a refused command leaves nothing behind: ``partialfl advise nonsense
  --out o`` is refused (one line, exit 2: "unknown task") but first creates the empty folder
  ``o`` (by default ``runs/advise-nonsense``); ``--pretrain-rounds 0 --clients 0`` even runs
  and writes the whole pre-training into ``o/stage1`` before refusing ``--clients``.
  ``reproduce`` removes its folder when refused before it wrote anything (``cli.catalog``).
  Suspected root cause: ``run_advisor`` makes ``out_dir`` before ``build_task`` and checks
  ``clients`` only in :func:`partialfl.advisor.advise`, after the pre-training.

Tried and held (not tested here): area 1 — (read) ``WorkerPool`` / ``ProcessBackend`` with
``max_respawns`` used up mid-round (the retired worker's unstarted clients given back and
taken over by the live workers through ``Schedule.take``; all retired → ``WorkerError``, pool
closed, a new pool next round), ``ready`` events of a restarted worker inside a round, a
client raising ``SystemExit`` / ``BaseException`` in a worker (a death, detected by EOF),
an exception that does not pickle (``_portable`` → None, its text travels), a result that
does not pack (an ``error`` event), the task timer of a second queued task (restarted when
the first result is read); area 3 — (read) ``inner_delta`` of bucketing chains (δ/s, the
smallest along the chain), ``tolerated`` of bucketing (⌈k/s⌉ bucket means, each Byzantine
client spoils one), NNM/ARC around the mean (tolerance None, warned by BR-FFGG ``init``),
``ByzantineRobust._protection`` with a first round that lost clients (the plan is the first
round's replies: a larger later cohort gets more protection, not less), the planned f kept
inside ``cohort_checked``; area 4 — (read) ``Checkpoint.save`` / ``clean``
(generations, temp names, an unreadable pointer removes nothing); area 8 — ``advise`` with
an unknown task, ``--clients`` 0 / −3, ``--pretrain-rounds`` −1, ``--theta`` missing /
truncated / a folder, ``--table`` missing / not JSON / without results, ``--section`` not
found, ``--out`` an existing file (one line, exit 2 each); ``--clients`` 10²⁰ (clamped to the
clients there are, a run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _adv_cli import cli as _cli
from _adv_cli import killed

_ADVISE = ("advise", "har", "--pretrain-rounds", "0", "--clients", "2", "--no-progress")


def _one_line_or_ran(r) -> None:
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    if r.returncode != 0:  # refused: one line, exit 2
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-400:]


# -- area 8: advise writes over the user's advice.md / advice.json ---------------------------
def test_advise_never_writes_over_the_users_advice(tmp_path, data_dir):
    u = tmp_path / "u"
    u.mkdir()
    (u / "advice.md").write_text("my own notes\n")
    (u / "advice.json").write_text('{"mine": 1}\n')
    r = _cli(tmp_path, data_dir, *_ADVISE, "--out", "u")
    _one_line_or_ran(r)
    assert (u / "advice.md").read_text() == "my own notes\n", \
        f"exit {r.returncode}: the user's advice.md was replaced by the advisor's"
    assert (u / "advice.json").read_text() == '{"mine": 1}\n'


# -- area 8: advise writes its stage-1 pre-training through a planted link -------------------
def test_advise_refuses_a_linked_stage1_folder(tmp_path, data_dir):
    victim = tmp_path / "victim"
    victim.mkdir()
    u = tmp_path / "u"
    u.mkdir()
    (u / "stage1").symlink_to("../victim")
    r = _cli(tmp_path, data_dir, *_ADVISE, "--out", "u")
    _one_line_or_ran(r)
    written = sorted(p.name for p in victim.iterdir())
    assert not written, f"exit {r.returncode}: written outside --out through the link: {written}"


# -- area 4: a killed advise's temporary file is never cleaned -------------------------------
def test_advise_cleans_the_temporary_file_of_a_killed_write(tmp_path, data_dir):
    r = killed(tmp_path, data_dir, "replace", "/k/advice.md", *_ADVISE, "--out", "k")
    assert r.returncode == -9, (r.returncode, r.stderr[-400:])
    assert list((tmp_path / "k").glob(".advice.md.*.tmp"))  # the killed write's
    r = _cli(tmp_path, data_dir, *_ADVISE, "--out", "k")
    assert r.returncode == 0, r.stderr[-400:]
    assert (tmp_path / "k" / "advice.md").is_file()
    left = sorted(p.name for p in Path(tmp_path / "k").rglob(".*.tmp"))
    assert not left, f"stale temporary files kept for good: {left}"


# -- area 8 (minor): a refused advise leaves its folder behind -------------------------------
@pytest.mark.parametrize("args", [("advise", "nonsense", "--no-progress"),
                                  (*_ADVISE, "--clients", "0")], ids=["task", "clients"])
def test_refused_advise_leaves_nothing_behind(tmp_path, data_dir, args):
    r = _cli(tmp_path, data_dir, *args, "--out", "o")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-400:]
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "o").rglob("*")) \
        if (tmp_path / "o").exists() else []
    assert not (tmp_path / "o").exists(), f"refused, yet left behind: o/ {left}"
