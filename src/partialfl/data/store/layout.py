"""The client store's on-disk layout: constants, the header (written and validated), file
names confined to the store folder, and the small file helpers the writer and reader share.

Every check here raises :class:`StoreError` naming the file and what is wrong, so a corrupt or
hostile ``header.json`` gives one line, never a traceback or a read outside the store.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.arrays import is_array, to_numpy
from partialfl.data.federated import MAX_CLASSES, DataFormatError

STORE_FORMAT = "partialfl-client-store"
STORE_VERSION = 1
FIELDS = ("train_x", "train_y", "test_x", "test_y")
SPLITS = ("train", "test")
HEADER = "header.json"
MAX_HEADER_BYTES = 64 << 20  # a header is KiBs (MiBs with a large vocabulary in meta)
_CRC_BLOCK = 1 << 24
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
X_KINDS, Y_KINDS, META_KINDS = "biuf", "iu", "biufcSU"

as_numpy = to_numpy  # a numpy view or copy of an array or (detached, host) tensor


#: the largest input a reader returns (inputs are float32)
F32_MAX = float(np.finfo(np.float32).max)


def x_scale_problem(xd: np.dtype, xs: float) -> str | None:
    """Why float32 ``x · x_scale`` could overflow for some input of dtype ``xd`` (what the
    readers return), or None: the largest |x| (a signed integer's minimum, a float's max)
    times ``x_scale``, with a margin of 2⁻²⁰ for the float32 roundings of x, x_scale and
    their product."""
    if xd.kind == "b":
        top = 1.0
    elif xd.kind in "iu":
        top = float(max(np.iinfo(xd).max, -int(np.iinfo(xd).min)))
    else:
        top = float(np.finfo(xd).max)
    if top * xs * (1 + 2.0 ** -20) <= F32_MAX:
        return None
    return f"x_scale overflows float32 for {xd.str} inputs (x · x_scale must stay finite)"


class StoreError(DataFormatError):
    """A client store (or client-state store) is missing, truncated, corrupt or of another
    version; the message names the file."""


# ----------------------------------------------------------------------------- file helpers
def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc_file(path: Path) -> int:
    """CRC-32 of a whole file (read in 16 MiB blocks into one reused buffer)."""
    crc, buf = 0, bytearray(_CRC_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def pread_into(fd: int, buf: memoryview, offset: int, name: Path | str) -> None:
    """Fill ``buf`` from byte ``offset`` of the open file ``fd`` (``name`` for the error)."""
    while buf.nbytes:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf], offset)
        else:  # pragma: no cover - platforms without preadv
            data = os.pread(fd, buf.nbytes, offset)
            n = len(data)
            buf[:n] = data
        if n == 0:
            raise StoreError(f"{name}: ends before byte {offset + buf.nbytes} (truncated "
                             "while in use)")
        buf, offset = buf[n:], offset + n


class Sink:
    """An append-only binary file that tracks its size and CRC-32."""

    def __init__(self, path: Path) -> None:
        self.path, self.f, self.bytes, self.crc = path, open(path, "wb"), 0, 0

    def write(self, a: np.ndarray) -> None:
        if a.size == 0:
            return
        buf = memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B")
        self.f.write(buf)
        self.bytes += buf.nbytes
        self.crc = zlib.crc32(buf, self.crc)

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.bytes, "crc32": self.crc}


def split_meta(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """JSON-able meta entries and array-valued ones (stored as files)."""
    plain, arrays = {}, {}
    for k, v in (meta or {}).items():
        if is_array(v):
            a = as_numpy(v)
            if a.dtype.kind not in META_KINDS:
                raise ValueError(f"meta[{k!r}] has dtype {a.dtype}: store arrays of numbers "
                                 "or strings")
            arrays[str(k)] = a
            continue
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(f"meta[{k!r}] of type {type(v).__name__} cannot be stored: use "
                             "JSON values (finite numbers) or arrays") from None
        plain[str(k)] = v
    return plain, arrays


# ----------------------------------------------------------------------------- header
def header_crc(h: dict) -> int:
    """CRC-32 of the header's canonical JSON without its own ``header_crc32`` entry."""
    body = {k: v for k, v in h.items() if k != "header_crc32"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)
    return zlib.crc32(text.encode("ascii"))


@dataclass(frozen=True)
class Field:
    dtype: np.dtype
    shape: tuple[int, ...]  # per example
    rows: int
    lo: int | None = None  # integer fields: the smallest and largest value written
    hi: int | None = None


@dataclass(frozen=True)
class Header:
    """A validated ``header.json``."""

    raw: dict
    num_clients: int
    num_classes: int
    fields: dict[str, Field]
    files: dict[str, tuple[int, int]]  # name -> (bytes, crc32)
    id_dtype: np.dtype
    meta: dict
    meta_arrays: dict[str, tuple[str, np.dtype, tuple[int, ...]]]
    x_scale: float | None
    description: str


def safe_file(root: Path, name: Any, where: str) -> Path:
    """``root / name`` for a plain file name that stays inside ``root`` (no separators, no
    ``..``, no absolute path, no symlink out of the folder)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise StoreError(f"{root / HEADER}: {where} names the file {str(name)[:80]!r}; store "
                         "files are plain names inside the store folder")
    fp = root / name
    if fp.is_symlink():
        try:
            real, top = fp.resolve(strict=True), root.resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop, a dangling link
            raise StoreError(f"{fp}: a broken symlink ({e})") from None
        if real.parent != top:
            raise StoreError(f"{fp}: a symlink out of the store folder (to {real})")
    return fp


def _bad(hp: Path, what: str, v: Any) -> StoreError:
    return StoreError(f"{hp}: {what}, got {repr(v)[:80]}")


def _int(hp: Path, d: dict, key: str, lo: int, hi: int | None = None, where: str = "") -> int:
    v = d.get(key)
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise _bad(hp, f"{where}{key} must be an integer {rng}", v)
    return v


def _dtype(hp: Path, v: Any, kinds: str, where: str) -> np.dtype:
    try:
        if not isinstance(v, str) or len(v) > 16:
            raise TypeError
        dt = np.dtype(v)
    except (TypeError, ValueError, SyntaxError):
        raise _bad(hp, f"{where} must be a numpy dtype string", v) from None
    if (dt.kind not in kinds or dt.itemsize < 1 or dt.names is not None or dt.shape != ()
            or dt != dt.newbyteorder("<")):
        raise _bad(hp, f"{where} must be a little-endian dtype of kind {kinds!r}", v)
    return dt


def _shape(hp: Path, v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8 or any(type(s) is not int or s < 0 for s in v):
        raise _bad(hp, f"{where} must be a list of at most 8 integers >= 0", v)
    return tuple(v)


def _dict(hp: Path, v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise _bad(hp, f"{where} must be an object", v)
    return v


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def read_header(root: Path) -> Header:
    """Parse and validate ``root/header.json`` (every file it names is confined to ``root``;
    sizes and dtypes are consistent; ``header_crc32``, when present, matches)."""
    hp = safe_file(root, HEADER, "the store")
    if not hp.is_file():
        raise StoreError(f"{hp}: missing — {root} is not a complete client store "
                         "(an interrupted conversion leaves no header)")
    try:
        with open(hp, "rb") as f:
            text = f.read(MAX_HEADER_BYTES + 1)
        if len(text) > MAX_HEADER_BYTES:
            raise StoreError(f"{hp}: over {MAX_HEADER_BYTES >> 20} MiB, not a store header")
        h = json.loads(text.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        if isinstance(e, StoreError):
            raise
        raise StoreError(f"{hp}: corrupt header ({str(e)[:200]})") from None
    if not isinstance(h, dict) or h.get("format") != STORE_FORMAT:
        raise StoreError(f"{hp}: not a {STORE_FORMAT} header")
    if h.get("version") != STORE_VERSION:
        raise StoreError(f"{hp}: store version {repr(h.get('version'))[:40]}, this reader reads "
                         f"version {STORE_VERSION}; convert the data again")
    if "header_crc32" in h:
        try:
            ok = h["header_crc32"] == header_crc(h)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise StoreError(f"{hp}: header CRC-32 mismatch (corrupt header)")
    M = _int(hp, h, "num_clients", 1)
    C = _int(hp, h, "num_classes", 1, MAX_CLASSES)  # (10^15 made a model of that size)
    files = {}
    for name, info in _dict(hp, h.get("files"), "files").items():
        safe_file(root, name, "files")
        info = _dict(hp, info, f"files[{name!r}]")
        files[name] = (_int(hp, info, "bytes", 0, where=f"files[{name!r}]."),
                       _int(hp, info, "crc32", 0, 2**32 - 1, where=f"files[{name!r}]."))
    raw_fields = _dict(hp, h.get("fields"), "fields")
    if sorted(raw_fields) != sorted(FIELDS):
        raise _bad(hp, f"fields must be exactly {list(FIELDS)}", sorted(raw_fields))
    fields = {}
    for f in FIELDS:
        spec = _dict(hp, raw_fields[f], f"fields[{f!r}]")
        dt = _dtype(hp, spec.get("dtype"), Y_KINDS if f.endswith("_y") else X_KINDS,
                    f"fields[{f!r}].dtype")
        rng = [spec.get(k) for k in ("min", "max")]
        if rng != [None, None] and (any(type(v) is not int for v in rng) or rng[0] > rng[1]):
            raise _bad(hp, f"fields[{f!r}] min/max must be integers, min <= max", rng)
        fields[f] = Field(dt, _shape(hp, spec.get("shape"), f"fields[{f!r}].shape"),
                          _int(hp, spec, "rows", 0, where=f"fields[{f!r}]."), *rng)
    for s in SPLITS:
        x, y = fields[f"{s}_x"], fields[f"{s}_y"]
        if x.rows != y.rows:
            raise StoreError(f"{hp}: {s}_x has {x.rows} rows, {s}_y {y.rows}")
    if fields["train_x"].dtype != fields["test_x"].dtype or \
            fields["train_x"].shape != fields["test_x"].shape:
        raise StoreError(f"{hp}: train_x and test_x differ in dtype or shape")
    id_dtype = _dtype(hp, h.get("client_id_dtype"), "S", "client_id_dtype")
    meta_arrays = {}
    for k, info in _dict(hp, h.get("meta_arrays") or {}, "meta_arrays").items():
        info = _dict(hp, info, f"meta_arrays[{k!r}]")
        meta_arrays[k] = (info.get("file"), _dtype(hp, info.get("dtype"), META_KINDS,
                                                   f"meta_arrays[{k!r}].dtype"),
                          _shape(hp, info.get("shape"), f"meta_arrays[{k!r}].shape"))
    # every file named, of the size its array needs
    need = {f"{f}.bin": (fields[f].dtype, (fields[f].rows, *fields[f].shape)) for f in FIELDS}
    need.update({f"{s}_offsets.bin": (np.dtype("<i8"), (M + 1,)) for s in SPLITS})
    need["client_ids.bin"] = (id_dtype, (M,))
    for k, (name, dt, shape) in meta_arrays.items():
        safe_file(root, name, f"meta_arrays[{k!r}].file")
        if name in need:
            raise _bad(hp, f"meta_arrays[{k!r}].file is already used", name)
        need[name] = (dt, shape)
    if sorted(need) != sorted(files):
        raise StoreError(f"{hp}: files lists {sorted(files)}, the store needs {sorted(need)}")
    for name, (dt, shape) in need.items():
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes != files[name][0]:
            raise StoreError(f"{root / name}: the header says {files[name][0]} bytes, which do "
                             f"not hold {shape} of {dt.str}")
    xs = h.get("x_scale")
    if xs is not None and (type(xs) not in (int, float) or not math.isfinite(xs) or xs <= 0):
        raise _bad(hp, "x_scale must be null or a positive finite number", xs)
    why = None if xs is None else x_scale_problem(fields["train_x"].dtype, xs)
    if why is not None:
        raise _bad(hp, why, xs)
    desc = h.get("description", "")
    if not isinstance(desc, str):
        raise _bad(hp, "description must be a string", desc)
    return Header(h, M, C, fields, files, id_dtype, dict(_dict(hp, h.get("meta") or {}, "meta")),
                  meta_arrays, None if xs is None else float(xs), desc)
