"""Adversarial round 64b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 323a8f0: the robust rules and their wrappers
under extreme finite inputs, and the client store's header, dtypes and reads). Each test
below (but the controls) failed on that code because of the defect it names, and passes
since the fix: ``aggregation.common.gram`` computes distances over ``tame(X)`` (rows beyond
1e100 times the median row's ‖·‖∞ shrunk to that size) with a scale between the largest and
the median row, so no honest difference underflows (GM and CAF combine the tamed rows); GM's
"half coincide" shortcut counts the inputs that coincide with the medoid within the Gram
matrix's precision; the store writer refuses float inputs beyond float32's range and an
``x_scale`` the readers could not open, the reader refuses such rows and computes
``x_scale``'s bound for bool inputs (``data.store.layout.x_scale_problem``); ``evaluate``
casts a deployed θ of another float dtype to the model's (``pipeline.files._check_group``).

* Area 3 (a robust rule honest about what it tolerates), the geometric median:
  ``make_aggregator("gm")`` says it tolerates ⌊(k − 1)/2⌋ Byzantine inputs (2 among 5), yet
  two Byzantine inputs among five — one ``3e38`` everywhere (finite in float32, what a
  model's update can hold), one a moderate ``1e4`` placed before the honest rows — make it
  return the ``1e4`` input itself (also 3 among 7). In
  :meth:`partialfl.aggregation.geometric_median.GeometricMedian.solve` the medoid's sums
  of distances ``D @ a`` are all ≈ the distance to the huge input, so every other row ties
  and ``argmin`` takes the first (the Byzantine ``1e4``); then the shortcut "at least half of
  the inputs coincide with the medoid" compares the medoid's median distance (~1e4) with
  ``1e-12 · max‖x_i‖`` — a threshold set by the Byzantine input itself (~3e27) — and returns
  that row without a single Weiszfeld step. Expected: a result within the honest inputs'
  range (as CM, TM, CC, Krum, MDA, CAF and SMEA give on the same inputs).
  Suspected root cause: ``GeometricMedian.solve`` (the coincidence threshold relative to the
  largest input, and the medoid's ties).

* Area 3, Krum (and MDA, CAF, SMEA) on float64 inputs beyond ~1e162: with δ = 1/3 and k = 9
  (f = 3, k ≥ 2f + 3), three Byzantine inputs ``+1e200``, ``−1e200`` and ``1e4`` make Krum
  return the ``1e4`` input (MDA/SMEA ~1666, CAF ~1428; at ``±1e160`` all hold).
  :func:`partialfl.aggregation.common.gram` divides every row by ``s = max‖x_i‖∞`` when it
  is above 1e100, so the honest rows' differences (~1/s = 1e-200) square to 0 — every honest
  pair and the ``1e4`` row look at distance 0, Krum's scores tie and the lowest index (the
  Byzantine row) wins. Expected: Krum's choice among the honest inputs. Suspected root
  cause: ``common.gram``'s single scale (underflow of the small rows' differences).

* Area 7 (the store), a store ``write_store`` writes but cannot be opened: inputs of dtype
  bool (``X_KINDS`` includes ``b``) with ``x_scale`` are written, then every open fails with
  numpy's bare ``ValueError: data type <class 'numpy.bool'> not inexact`` — not a
  :class:`~partialfl.data.store.StoreError` naming the file (the layout's promise), so a
  SuperNode's ``load_node_data`` (which turns ``StoreError``/``OSError`` into one
  ``ConfigError`` line) lets it through. :func:`partialfl.data.store.layout.read_header`'s
  ``x_scale`` overflow check calls ``np.finfo`` for every dtype that is not ``i``/``u``.
  Expected: the store opens (bool inputs times 0.5 are finite), or the writer refuses it.

* Area 7, float64 inputs beyond float32's range: a FederatedDataset with float64 inputs
  ``1e300`` (finite, accepted) is written by ``write_store``; the store opens, and every read
  (``train_x[m]``, ``flat_split(...).take``, what a model run reads minibatches through)
  returns float32 ``inf`` — no StoreError, though the reader's docstring promises float
  inputs checked finite "instead of training on NaN", and ``read_header`` refuses the same
  overflow when it comes from ``x_scale``. ``ClientStore._check_rows`` checks the float64
  rows; :meth:`StoreDataset._decode` then casts them to float32. (``to_memory`` refuses the
  same store: "non-finite values".) Expected: a StoreError (at open or at the read), never
  inf inputs. Suspected root cause: ``layout.read_header`` / ``view.StoreDataset._decode``.

* Area 8 (a bad file gives one line and exit 2), ``partialfl evaluate RUN`` on a run whose
  ``deploy.safetensors`` holds θ (here ``theta/conv1.weight``) in float64 — or float16 —
  for the float32 model (its split description intact): a ``RuntimeError: Input type (float)
  and bias type (double) should be the same`` traceback, exit 1. An int64 tensor there gives
  "theta/conv1.bias is torch.int64, the model torch.float32", exit 2.
  :func:`partialfl.pipeline.files._check_group` accepts any floating dtype for a floating
  parameter (it casts only for its finiteness check) and the loaded tensors are used
  uncast. Expected: the tensors cast to the model's dtype, or one line and exit 2.
  Suspected root cause: ``pipeline.files._check_group`` / ``deployed_split``.

Also tried and held (area 8): ``evaluate`` on a truncated ``deploy.safetensors``, a header
length of 2^62, a corrupt header JSON, NaN/inf in ``theta/``, ``w_pretrained/`` or
``model/``, a tensor of another shape, an extra or a missing tensor, global/personal names
swapped, duplicated or emptied, ``split_options`` with 10^9 layers, ``deploy.safetensors`` a
symlink to ``/etc/passwd``, a FIFO, a folder; ``compare`` on a ``metrics.json`` that is a
list or nested 10^5 deep; ``report`` on a ``stage2.jsonl`` with ``1e999`` and non-UTF-8
lines, a 10^5-deep ``stage2_train.jsonl`` line, a truncated ``stage2.ckpt``; ``evaluate
--allow-code`` with a ``source.json`` naming no config; ``train --overwrite`` over a damaged
``run_files.json`` / ``preexisting.json`` naming ``../../etc``.

Tried and held: every registered rule (caf, cc, cm, gm, krum, mda, meamed, monna with
``index=0``, multi-krum, smea, tm) with δ ∈ {0.1, 0.2, 0.25, 1/3, 0.45}, k = 1..13, bucketing
s ∈ {1, 2, 3}, ``nnm`` and ``arc`` on and off, f = ``tolerated(k)`` Byzantine rows at
±1e308/1e150 (random positions): refusals where ⌊δk⌋ < 1 or k < 2f + 1 (UnprotectedError),
ARC/NNM refused without δ, s·δ above the rule's bound refused at construction; every other
result within the honest range except the two defects above; CM/TM/Meamed/CC/Krum/MDA/CAF/
SMEA with one float32 ``3e38`` input plus ``1e4``/``1e2`` Byzantine rows; a store header
with ``train_y`` per-example shape ``[2]`` (refused by ``to_memory``; a raw ``ValueError``
through ``load_node_data`` — the node's own data), duplicate client ids (refused by
``to_memory``), a non-UTF-8 id (StoreError / ConfigError), zero-width fields with 1e15 rows
(refused: train/test shapes differ), complex and unicode meta arrays (read back).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialfl.build import make_aggregator
from partialfl.data.federated import FederatedDataset
from partialfl.data.store import StoreError, open_store, write_store


# ----------------------------------------------------------------------------- area 3
def _honest(k: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(k, d))


@pytest.mark.parametrize("rule", ["cm", "cc", "tm", "krum", "mda", "caf", "smea"])
def test_control_other_rules_hold_against_a_float32_blinder(rule):
    x = torch.from_numpy(_honest(9, 50).astype(np.float32))
    x[0], x[1], x[2] = 1e4, 3e38, -3e38
    agg = make_aggregator(rule) if rule in ("cm", "cc") else make_aggregator(rule, delta=1 / 3)
    assert agg.tolerated(9) >= 3
    assert float(agg(x, torch.ones(9)).abs().max()) < 10


@pytest.mark.parametrize("k", [5, 7])
def test_the_geometric_median_is_not_handed_to_a_byzantine_input(k):
    gm = make_aggregator("gm")
    f = gm.tolerated(k)
    assert f == (k - 1) // 2
    x = torch.from_numpy(_honest(k, 1000).astype(np.float32))
    x[0] = 1e4  # a moderate Byzantine update, first in the cohort
    x[1:f] = 3e38  # the others: finite float32, as large as it gets
    assert bool(torch.isfinite(x).all())
    out = gm(x, torch.ones(k))
    assert float(out.abs().max()) < 10  # the honest rows are N(0, 1)


@pytest.mark.parametrize("big", [1e160])
def test_control_krum_holds_against_1e160(big):
    x = _honest(9, 3)
    x[0], x[1], x[2] = big, -big, 1e4
    assert np.abs(np.asarray(make_aggregator("krum", delta=1 / 3)(x, np.ones(9)))).max() < 10


@pytest.mark.parametrize("rule", ["krum", "mda", "caf", "smea"])
def test_distance_rules_survive_huge_float64_inputs(rule):
    agg = make_aggregator(rule, delta=1 / 3)
    assert agg.tolerated(9) == 3
    x = _honest(9, 3)
    x[0], x[1], x[2] = 1e200, -1e200, 1e4  # 3 Byzantine among 9, all finite
    out = np.asarray(agg(x, np.ones(9)))
    assert np.abs(out).max() < 10


# ----------------------------------------------------------------------------- area 7
def _ds(x: tuple, y: tuple) -> FederatedDataset:
    return FederatedDataset(x, y, x, y, client_ids=tuple(f"c{i}" for i in range(len(x))),
                            num_classes=3, description="t", meta={})


def test_a_store_of_bool_inputs_with_x_scale_opens(tmp_path):
    x = tuple(torch.ones(5, 4, dtype=torch.bool) for _ in range(2))
    y = tuple(torch.zeros(5, dtype=torch.long) for _ in range(2))
    try:
        write_store(tmp_path / "s", _ds(x, y), x_scale=0.5)
    except (ValueError, StoreError):
        return  # refused when written: also fine
    try:
        ds = open_store(tmp_path / "s")
    except StoreError:
        pytest.fail("the store write_store wrote is refused")  # at least one line naming it
    assert torch.equal(ds.train_x[0], torch.full((5, 4), 0.5))


def test_control_a_float64_store_within_float32_range_reads_back(tmp_path):
    x = tuple(torch.full((5, 4), 1e30, dtype=torch.float64) for _ in range(2))
    y = tuple(torch.zeros(5, dtype=torch.long) for _ in range(2))
    write_store(tmp_path / "s", _ds(x, y))
    ds = open_store(tmp_path / "s")
    assert bool(torch.isfinite(ds.flat_split("train").take(np.arange(3))[0]).all())


def test_a_store_never_hands_out_infinite_inputs(tmp_path):
    x = tuple(torch.full((5, 4), 1e300, dtype=torch.float64) for _ in range(2))
    y = tuple(torch.zeros(5, dtype=torch.long) for _ in range(2))
    try:
        write_store(tmp_path / "s", _ds(x, y))
        ds = open_store(tmp_path / "s")
        xs = ds.flat_split("train").take(np.arange(3))[0]
    except (StoreError, ValueError):
        return  # refused (when written, opened or read): fine
    assert bool(torch.isfinite(xs).all()), "the store's rows came back as inf"


# ----------------------------------------------------------------------------- area 8
from _adv_cli import cli, femnist_toml  # noqa: E402


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir):
    """A finished FEMNIST run with two held-out writers (``evaluate`` needs them), ~4 s."""
    root = tmp_path_factory.mktemp("ev")
    (root / "r.toml").write_text(femnist_toml().replace("num_clients = 4", "num_clients = 6")
                                 .replace("holdout = 0", "holdout = 2"))
    r = cli(root, data_dir, "train", "r.toml", "--out", "run", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    return root


def _deploy_as(root, run: str, dtype) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    p = root / run / "deploy.safetensors"
    with safe_open(str(p), "pt") as f:
        md, d = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    d["theta/conv1.weight"] = d["theta/conv1.weight"].to(dtype)
    save_file(d, str(p), metadata=md)


def test_control_evaluate_of_an_int_theta_is_one_line(finished_run, data_dir):
    import shutil

    shutil.copytree(finished_run / "run", finished_run / "int")
    _deploy_as(finished_run, "int", torch.int64)
    r = cli(finished_run, data_dir, "evaluate", "int")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert "torch.int64, the model torch.float32" in r.stderr


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_evaluate_of_a_theta_in_another_float_dtype_is_one_line_or_works(
        finished_run, data_dir, dtype):
    import shutil

    name = str(dtype).split(".")[-1]
    shutil.copytree(finished_run / "run", finished_run / name)
    _deploy_as(finished_run, name, dtype)
    r = cli(finished_run, data_dir, "evaluate", name)
    assert "Traceback" not in r.stderr, r.stderr[-1500:]
    assert r.returncode in (0, 2), r.stderr[-1500:]
    if r.returncode == 2:
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_writer_refuses_an_x_scale_its_readers_could_not_open(tmp_path):
    """Found beside round 64b: float32 inputs written with ``x_scale = 2`` made a store every
    open refused ("x_scale overflows float32"); the writer now refuses it when it is given."""
    x = tuple(torch.ones(5, 4) for _ in range(2))
    y = tuple(torch.zeros(5, dtype=torch.long) for _ in range(2))
    with pytest.raises(ValueError, match="x_scale overflows float32 for <f4 inputs"):
        write_store(tmp_path / "s", _ds(x, y), x_scale=2.0)
    assert not (tmp_path / "s").exists()
    write_store(tmp_path / "ok", _ds(x, y), x_scale=0.5)  # within range: opens and reads
    assert torch.equal(open_store(tmp_path / "ok").train_x[1], torch.full((5, 4), 0.5))
