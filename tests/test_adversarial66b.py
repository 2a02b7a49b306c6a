"""Adversarial round 66b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 6e447b4: rounds 64b/65b's ``tame``, ``gram``
scale, Vardi–Zhang step and store float32 checks). Each test failed on that code because of
the defect it names, and passes since the fix: ``claim_folder`` removes its marker's killed
first write when that is all the folder holds; ``data.store.layout.x_scale_problem`` bounds
the largest |x| (a signed integer's minimum too) times ``x_scale`` with a margin for the
float32 roundings the readers make.

* Area 4, a reproduction killed (SIGKILL) during its FIRST write — the atomic write of the
  ``reproduction.json`` claim (:func:`partialfl.pipeline.run_files.claim_folder`) — leaves
  ``OUT/.reproduction.json.XXXXXXXX.tmp``, and no rerun ever removes it: ``partialfl
  reproduce ls-tau --quick --out OUT`` killed at that ``os.replace``, then the same command
  (exit 0, the reproduction finishes) leaves the temporary file beside its results for
  good. ``claim_folder`` accepts a folder holding only such a file on purpose ("a killed
  first write of the marker") but the branch that accepts it skips
  :func:`partialfl.io.clean_stale_writes`, which runs only when the folder holds something
  else (the marker of an earlier start). A kill at any later write (``results.json``,
  ``summary.md``, checked with ``reproduce faults --quick``) is cleaned by the rerun.
  ``advise --out`` claims its folder through the same function (read, not run). Suspected
  root cause: ``claim_folder`` (no ``clean_stale_writes`` when only the marker's killed
  write is there).
* Area 7, round 64b's ``x_scale`` bound is not the one the readers compute:
  :func:`partialfl.data.store.layout.x_scale_problem` accepts an ``x_scale`` when
  ``iinfo(dtype).max · x_scale ≤ F32_MAX`` in float64, but a reader returns
  ``x.to(float32) * x_scale`` (:meth:`partialfl.data.store.view` ``_decode``) — so

  - signed inputs: ``iinfo.min`` is one larger in magnitude than ``iinfo.max``: int8
    inputs of −128 with ``x_scale = F32_MAX / 127.5`` (accepted) read back as ``-inf``
    (int16 −32768 with ``F32_MAX / 32767.5`` likewise);
  - the product in float32: int8 inputs of 127 with ``x_scale = F32_MAX / 127`` exactly
    (``127 · x_scale ≤ F32_MAX`` in float64) read back as ``+inf`` (float32 rounds the
    scale and the product up; uint16 65535 with ``F32_MAX / 65535`` and float16's 65504
    likewise).

  ``write_store`` writes the store, ``open_store`` opens it, and its rows come back with
  infinite inputs — the store's own promise (the writer's "x · x_scale must stay finite")
  broken, the model then trained on ``inf``. Suspected root cause: ``x_scale_problem``
  (``iinfo.max`` instead of ``max(|min|, max)``, and no float32 margin / check of the
  float32 product).

Tried and held (run unless marked "read"): area 1 — a user's model on ``backend =
processes`` (2 workers, ``task_timeout`` 3 s) whose forward in a worker sleeps 1000 s (the
worker killed after 3 s, counted, exit 0), calls ``os._exit(7)``, SIGKILLs itself or raises
(each counted: "its worker process died (exit code 7)", "killed by SIGKILL", exit 0); the
parent SIGKILLed while a worker sleeps (no worker left; the rerun resumes, exit 0); a
``--seeds 0 1 --jobs 2`` study of that run (study job processes each holding a pool)
SIGKILLed mid-round (no descendant left, the resource tracker gone too; the rerun finishes
both seeds); an FFGG user-model run on ``processes`` with ``[faults]`` rate 0.4 of die /
raise / nan, killed at the commit of ``stage2.g1/g2.server.ckpt``, ``stage2.ckpt``,
``theta_stage2.safetensors``: every resumed ``stage2.jsonl`` (fault counts included) and
``metrics.json`` equal to the uninterrupted run's; a sequential run killed at a
checkpoint then resumed with ``backend`` processes / threads (refused in one line: the
backend is part of the run's identity). Area 4 — ``reproduce faults --quick`` killed at
``results.json`` / ``summary.md`` (the rerun cleans the temporary file, exit 0); a
closed-form ``partialfl run`` killed at ``ls.png`` / ``summary.md`` (the rerun cleans them).
Area 3 — the geometric median against a brute-force minimiser (Powell from every input, the
mean and the coordinate median): 1,200 cohorts of k = 1..8, d = 1..3, weighted and not,
rounded inputs (exact ties), duplicates, collinear, half coinciding, integer grids, scales
10^±200, weights 10^±5: objective within 2e-13 relative at ``max_iter`` 2000 (tiny
``max_iter`` warns, as documented); a weighted cohort whose medoid is a light coincident
triple (median distance 0, so ν = 0): the true minimiser; k = 2001 / 20000 in d = 1 (the
median; 20000 takes 30 s and O(k²) memory — by design).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _adv_cli import cli, killed

from partialfl.data.federated import FederatedDataset
from partialfl.data.store import StoreError, open_store, write_store

F32_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- area 4
def test_a_reproduction_killed_at_its_claim_leaves_no_temporary_file_after_the_rerun(
        tmp_path):
    p = killed(tmp_path, None, "replace", "out/reproduction.json", "reproduce", "ls-tau",
               "--quick", "--out", "out", "--no-progress")
    assert p.returncode == -9, p.stderr[-600:]
    left = sorted(x.name for x in (tmp_path / "out").iterdir())
    assert len(left) == 1 and left[0].startswith(".reproduction.json."), left
    p = cli(tmp_path, None, "reproduce", "ls-tau", "--quick", "--out", "out", "--no-progress")
    assert p.returncode == 0, p.stderr[-600:]
    names = sorted(x.name for x in (tmp_path / "out").iterdir())
    assert "summary.md" in names and "reproduction.json" in names
    assert not [n for n in names if n.endswith(".tmp")], names


# ----------------------------------------------------------------------------- area 7
def _ds(x: tuple, y: tuple) -> FederatedDataset:
    return FederatedDataset(x, y, x, y, client_ids=tuple(f"c{i}" for i in range(len(x))),
                            num_classes=3, description="t", meta={})


@pytest.mark.parametrize(("dtype", "value", "x_scale"), [
    (torch.int8, -128, F32_MAX / 127.5),   # |iinfo.min| > iinfo.max
    (torch.int16, -32768, F32_MAX / 32767.5),
    (torch.int8, 127, F32_MAX / 127),      # the float32 product rounds up to inf
], ids=["int8-min", "int16-min", "int8-max-float32"])
def test_a_store_whose_x_scale_is_accepted_reads_back_finite_inputs(tmp_path, dtype, value,
                                                                     x_scale):
    x = tuple(torch.full((5, 4), value, dtype=dtype) for _ in range(2))
    y = tuple(torch.zeros(5, dtype=torch.long) for _ in range(2))
    try:
        write_store(tmp_path / "s", _ds(x, y), x_scale=x_scale)
    except (ValueError, StoreError):
        return  # refused when written: fine
    try:
        ds = open_store(tmp_path / "s")
    except StoreError:
        return  # refused in one line when opened: fine too
    assert bool(torch.isfinite(ds.train_x[0]).all()), ds.train_x[0][0]
    assert bool(torch.isfinite(ds.flat_split("train").take(np.arange(3))[0]).all())


def test_control_a_uint8_store_scaled_by_one_over_255_reads_back(tmp_path):
    x = tuple(torch.full((5, 4), 255, dtype=torch.uint8) for _ in range(2))
    y = tuple(torch.zeros(5, dtype=torch.long) for _ in range(2))
    write_store(tmp_path / "s", _ds(x, y), x_scale=1 / 255)
    ds = open_store(tmp_path / "s")
    assert torch.allclose(ds.train_x[0], torch.ones(5, 4))
