"""``benchmarks/peers.py`` on partialfl's own modes (no peer installed): the cohort file, the
runner protocol, the checks and the last line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from partialfl.data.paths import default_data_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.data
def test_peers_script_runs_partialfl_modes_and_checks_them(tmp_path):
    d = default_data_dir()
    if d is None or not (d / "femnist_leaf_subset.npz").exists():
        pytest.skip("FEMNIST not found (set PARTIALFL_DATA_DIR to ../shared/data)")
    env = {**os.environ, "PARTIALFL_DATA_DIR": str(d),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--modes",
         "partialfl/sequential", "partialfl/threads", "partialfl/threads+cl", "blazefl/threads",
         "--algorithms",
         "fedavg", "--repeats", "1", "--peers-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in out.stdout.splitlines()
            if ln.startswith(("partialfl/", "blazefl/"))}
    for m in ("partialfl/sequential", "partialfl/threads"):
        assert rows[m].split()[5] == "1505" and "ok (rel 0e+00)" in rows[m], rows[m]
    # channels-last: the same round to float rounding (checked against contiguous sequential)
    assert rows["partialfl/threads+cl"].split()[5] == "1505"
    assert " ok (rel " in rows["partialfl/threads+cl"], rows["partialfl/threads+cl"]
    assert "skipped" in rows["blazefl/threads"]
    assert out.stdout.strip().splitlines()[-1] == (
        "partialfl best mode vs best peer mode: n/a (no peer mode ran)")
    assert (tmp_path / "cache" / "femnist-cohort-fedavg.npz").exists()


def test_unknown_modes_are_refused():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--modes",
                          "nope"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "unknown mode 'nope'; allowed:" in out.stderr
