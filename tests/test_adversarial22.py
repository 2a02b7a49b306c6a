"""Adversarial round 22 (issue 21, tried again from scratch): defects still present.

Each test fails on the current code because of the defect it names (hence ``xfail(strict)``)
and passes once the defect is fixed."""

from __future__ import annotations

import os
import subprocess
import sys

_TINY = ('name = "t"\nstages = ["personalize"]\nbackend = "sequential"\n'
         '[model]\nname = "emnist_cnn"\n[data]\nsource = "femnist"\nnum_clients = 2\n'
         'holdout = 0\n[method]\nalgorithm = "ffgg"\nsplit = "output"\n'
         '[personalize]\nrounds = 1\nclients_per_round = 2\neval_every = 1\n'
         'client = { lr = 0.01, epochs = 1, batch_size = 32 }\n'
         '[logging]\ntensorboard = false\nprogress = false\n')

#: runs `partialfl train` with os.replace ending the process (as kill -9) at its N-th call
_KILL_AT = """
import os, sys
n, calls, real = int(sys.argv[1]), [0], os.replace
def replace(*a, **k):
    calls[0] += 1
    if calls[0] == n:
        os._exit(9)
    return real(*a, **k)
os.replace = replace
from partialfl.cli import main
sys.exit(main(sys.argv[2:]))
"""


# -- area 4: a kill during the first write of a run leaves a temp file for good -------------
def test_a_run_killed_during_its_first_write_leaves_no_temp_file_after_resuming(tmp_path,
                                                                                 data_dir):
    """``partialfl train`` killed (``os._exit`` at its first ``os.replace``, i.e. during the
    atomic write of ``spec.json``, the first file of a run) leaves ``.spec.json.<8>.tmp`` in
    the run folder; running the same command again trains to the end (exit 0) but the temp
    file is still there afterwards (found by a kill loop over the 41 renames of a 3-stage
    FedAlt run: every other instant resumed bit-identically and clean). Root cause:
    cli/run.py ``_clean_interrupted`` removes stale writes only when the folder already holds
    ``spec.json``, ``<name>.jsonl`` or ``study.json`` — which the killed write never
    committed. Expected: no ``*.tmp`` left in the folder after the resumed run."""
    from partialfl.cli import main

    spec = tmp_path / "tiny.toml"
    spec.write_text(_TINY)
    out = tmp_path / "out"
    env = {**os.environ, "PARTIALFL_DATA_DIR": str(data_dir)}
    killed = subprocess.run([sys.executable, "-c", _KILL_AT, "1", "train", str(spec), "--out",
                             str(out), "--no-progress"], env=env, capture_output=True,
                            timeout=120)
    assert killed.returncode == 9  # ended inside the first atomic write
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # what a kill leaves
    assert main(["train", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert (out / "metrics.json").is_file()
    assert sorted(p.name for p in out.rglob("*.tmp")) == []
