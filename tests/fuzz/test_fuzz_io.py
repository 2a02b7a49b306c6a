"""Fuzzing the file readers (issue 21 item 8): whatever bytes a file holds — random, a
crafted safetensors header (lengths, offsets, dtypes, shapes, nesting), a crafted state
skeleton — ``io.load_tensors`` / ``io.load_state`` load it or raise the project's
``FileFormatError`` / ``UnsafeFileError``, never anything else."""

from __future__ import annotations

import json
import struct

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from partialfl import io as pio  # noqa: E402

FAST = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

DTYPES = st.sampled_from(["F32", "F64", "F16", "BF16", "I64", "I32", "U8", "I8", "BOOL",
                          "F8_E4M3", "F8_E5M2", "U64", "C64", "f32", "", "STR"])
INTS = st.one_of(st.integers(-3, 40), st.integers(-2**70, 2**70), st.booleans(),
                 st.floats(allow_nan=True), st.text(max_size=3))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                        c, max_size=4),
                    max_leaves=20)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _load(folder, data: bytes, state: bool = False):
    f = folder / "x.safetensors"
    f.write_bytes(data)
    try:
        return (pio.load_state if state else pio.load_tensors)(f)
    except (pio.FileFormatError, pio.UnsafeFileError):
        return None


def _file(header: object, body: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return struct.pack("<Q", n % 2**64) + raw + body


@FAST
@given(st.binary(max_size=200))
def test_random_bytes(folder, data):
    _load(folder, data)
    _load(folder, data, state=True)


@st.composite
def _entry(draw):
    shape = draw(st.lists(INTS, max_size=4))
    start = draw(st.integers(0, 64))
    size = draw(st.one_of(st.integers(0, 64), INTS))
    offs = draw(st.one_of(st.just([start, start + size if isinstance(size, int) else size]),
                          st.lists(INTS, max_size=3)))
    return {"dtype": draw(DTYPES), "shape": shape, "data_offsets": offs}


@FAST
@given(st.dictionaries(st.text(max_size=5), st.one_of(_entry(), JSON), max_size=4),
       st.binary(max_size=96), st.one_of(st.none(), st.integers(0, 300)),
       st.one_of(st.none(), JSON, st.dictionaries(st.text(max_size=4), JSON, max_size=3)))
def test_crafted_headers(folder, entries, body, length, metadata):
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    _load(folder, _file(header, body, length))


@FAST
@given(JSON, st.integers(0, 3000), st.sampled_from(["[", "{\"a\":", "[{\"b\":["]))
def test_deep_json_nesting(folder, meta, depth, opener):
    closer = {"[": "]", "{\"a\":": "}", "[{\"b\":[": "]}]"}[opener]
    deep = (opener * depth + "1" + closer * depth).encode()
    _load(folder, _file(b'{"t":' + deep + b"}", b""))
    # nesting inside the partialfl metadata string, and as a state skeleton
    inner = opener * depth + "1" + closer * depth
    _load(folder, _file({"__metadata__": {"partialfl": inner}}, b""), state=True)
    _load(folder, _file({"__metadata__": {"partialfl": json.dumps({"kinds": meta,
                                                            "metadata": meta})}}, b""), True)


SKELETON = st.recursive(
    JSON,
    lambda c: st.one_of(
        st.fixed_dictionaries({"float": c}), st.fixed_dictionaries({"scalar": c, "value": c}),
        st.fixed_dictionaries({"tensor": c, "device": st.sampled_from(
            [None, "cpu", "cuda:0", "cuda:7", "mps", "meta", "tpu", 3])}),
        st.fixed_dictionaries({"list": c}), st.fixed_dictionaries({"tuple": c}),
        st.fixed_dictionaries({"dict": c}), st.fixed_dictionaries({"items": c}),
        st.fixed_dictionaries({"dataclass": st.sampled_from(["ServerState", "ClientUpdates",
                                                             "Evil", 1]), "fields": c})),
    max_leaves=12)


@FAST
@given(SKELETON, st.sampled_from(["float32", "int8", "int64", "bool", "<M8", "V3", "O",
                                  "U2", "float128", "nonsense"]))
def test_crafted_state_skeletons(folder, skeleton, dtype):
    import numpy as np

    f = folder / "s.safetensors"
    pio.save_tensors(f, {"t0": np.zeros(2, dtype=np.float32)},
                     {"state": {"list": [skeleton, {"scalar": dtype, "value": 1e300}]}})
    try:
        pio.load_state(f)
    except (pio.FileFormatError, pio.UnsafeFileError):
        pass


def test_a_valid_file_still_loads(folder):
    import numpy as np

    f = folder / "ok.safetensors"
    pio.save_state(f, {"a": np.arange(3.0), "b": [1, "x", None]}, note="n")
    obj, meta = pio.load_state(f)
    assert obj["a"].tolist() == [0.0, 1.0, 2.0] and obj["b"] == [1, "x", None]
    assert meta["note"] == "n"
