"""Adversarial round 68b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 3af7a6d: round 67b's ``clean_stale`` matching a
writer's names exactly and ``config._coerce`` for ``dict[...]`` keys, then wide —
concurrent store writers, reproductions rerun into their own folder with other options).
Each test below (but the controls) failed on that code because of the defect it names, and
passes since the fix: a store writer removes its lock file while it still holds the lock
(``StoreWriter._swap``: a writer starting in between then asks whether its process lives); a
reproduction records the options that decide its result files in ``reproduction.json`` and a
rerun under other options is refused in one line (``run_files.claim_folder``, ``cli.catalog``).

* Area 7 (a store writer deleting what is not a dead writer's), two writers into the same
  destination at once: :meth:`partialfl.data.store.writer.StoreWriter._swap` first RELEASES
  its flock (``_unlock``: the lock file's descriptor closed) and only then unlinks the lock
  file. A second writer starting in between (any ``StoreWriter`` / ``write_store`` /
  ``partialfl data convert`` into the same path) runs :func:`clean_stale`, whose
  ``_writer_alive`` finds the lock file present and free (its flock succeeds), so takes the
  first writer for dead and ``rmtree``s its complete temporary store — the first writer then
  ends in ``FileNotFoundError: [Errno 2] No such file or directory: 'st/.s.tmp-PID-HEX' ->
  'st/s'`` (exit 1, its store lost) although it was alive and finished. The module
  docstring promises that the lock lets the next writer "tell a dead writer's leftovers …
  from a live one" and ``clean_stale`` that "live writers' folders are kept". Reproduced
  deterministically by widening the window (the first writer sleeps at its lock's unlink).
  Expected: both writers finish (with ``overwrite``), the last swap's store in place.
  Suspected root cause: ``StoreWriter._swap`` (unlock before unlink; unlinking the lock
  while still holding it — then ``_writer_alive`` falls back to the live pid — closes the
  window) / ``_writer_alive``.

* Area 4/8 (a reproduction's folder holding another invocation's results), ``partialfl
  reproduce ls-tau --quick --out OUT`` then ``partialfl reproduce ls-tau --quick --seeds 3 4
  --out OUT``: :func:`partialfl.pipeline.run_files.claim_folder` accepts the folder (its
  ``reproduction.json`` names the owner ``reproduce ls-tau`` only, not the options — the
  README's "or its own, to resume"), the rerun writes ``ffgg-tau*-seed3/4.jsonl`` and a
  ``summary.md`` of seeds 3 and 4, and leaves the first run's ``ffgg-tau1.jsonl`` …
  ``ffgg-tau40.jsonl`` (seed 0) beside them, exit 0: the folder mixes two runs and nothing
  says which file is whose (the same with ``--seeds 0 1 2`` then ``--seeds 0 1``, and the
  default run then ``--seeds 0``: the same seed twice under two names). The byzantine and
  async reproductions delete their own earlier JSONL for this reason (``reproduce_byzantine``
  "start clean"); a train run or a study refuses a rerun with another spec. Expected: the
  rerun with other options refused in one line (exit 2, the folder unchanged), or the earlier
  invocation's results removed. Suspected root cause: ``claim_folder`` / the ``reproduction``
  marker recording no options, and ``least_squares`` (``run_name``) not cleaning.

Tried and held (run): ``clean_stale`` with store names holding regex metacharacters
(``a.b``, ``[x]+``, ``s-1``, ``a(b)|c``, ``x.tmp-1``, ``ü*?``) beside a dead writer's folder
and user folders named like a writer's (``.NAME.tmp-backup``, ``.NAMEx.tmp-PID-HEX``, a
prefix of NAME, ``.NAME.old-1-<13 hex>``): only the dead writer's own folder removed; a
writer killed (SIGKILL) right after moving the old store aside (the next writer without
overwrite restores it and refuses, with overwrite replaces it; a reader in between says "no
client store", the documented killed-between-renames case); ``--set`` on the ``dict[...]``
keys (``model.options`` / ``data.options`` / ``logging.wandb`` / ``mlflow`` = 1, [1], "x",
1.5, ``{}``, dotted into the table, empty segment): one line, or accepted;
``logging.wandb = {}`` without the wandb package (the run trains, then one line, exit 2 —
as docs/study.md documents for a tracker's failure); a closed-form run on ``processes``
(2 workers) with ``[faults]`` die at 0.3, synchronous and asynchronous, and at rate 1
(deaths counted, exit 0 / one-line error, no worker left); 400 random cohorts (k = 3..15,
d = 1..5, δ ∈ {0.1 … 0.45}, bucketing 0 / 2, weighted or not) of every robust rule with
f = ⌊δk⌋ rows at 10^6 … 10^30: every output finite within 10× the honest rows' scale or the
setting refused (``UnprotectedError``); ``reproduce ls-tau --quick`` rerun with the same
options into its folder (the control below); a three-stage FEMNIST ``train`` (checkpoint
every round) SIGKILLed at the writes of ``personalized/clients/000002.safetensors``,
``personalized/index.json``, ``deploy.safetensors``, ``stage1/theta.safetensors``,
``metrics.json``, the final ``run_files.json`` and the unlink of ``stage2.g2.server.ckpt``:
each rerun exit 0 with metrics equal to the uninterrupted run's, or "holds a finished run"
(then ``--overwrite`` replaces it, ``report`` / ``compare`` exit 0), nothing temporary left.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _adv_cli import cli, env

from partialfl.data.store import open_store

_WRITER = """\
import os, sys, time
from pathlib import Path
import numpy as np
import partialfl.data.store.writer as W
if sys.argv[3] == "slow":  # widen the instant between the lock's release and its unlink
    real = os.unlink
    def hooked(p, *a, **k):
        if str(p).endswith(W.LOCK):
            Path(sys.argv[2]).write_text("x")
            time.sleep(4)
        return real(p, *a, **k)
    W.os.unlink = hooked
v = float(sys.argv[4])
with W.StoreWriter(sys.argv[1], num_classes=3, overwrite=True) as w:
    w.add(sys.argv[3], np.full((4, 2), v, np.float32), np.zeros(4, np.int64),
          np.full((2, 2), v, np.float32), np.zeros(2, np.int64))
"""


def test_a_live_writer_releasing_its_lock_keeps_its_temporary_store(tmp_path):
    (tmp_path / "w.py").write_text(_WRITER)
    (tmp_path / "st").mkdir()
    mark = tmp_path / "mark"
    run = [sys.executable, str(tmp_path / "w.py"), "st/s", str(mark)]
    a = subprocess.Popen([*run, "slow", "1"], cwd=tmp_path, env=env(None),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not mark.exists():
            assert a.poll() is None and time.monotonic() - t0 < 60, a.communicate()
            time.sleep(0.05)
        b = subprocess.run([*run, "fast", "2"], cwd=tmp_path, env=env(None),
                           capture_output=True, text=True, timeout=60)
        assert b.returncode == 0, b.stderr[-600:]
        _, err = a.communicate(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
    assert a.returncode == 0, err[-400:]  # the first writer was alive: its store survives
    assert list(open_store(tmp_path / "st" / "s").client_ids) == ["slow"]
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["s"]


def test_control_two_writers_one_after_the_other(tmp_path):
    (tmp_path / "w.py").write_text(_WRITER)
    (tmp_path / "st").mkdir()
    for who in ("fast", "other"):
        p = subprocess.run([sys.executable, "w.py", "st/s", "m", who, "1"], cwd=tmp_path,
                           env=env(None), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr[-600:]
    assert list(open_store(tmp_path / "st" / "s").client_ids) == ["other"]


def _jsonl(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.suffix == ".jsonl")


@pytest.mark.slow
def test_a_reproduction_rerun_with_other_seeds_leaves_no_earlier_results(tmp_path):
    p = cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--no-progress", "--out", "o")
    assert p.returncode == 0, p.stderr[-600:]
    first = _jsonl(tmp_path / "o")
    assert "ffgg-tau1.jsonl" in first
    p = cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--no-progress", "--seeds",
            "3", "4", "--out", "o")
    if p.returncode == 2:  # refused: one line, the folder unchanged
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert _jsonl(tmp_path / "o") == first
        return
    assert p.returncode == 0, p.stderr[-600:]
    now = _jsonl(tmp_path / "o")
    assert all("-seed3" in n or "-seed4" in n for n in now), now


@pytest.mark.slow
def test_control_a_reproduction_rerun_with_the_same_options(tmp_path):
    for _ in range(2):
        p = cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--no-progress", "--seeds",
                "3", "--out", "o")
        assert p.returncode == 0, p.stderr[-600:]
    assert all("-seed3" in n for n in _jsonl(tmp_path / "o"))
