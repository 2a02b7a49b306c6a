"""Adversarial round 69b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by someone
who did not write the fixes, against 8e425b0: round 68b's ``StoreWriter._swap`` unlinking its
lock file before releasing the lock and ``claim_folder`` recording a reproduction's options,
then wide). Each test below (but the controls) failed on that code because of the defect it
names, and passes since the fix: a writer whose lock file was removed after another opened it
(it is swapping its store in) is asked for its process instead of being taken for dead
(``store.writer._writer_alive``: ``st_nlink == 0``); a reproduction folder whose marker
records no options (an earlier version's) is refused for a rerun under given options
(``run_files.claim_folder``).

* Area 7 (a store writer deleting what is not a dead writer's), two writers into the same
  destination at once: :func:`partialfl.data.store.writer._writer_alive` opens the lock file
  of a writer's temporary folder, then tries its ``flock``. If the live writer unlinks the
  lock file and releases the lock (``StoreWriter._swap``, since 68b in that order) between
  that ``open`` and that ``flock``, the ``flock`` succeeds on the now unlinked inode, the
  writer is taken for dead and :func:`clean_stale` ``rmtree``s its complete temporary
  store; the live writer then ends in ``FileNotFoundError: … '.s.tmp-PID-HEX' -> 's'``
  (its store lost). The classic lock-file-unlink race: the window is the few instructions
  between the other writer's ``open`` and ``flock`` and is widened here deterministically
  (the second writer's ``flock`` waits until the first has released). Expected: the live
  writer finishes, its store in place. Suspected root cause: ``_writer_alive`` not checking,
  once it holds the lock, that the file it locked is still the folder's lock file
  (``os.fstat(fd).st_nlink == 0`` or a changed inode → fall back to the pid).

* Area 4/8 (a reproduction's folder holding another invocation's results), a folder made by
  a version before 68b (``reproduction.json`` = ``{"owner": "reproduce ls-tau"}``, no
  ``options``) holding seeds 0 and 1, then ``partialfl reproduce ls-tau --quick --seeds 5
  --out OUT``: :func:`partialfl.pipeline.run_files.claim_folder` reads the missing options
  as equal to the new ones (``held.get("options", options)``), the rerun exits 0 and leaves
  ``ffgg-tau*-seed0/1.jsonl`` beside the new ``-seed5`` files under a ``summary.md`` of
  seed 5 only — the mix 68b meant to refuse — and rewrites the marker with ``seeds: [5]``,
  so that nothing later can tell. Expected: a marker whose options are unknown refused like
  other options (one line, exit 2, the folder unchanged), or the earlier results removed.
  Suspected root cause: ``claim_folder``'s default for a marker without ``options``.

Tried and held (run): ``reproduce ls-tau --quick --seeds 0 1`` rerun as ``--seeds 1 0``
(refused in one line: conservative, not a defect), duplicate seeds (refused before the
claim), a damaged marker (``options: null``; 100 000-deep nested JSON; a folder named
``reproduction.json``): one line, exit 2.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from _adv_cli import cli

import partialfl.data.store.writer as W
from partialfl.data.store import open_store


def _client(w: W.StoreWriter, cid: str) -> None:
    w.add(cid, np.ones((4, 2), np.float32), np.zeros(4, np.int64),
          np.ones((2, 2), np.float32), np.zeros(2, np.int64))


def test_a_writer_releasing_its_lock_between_the_others_open_and_flock_keeps_its_store(
        tmp_path, monkeypatch):
    path = tmp_path / "s"
    a = W.StoreWriter(path, num_classes=3)
    _client(a, "a")
    opened, released, cleaned = threading.Event(), threading.Event(), threading.Event()
    real_flock = W.fcntl.flock

    class _Fcntl:  # the second writer's flock comes just after the first writer's release
        LOCK_EX, LOCK_NB = W.fcntl.LOCK_EX, W.fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            if threading.current_thread().name == "second-writer":
                opened.set()
                released.wait(10)
            return real_flock(fd, op)

    monkeypatch.setattr(W, "fcntl", _Fcntl)
    real_unlock = a._unlock

    def unlock():
        real_unlock()
        if threading.current_thread() is threading.main_thread() and not released.is_set():
            released.set()
            cleaned.wait(10)

    a._unlock = unlock
    removed = []

    def second():  # what another writer into the same path runs first
        try:
            removed.extend(W.clean_stale(path))
        finally:
            cleaned.set()

    t = threading.Thread(target=second, name="second-writer")
    t.start()
    assert opened.wait(10)
    try:
        a.close()
    finally:
        released.set()
        t.join(20)
    assert removed == []  # the first writer was alive
    assert list(open_store(path).client_ids) == ["a"]


def _jsonl(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.suffix == ".jsonl")


@pytest.mark.slow
def test_an_older_reproduction_folder_rerun_with_other_seeds_is_not_mixed(tmp_path):
    p = cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--no-progress", "--seeds",
            "0", "1", "--out", "o")
    assert p.returncode == 0, p.stderr[-600:]
    # what versions before 68b wrote: the owner only
    (tmp_path / "o" / "reproduction.json").write_text(json.dumps({"owner": "reproduce ls-tau"}))
    first = _jsonl(tmp_path / "o")
    p = cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--no-progress", "--seeds",
            "5", "--out", "o")
    if p.returncode == 2:  # refused: one line, the folder unchanged
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert _jsonl(tmp_path / "o") == first
        return
    assert p.returncode == 0, p.stderr[-600:]
    now = _jsonl(tmp_path / "o")
    assert all("-seed5" in n for n in now), now


def test_control_one_writer_then_clean_stale(tmp_path):
    path = tmp_path / "s"
    with W.StoreWriter(path, num_classes=3) as w:
        _client(w, "a")
        assert W.clean_stale(path) == []  # a live writer's folder is kept
    assert list(open_store(path).client_ids) == ["a"]
