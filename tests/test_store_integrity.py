"""Store integrity (issue 21 item 7): CRCs checked at open (once per file version), values
checked on every read, header paths confined to the store folder."""

from __future__ import annotations

import json
import os
import time
import zlib

import numpy as np
import pytest
import torch
from _nn_toy import toy_data, toy_model

from partialfl.data.store import ClientStore, StoreError, StoreWriter, open_store, write_store
from partialfl.data.store import verify as sv
from partialfl.data.store.layout import header_crc
from partialfl.problems.model import ModelProblem
from partialfl.split import make_split


def _store(tmp_path, name="s", age=None):
    """A small float-x store; ``age`` seconds: backdate every file (past the racy window)."""
    path = write_store(tmp_path / name, toy_data(num_clients=4, seed=1))
    if age is not None:
        t = time.time() - age
        for f in path.iterdir():
            os.utime(f, (t, t))
    return path


def _flip(path, offset, mask=0xFF):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def _rewrite_header(path, edit):
    """Apply ``edit(header)`` and re-sign the header (a consistent, hostile header)."""
    hp = path / "header.json"
    h = json.loads(hp.read_text())
    edit(h)
    h["header_crc32"] = header_crc(h)
    hp.write_text(json.dumps(h))


def _poke(path, field, row, value):
    """Overwrite one value of a store file in place (same size, same inode)."""
    h = json.loads((path / "header.json").read_text())
    spec = h["fields"][field]
    dt = np.dtype(spec["dtype"])
    per = int(np.prod(spec["shape"]))
    with open(path / f"{field}.bin", "r+b") as f:
        f.seek(row * per * dt.itemsize)
        f.write(np.asarray([value], dtype=dt).tobytes())


# ----------------------------------------------------------------------------- CRC at open
def test_a_nan_written_into_the_data_is_refused_at_open(tmp_path):
    path = _store(tmp_path)
    _poke(path, "train_x", 3, np.nan)  # issue 21: this client was skipped silently each round
    with pytest.raises(StoreError, match="train_x.bin.*CRC-32 mismatch"):
        open_store(path)


def test_a_flipped_label_is_refused_at_open(tmp_path):
    path = _store(tmp_path)
    _flip(path / "train_y.bin", 0, 0x40)  # label + 64: out of 0..4
    with pytest.raises(StoreError, match="train_y.bin.*CRC-32 mismatch"):
        open_store(path)


def test_a_corrupt_header_value_is_refused(tmp_path):
    path = _store(tmp_path)
    hp = path / "header.json"
    hp.write_text(hp.read_text().replace('"num_classes": 5', '"num_classes": 7'))
    with pytest.raises(StoreError, match="header.json.*header CRC-32 mismatch"):
        open_store(path)


# ----------------------------------------------------------------------------- checked reads
def test_values_changed_after_open_are_refused_on_read(tmp_path):
    path = _store(tmp_path)
    ds = open_store(path)
    n0 = int(ds.train_sizes()[0])
    _poke(path, "train_y", n0, 99)  # client 1's first label, out of 0..4
    with pytest.raises(StoreError, match=rf"train_y.bin: row {n0} holds a value outside 0..4"):
        ds.train_y[1]
    assert torch.equal(ds.train_y[0], toy_data(num_clients=4, seed=1).train_y[0])  # intact
    _poke(path, "train_x", 0, np.nan)
    with pytest.raises(StoreError, match="train_x.bin: row 0 holds a non-finite value"):
        ds.train_x[0]
    # the training path (ModelProblem minibatches) reads through the same check
    pb = ModelProblem(make_split(toy_model(0), "output"), ds, vectorize=False)
    with pytest.raises(StoreError, match="train_x.bin: row 0"):
        pb._store["train"].gather(0, np.array([1, 0]))


def test_integer_inputs_are_checked_against_the_range_written(tmp_path):
    with StoreWriter(tmp_path / "t", num_classes=3) as w:
        for m in range(3):
            tok = np.arange(6).reshape(2, 3) + m
            w.add(f"u{m}", tok, np.array([0, 2]), tok[:1], np.array([1]))
    h = json.loads((tmp_path / "t" / "header.json").read_text())
    assert (h["fields"]["train_x"]["min"], h["fields"]["train_x"]["max"]) == (0, 7)
    ds = open_store(tmp_path / "t")
    _poke(tmp_path / "t", "train_x", 0, 10_000)  # a token id past the vocabulary
    with pytest.raises(StoreError, match="train_x.bin: row 0 holds a value outside 0..7"):
        ds.train_x[0]


def test_a_file_truncated_while_open_is_an_error_not_a_crash(tmp_path):
    path = _store(tmp_path)
    ds = open_store(path)
    with open(path / "train_x.bin", "r+b") as f:
        f.truncate(16)
    with pytest.raises(StoreError, match="train_x.bin: ends before byte"):
        ds.train_x[3]


# ----------------------------------------------------------------------------- confined paths
def _leak(tmp_path, name):
    """A store whose (re-signed) header reads ``name`` as an array-valued meta entry."""
    secret = np.arange(5.0)
    (tmp_path / "secret.bin").write_bytes(secret.tobytes())
    path = _store(tmp_path)
    raw = secret.tobytes()

    def edit(h):
        h["meta_arrays"]["leak"] = {"file": name, "dtype": "<f8", "shape": [5]}
        h["files"][name] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}

    _rewrite_header(path, edit)
    return path


@pytest.mark.parametrize("name", ["../secret.bin", "../../../etc/hostname", "ABS", "a/b.bin",
                                  ".hidden", "..", ""])
def test_header_paths_outside_the_store_are_refused(tmp_path, name):
    name = str(tmp_path / "secret.bin") if name == "ABS" else name
    path = _leak(tmp_path, name)
    with pytest.raises(StoreError, match="plain names inside the store folder"):
        open_store(path)


def test_a_symlink_out_of_the_store_is_refused(tmp_path):
    path = _leak(tmp_path, "meta_9.bin")
    (path / "meta_9.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(StoreError, match="meta_9.bin: a symlink out of the store folder"):
        open_store(path)
    os.symlink(tmp_path / "elsewhere", path / "train_x.bin.tmp")  # names not in the header:
    (path / "meta_9.bin").unlink()  # ignored
    (path / "meta_9.bin").write_bytes((tmp_path / "secret.bin").read_bytes())
    assert np.array_equal(open_store(path).meta["leak"], np.arange(5.0))


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["fields"]["train_x"].update(dtype="|O"), "must be a little-endian dtype"),
    (lambda h: h["fields"]["train_x"].update(dtype=">f4"), "must be a little-endian dtype"),
    (lambda h: h["fields"]["train_y"].update(dtype="<f8"), "must be a little-endian dtype"),
    (lambda h: h["fields"]["train_x"].update(dtype=[1]), "must be a numpy dtype string"),
    (lambda h: h["fields"]["train_x"].update(shape=[-1, 8, 8]), "list of at most 8 integers"),
    (lambda h: h["fields"]["test_y"].update(rows=True), "rows must be an integer"),
    (lambda h: h["fields"]["test_x"].update(rows=0, shape=[1, 8, 8]), "test_x has 0 rows"),
    (lambda h: h.update(num_clients=0), "num_clients must be an integer >= 1"),
    (lambda h: h.update(client_id_dtype="<U2"), "client_id_dtype must be"),
    (lambda h: h.update(x_scale=-1.0), "x_scale must be"),
    (lambda h: h["files"].pop("test_offsets.bin"), "the store needs"),
    (lambda h: h["files"]["train_y.bin"].update(crc32=-1), "crc32 must be an integer"),
    (lambda h: h["files"]["train_y.bin"].update(bytes=8), "train_y.bin: the header says 8"),
])
def test_inconsistent_headers_are_one_line_store_errors(tmp_path, edit, match):
    path = _store(tmp_path)
    _rewrite_header(path, edit)
    with pytest.raises(StoreError, match=match) as e:
        open_store(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": NaN}',
                                  '{"format": 1' + "0" * 5000 + "}", "\xff\xfe"])
def test_unparseable_headers_are_store_errors(tmp_path, text):
    path = _store(tmp_path)
    (path / "header.json").write_bytes(text.encode("utf-8", "surrogateescape")
                                       if text != "\xff\xfe" else b"\xff\xfe")
    with pytest.raises(StoreError, match="header.json"):
        open_store(path)


# ----------------------------------------------------------------------------- check once
@pytest.fixture
def crc_calls(monkeypatch):
    calls = []
    real = sv.crc_file

    def counting(p):
        calls.append(p.name)
        return real(p)

    monkeypatch.setattr(sv, "crc_file", counting)
    sv.forget()
    yield calls
    sv.forget()


def test_crcs_are_computed_once_per_file_version(tmp_path, crc_calls):
    path = _store(tmp_path, age=60)
    nfiles = len(json.loads((path / "header.json").read_text())["files"])
    st = (path / "test_x.bin").stat()
    assert len(ClientStore(path).crc_read) == nfiles == len(crc_calls)
    assert ClientStore(path).crc_read == []  # remembered in this process
    sv.forget()
    assert ClientStore(path).crc_read == [] and len(crc_calls) == nfiles  # ... and on disk
    # a changed file is checked again (its mtime and ctime moved), the others are not
    raw = (path / "test_x.bin").read_bytes()
    _flip(path / "test_x.bin", 5, 0x01)
    with pytest.raises(StoreError, match="test_x.bin.*CRC"):
        ClientStore(path)
    assert crc_calls[nfiles:] == ["test_x.bin"]
    # restoring the old mtime does not hide a change (the ctime and the key still move)
    (path / "test_x.bin").write_bytes(raw)
    _flip(path / "test_x.bin", 5, 0x01)
    os.utime(path / "test_x.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(StoreError, match="test_x.bin.*CRC"):
        ClientStore(path)
    # verify() re-reads everything, remembered or not
    (path / "test_x.bin").write_bytes(raw)
    os.utime(path / "test_x.bin", (time.time() - 60, time.time() - 60))
    store = ClientStore(path)
    n = len(crc_calls)
    store.verify()
    assert len(crc_calls) == n + nfiles


def test_a_just_written_store_is_checked_on_every_open(tmp_path, crc_calls):
    path = _store(tmp_path)  # files modified now: within the racy window
    ClientStore(path)
    n = len(crc_calls)
    _flip(path / "train_x.bin", 2, 0x10)  # may keep the same mtime tick
    with pytest.raises(StoreError, match="train_x.bin.*CRC"):
        ClientStore(path)
    assert len(crc_calls) > n
    assert not (path / ".verified.json").exists()


def test_a_garbled_sidecar_is_ignored(tmp_path, crc_calls):
    path = _store(tmp_path, age=60)
    ClientStore(path)
    for junk in (b"\x00garbage", b"[1, 2]", b'{"train_x.bin": [1, 2, 3, 4, 5, "x"]}'):
        (path / ".verified.json").write_bytes(junk)
        sv.forget()
        assert len(ClientStore(path).crc_read) == 7
    # a sidecar that is a symlink (to a file that would vouch for a corrupt version) is ignored
    good = (path / ".verified.json").read_bytes()
    (path / ".verified.json").unlink()
    (tmp_path / "vouch.json").write_bytes(good)
    (path / ".verified.json").symlink_to(tmp_path / "vouch.json")
    sv.forget()
    assert len(ClientStore(path).crc_read) == 7
