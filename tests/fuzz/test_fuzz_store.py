"""Fuzzing the client store (issue 21): random corruptions of a small store's ``header.json``,
data files and sidecar — byte flips, truncation and extension, hostile but self-consistent
headers (paths, dtypes, shapes, sizes), hostile data under a re-signed header — either open and
read correctly or raise :class:`StoreError` (the CLI's one-line error); never another
exception, a hang, a NaN or an out-of-range label."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from partialfl.data.federated import FederatedDataset  # noqa: E402
from partialfl.data.store import StoreError, open_store, write_store  # noqa: E402
from partialfl.data.store import verify as sv  # noqa: E402
from partialfl.data.store.layout import header_crc  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# PARTIALFL_FUZZ_EXAMPLES=5000 for a deeper local run (default 100 per test: ~8 s of CPU in all)
FUZZ = settings(max_examples=int(os.environ.get("PARTIALFL_FUZZ_EXAMPLES", 100)), deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow])
FILES = ("header.json", "train_x.bin", "train_y.bin", "test_x.bin", "test_y.bin",
         "train_offsets.bin", "test_offsets.bin", "client_ids.bin", "meta_0.bin")


def _dataset() -> FederatedDataset:
    rng = np.random.default_rng(0)
    sizes, tests = [3, 0, 5, 2], [1, 2, 0, 1]
    tx = [torch.from_numpy(rng.standard_normal((n, 2, 3)).astype(np.float32)) for n in sizes]
    ty = [torch.from_numpy(rng.integers(0, 4, n)) for n in sizes]
    vx = [torch.from_numpy(rng.standard_normal((n, 2, 3)).astype(np.float32)) for n in tests]
    vy = [torch.from_numpy(rng.integers(0, 4, n)) for n in tests]
    return FederatedDataset(tx, ty, vx, vy, ["a", "bé", "c", "dd"], 4, "fuzz",
                            {"mean": np.arange(3.0), "k": 1})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    path = write_store(root / "base", _dataset())
    return path, _read(path)


class _Copy:
    """A fresh copy of the base store, removed afterwards."""

    def __init__(self, base: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(dir=base.parent))
        self.path = self.dir / "s"
        shutil.copytree(base, self.path)

    def __enter__(self) -> Path:
        sv.forget()
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _read(path: Path):
    """Open and read everything (ids, every client's tensors, flat rows, meta); None when
    the store is refused with a StoreError. Any other exception fails the test."""
    try:
        ds = open_store(path)
        mem = ds.to_memory()
        for split in ("train", "test"):
            fs = ds.flat_split(split)
            rows = np.arange(int(fs.sizes.sum()))
            if rows.size:
                fs.take(rows)
    except StoreError as e:
        assert "\n" not in str(e)
        return None
    for f in ("train_x", "test_x"):
        for x in getattr(mem, f):
            assert not x.is_floating_point() or bool(torch.isfinite(x).all()), "silent NaN"
    for f in ("train_y", "test_y"):
        for y in getattr(mem, f):
            assert y.numel() == 0 or (int(y.min()) >= 0 and int(y.max()) < mem.num_classes)
    for s in ("train", "test"):
        xs, ys = getattr(mem, f"{s}_x"), getattr(mem, f"{s}_y")
        assert all(x.shape[0] == y.shape[0] for x, y in zip(xs, ys))
    return mem


def _same(a, b) -> bool:
    if list(a.client_ids) != list(b.client_ids) or a.num_classes != b.num_classes:
        return False
    for f in ("train_x", "train_y", "test_x", "test_y"):
        for u, v in zip(getattr(a, f), getattr(b, f)):
            if u.dtype != v.dtype or u.shape != v.shape or not torch.equal(u, v):
                return False
    return set(a.meta) == set(b.meta) and np.array_equal(a.meta["mean"], b.meta["mean"])


def _resign(path: Path, h: dict) -> None:
    h["header_crc32"] = header_crc(h)
    (path / "header.json").write_text(json.dumps(h))


# ----------------------------------------------------------------------------- corruption
@FUZZ
@given(name=st.sampled_from(FILES), pos=st.floats(0, 1, exclude_max=True),
       mask=st.integers(1, 255))
def test_a_flipped_byte_is_refused_or_harmless(base, name, pos, mask):
    with _Copy(base[0]) as path:
        raw = bytearray((path / name).read_bytes())
        raw[int(pos * len(raw))] ^= mask
        (path / name).write_bytes(bytes(raw))
        got = _read(path)
        assert got is None or _same(got, base[1])  # e.g. a flip inside JSON whitespace


@FUZZ
@given(name=st.sampled_from(FILES), cut=st.floats(0, 1, exclude_max=True),
       extra=st.binary(max_size=16))
def test_a_resized_file_is_refused_or_harmless(base, name, cut, extra):
    with _Copy(base[0]) as path:
        raw = (path / name).read_bytes()
        (path / name).write_bytes(raw[:int(cut * len(raw))] + extra)
        got = _read(path)
        assert got is None or _same(got, base[1])


# ----------------------------------------------------------------------------- hostile headers
_DTYPES = ["<f4", "<f8", "|u1", "<i8", "<i2", "|O", ">f4", "|V8", "<U3", "|S0", "|S3",
           "<M8[s]", "(2,)<i4", "<c8", "|b1", "f2", "i4,i4", "float32", "S", "U"]
_PATHS = ["../secret.bin", "/etc/hostname", "train_x.bin", "header.json", ".verified.json",
          "a/b", "..", "", "meta_0.bin", "client_ids.bin", "x" * 300]
_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 40)
         | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
         | st.sampled_from(_DTYPES + _PATHS))
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=4)
                     | st.dictionaries(st.text(max_size=8) | st.sampled_from(_PATHS), c,
                                       max_size=4), max_leaves=8)


def _paths(h, prefix=()):
    if isinstance(h, dict):
        for k, v in h.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(h, list):
        for i, v in enumerate(h):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


@FUZZ
@given(data=st.data())
def test_a_hostile_self_consistent_header_is_refused_or_readable(base, data):
    with _Copy(base[0]) as path:
        h = json.loads((path / "header.json").read_text())
        where = data.draw(st.sampled_from(sorted(_paths(h), key=str)))
        action = data.draw(st.sampled_from(["set", "delete", "add"]))
        parent = h
        for k in where[:-1]:
            parent = parent[k]
        if action == "set" or (action == "delete" and isinstance(parent, list)):
            parent[where[-1]] = data.draw(_json)
        elif action == "delete":
            del parent[where[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8) | st.sampled_from(_PATHS))] = data.draw(_json)
        _resign(path, h)
        _read(path)  # refused, or read with every invariant of _read


@FUZZ
@given(name=st.sampled_from(FILES[1:]), pos=st.floats(0, 1, exclude_max=True),
       new=st.binary(min_size=1, max_size=8))
def test_hostile_data_under_a_resigned_header_never_yields_bad_values(base, name, pos, new):
    with _Copy(base[0]) as path:
        raw = bytearray((path / name).read_bytes())
        i = int(pos * len(raw))
        raw[i:i + len(new)] = new[:len(raw) - i]
        (path / name).write_bytes(bytes(raw))
        h = json.loads((path / "header.json").read_text())
        h["files"][name]["crc32"] = zlib.crc32(bytes(raw))
        _resign(path, h)
        _read(path)  # offsets, labels, NaN, ids: a StoreError, never a wrong value


@FUZZ
@given(junk=st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()),
       flip=st.booleans())
def test_a_junk_sidecar_never_hides_corruption(base, junk, flip):
    with _Copy(base[0]) as path:
        (path / ".verified.json").write_bytes(junk)
        if flip:
            raw = bytearray((path / "train_x.bin").read_bytes())
            raw[5] ^= 0x10
            (path / "train_x.bin").write_bytes(bytes(raw))
        got = _read(path)
        assert (got is None) if flip else _same(got, base[1])
