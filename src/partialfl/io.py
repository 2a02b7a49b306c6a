"""Safe, atomic files: the only way partialfl writes and reads its own files.

* **Atomic writes.** :func:`atomic_write` writes a temporary file next to the target and
  ``os.replace``-s it into place, so an interrupted write never leaves a truncated file and
  never clobbers the previous version (every write in ``src`` goes through it).
* **No code from files.** Nothing is ever unpickled. Tensors (numpy or torch) are stored with
  `safetensors <https://huggingface.co/docs/safetensors>`_ (:func:`save_tensors`,
  :func:`load_tensors`); structured state (a server state with its optimizer state, a metric
  history) is *encoded* into plain JSON plus named tensors (:func:`encode_state`): only
  None/bool/int/float/str, lists, tuples, dicts, numpy/torch arrays and an explicit allowlist
  of partialfl dataclasses (marked with :func:`state_class`) can be stored or restored. A pickle or
  ``torch.save`` file — which may run arbitrary code when loaded — is refused with
  :class:`UnsafeFileError`; a truncated or corrupt file gives :class:`FileFormatError`; both
  name the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import stat
import struct
import tempfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from partialfl import arrays


class FileFormatError(ValueError):
    """A file is truncated, corrupt or not in the format expected (the message names it)."""


class UnsafeFileError(FileFormatError):
    """A file is in a format that can execute code when loaded (pickle, ``torch.save``)."""


# --------------------------------------------------------------------------- atomic writes
def _umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: the classic read-and-restore
    os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    """Make the entries of folder ``path`` durable (a rename into it survives a power loss);
    a no-op where folders cannot be fsync-ed."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", *, private: bool = False,
                 **kw: Any) -> Iterator[IO]:
    """Open a temporary file in ``path``'s folder for writing; on success it replaces
    ``path`` atomically (``os.replace``, after fsync), on an exception it is removed and
    ``path`` is left as it was. The parent folder is created; the file gets the mode a new
    file gets (0o666 less the umask), not the temporary file's 0600 — or, ``private``, keeps
    0600 (owner-only from its first byte to its final name: a private key)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o600 if private else 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


#: the temporary file of an :func:`atomic_write` (``tempfile``'s 8 random characters)
_STALE = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


def clean_stale_writes(folder: str | Path, recursive: bool = True,
                       targets: Collection[str] | None = None,
                       skip: Collection[str] = ()) -> list[Path]:
    """Remove the temporary files that killed :func:`atomic_write` s left in ``folder`` (and,
    ``recursive``, its sub-folders; no process may be writing there); returns them.
    ``targets``: only those of writes to these file names (a command cleaning its own files
    in a folder others may write to); ``skip``: entries of ``folder`` left alone (the user's
    own files and folders in a run folder). Symbolic links are neither followed nor
    removed."""
    gone = []
    want = None if targets is None else set(targets)
    for root, dirs, files in (os.walk(folder) if recursive
                              else [(folder, [], os.listdir(folder))]):
        if skip and Path(root) == Path(folder):
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in files:
            f = Path(root) / name
            # ".{target}.{8 random}.tmp": the target exactly (for "a", not a write of "a.json")
            mine = want is None or name[1:-13] in want
            if mine and _STALE.match(name) and not f.is_symlink() and f.is_file():
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
                    gone.append(f)
    return gone


def refuse_link(path: str | Path, why: str) -> None:
    """:class:`UnsafeFileError` if ``path`` is a symbolic link (a file received in a folder
    could lead out of it); ``why`` says where the file must lie."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafeFileError(f"{path} is a symbolic link (to {path.resolve()}): {why}")


def open_regular(path: str | Path, *, follow: bool = True) -> IO[bytes]:
    """``path`` opened for reading in binary, if it is a regular file; else
    :class:`FileFormatError` (FileNotFoundError if it is missing). Opened without blocking, so
    a FIFO planted under a file's name in a received folder is refused instead of hanging
    the reader for good; ``follow=False``: a symlink is refused too."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:  # O_NOFOLLOW on a symlink: ELOOP; a folder (on some systems)
        raise FileFormatError(f"{path} cannot be read as a file ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # (before fdopen: a folder raised there)
        os.close(fd)
        raise FileFormatError(f"{path} is not a regular file (a folder, FIFO or device)")
    return os.fdopen(fd, "rb")


def read_regular(path: str | Path) -> bytes:
    """The bytes of ``path`` read through :func:`open_regular` (a FIFO or device planted
    under a data file's name is a :class:`FileFormatError`, never a reader blocked for
    good)."""
    with open_regular(path) as f:
        return f.read()


def read_utf8(path: str | Path) -> str:
    """The text of ``path`` (:func:`read_regular`), UTF-8; text in another encoding is a
    :class:`FileFormatError` naming the file and the byte offset."""
    try:
        return read_regular(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{path} is not UTF-8 text (byte {e.start})") from None


def _read(path: Path, what: str) -> bytes:
    """:func:`read_regular` with the messages of the readers: missing is FileNotFoundError,
    a folder, FIFO or device FileFormatError naming it (it was "not found")."""
    try:
        return read_regular(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}{path} not found") from None
    except FileFormatError as e:
        raise FileFormatError(f"{what}{e}") from None


def write_text(path: str | Path, text: str) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes, *, private: bool = False) -> str:
    """Write ``data`` atomically (``private``: owner-only, see :func:`atomic_write`); returns
    its SHA-256 (hex)."""
    with atomic_write(path, "wb", private=private) as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def write_json(path: str | Path, obj: Any, **dumps_kw: Any) -> None:
    write_text(path, json.dumps(obj, **dumps_kw))


def read_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (every JSON file of the project holds one); a missing file
    gives FileNotFoundError, a bad one — not JSON, or JSON that is not an object (a list or a
    string crashed the readers with AttributeError) — FileFormatError."""
    path = Path(path)
    data = _read(path, "")
    try:
        obj = json.loads(data.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise FileFormatError(f"{path} is not valid JSON (truncated or corrupt?): "
                              f"{str(e)[:200]}") from None
    except RecursionError:
        raise FileFormatError(f"{path} is nested too deeply to be a file of this project"
                              ) from None
    if not isinstance(obj, dict):
        raise FileFormatError(f"{path} is not a JSON object (a {type(obj).__name__}): damaged "
                              "or not a file of this project")
    return obj


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of the numpy ``.npz`` archive ``path`` (read through :func:`open_regular`,
    never unpickled); missing is FileNotFoundError, anything else unreadable — a folder or
    FIFO, a truncated or corrupt archive, an object array — a :class:`FileFormatError`
    naming the file (a damaged archive raised ``BadZipFile`` or ``EOFError``, tracebacks,
    and a FIFO hung the reader)."""
    import zipfile

    try:
        with open_regular(path) as fh:
            z = np.load(fh, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):  # a plain .npy array
                raise FileFormatError(f"{path} is a single .npy array, not an .npz archive")
            with z:
                return {k: z[k] for k in z.files}
    except (FileNotFoundError, FileFormatError):
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise FileFormatError(f"{path} is not a readable npz file (truncated or corrupt?): "
                              f"{str(e)[:200]}") from None


def write_npz(path: str | Path, arrays: Mapping[str, Any]) -> None:
    """``arrays`` (name → array) as the numpy ``.npz`` archive ``path``, atomically: what
    ``np.savez(f, **arrays)`` writes, for any names (a name ``file`` or ``allow_pickle`` was a
    keyword clash there: a TypeError, or a silently dropped array); no object arrays."""
    import zipfile

    with atomic_write(path, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        for n, a in arrays.items():
            with z.open(f"{n}.npy", "w", force_zip64=True) as m:
                np.lib.format.write_array(m, np.asanyarray(a), allow_pickle=False)


def savefig(fig, path: str | Path, **kw: Any) -> None:
    """``fig.savefig`` through :func:`atomic_write` (format from the suffix)."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or "png", **kw)


# --------------------------------------------------------------------------- tensors

#: safetensors dtypes (the format's names) and their sizes in bytes
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                "F64": 8}


def _check_safetensors_header(path: Path, data: bytes) -> dict:
    """Parse and validate the safetensors header (8-byte little-endian length, then a JSON
    object: per tensor a known dtype, a shape of non-negative integers and data offsets that
    fit the file and the shape; ``__metadata__`` a string map), or raise.

    The safetensors layout is tried first: a header length whose low byte is 0x80 starts the
    file with the same byte as a pickle, so the pickle/zip diagnosis only applies to a file
    that is not a well-formed safetensors prefix (a pickle's first 8 bytes read as a length
    far beyond the file, and its 9th byte is not ``{``)."""
    n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else None
    looks_safetensors = n is not None and n <= len(data) - 8 and data[8:9] == b"{"
    if not looks_safetensors and (data[:1] == b"\x80" or data[:2] == b"PK"):
        kind = "a pickle" if data[:1] == b"\x80" else "a zip (torch.save) archive"
        raise UnsafeFileError(f"{path} is {kind} file: {_PICKLE_HINT}")
    if n is None:
        raise FileFormatError(f"{path} is truncated ({len(data)} bytes): not a safetensors file")
    if not looks_safetensors:
        raise FileFormatError(f"{path} is truncated or not a safetensors file")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError):  # (ValueError: also an integer of > 4300 digits)
        raise FileFormatError(f"{path} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise FileFormatError(f"{path} has a corrupt safetensors header (not a JSON object)")
    body = len(data) - 8 - n
    for name, v in header.items():
        if name == "__metadata__":
            if not (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())):
                raise FileFormatError(f"{path} has corrupt safetensors metadata")
            continue
        _check_entry(path, name, v, body)
    return header


def _check_entry(path: Path, name: str, v: Any, body: int) -> None:
    """One tensor's header entry: dtype, shape and offsets consistent with the file."""
    bad = f"{path} has a corrupt safetensors header entry {name[:40]!r}"
    if not isinstance(v, dict):
        raise FileFormatError(bad)
    dtype, shape, offs = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise FileFormatError(f"{bad}: unknown dtype {str(dtype)[:20]!r}")
    ints = (isinstance(shape, list) and isinstance(offs, list) and len(offs) == 2
            and all(type(x) is int and x >= 0 for x in (*shape, *offs)))
    if not ints:
        raise FileFormatError(f"{bad}: shape and data_offsets must be non-negative integers")
    if offs[1] > body:
        raise FileFormatError(f"{path} is truncated: tensor {name[:40]!r} ends at byte "
                              f"{offs[1]} of a {body}-byte body")
    if offs[1] - offs[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise FileFormatError(f"{bad}: its data_offsets do not match its shape and dtype")


_PICKLE_HINT = ("it can run arbitrary code when loaded, so partialfl refuses it; re-create it "
                "with this version of partialfl (tensors are stored with safetensors)")


_to_torch = arrays.to_torch


def save_tensors(path: str | Path, tensors: Mapping[str, Any],
                 metadata: Mapping[str, Any] | None = None) -> str:
    """Store named numpy arrays / torch tensors (and JSON ``metadata``) atomically as a
    safetensors file; :func:`load_tensors` gives back the same kinds (numpy stays numpy).
    Returns the file's SHA-256 (hex). The bytes do not depend on the mapping's order (the
    kinds are listed by name: a run resumed from files read back in their layout order once
    wrote other bytes than the uninterrupted run)."""
    from safetensors.torch import save

    kinds = {n: "torch" if arrays.is_torch(tensors[n]) else "numpy" for n in sorted(tensors)}
    meta = {"partialfl": json.dumps({"kinds": kinds, "metadata": dict(metadata or {})})}
    data = save({n: _to_torch(v) for n, v in tensors.items()}, metadata=meta)
    return write_bytes(path, data)


def load_tensors(path: str | Path, what: str = "tensor file", *, sha256: str | None = None,
                 device: Any = None) -> tuple[dict[str, Any], dict]:
    """``(tensors, metadata)`` from a file written by :func:`save_tensors`. Missing:
    FileNotFoundError; pickle / torch.save: :class:`UnsafeFileError`; truncated, corrupt or
    (``sha256`` given) not the file expected: :class:`FileFormatError` (each names ``path``
    and ``what`` it should be). Torch tensors are put on ``device`` if given."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    data = _read(path, f"{what} ")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise FileFormatError(f"{what} {path} does not match its SHA-256 (damaged or "
                              "replaced)")
    header = _check_safetensors_header(path, data)
    try:
        tensors = load(data)
        info = json.loads(header.get("__metadata__", {}).get("partialfl", "{}"))
        kinds = info.get("kinds", {}) if isinstance(info, dict) else None
        meta = info.get("metadata", {}) if isinstance(info, dict) else None
        if not (isinstance(kinds, dict) and isinstance(meta, dict)):
            raise ValueError("the partialfl metadata is not a JSON object")
        out = {n: (t.numpy() if kinds.get(n) == "numpy" else
                   t if device is None else t.to(device)) for n, t in tensors.items()}
    except (SafetensorError, json.JSONDecodeError, RecursionError, ValueError, TypeError,
            RuntimeError) as e:
        raise FileFormatError(f"{what} {path} is corrupt: {str(e)[:200]}") from None
    return out, meta


# --------------------------------------------------------------------------- state codec
#: the dataclasses :func:`decode_state` may rebuild, by class name (filled by
#: :func:`state_class` in the module that defines each)
_STATE_CLASSES: dict[str, type] = {}


def state_class(cls: type) -> type:
    """Class decorator: allow the dataclass ``cls`` in safe state files (stored by name with
    its plain fields; nothing else is ever rebuilt from a file)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    _STATE_CLASSES[cls.__name__] = cls
    return cls


def encode_state(obj: Any) -> tuple[Any, dict[str, Any]]:
    """``(skeleton, tensors)``: a JSON-able skeleton of ``obj`` in which every array is
    replaced by a reference into ``tensors``. Raises TypeError naming anything else."""
    tensors: dict[str, Any] = {}

    def enc(o: Any, where: str) -> Any:
        if o is None or isinstance(o, bool | int | str):
            return o
        if isinstance(o, float):
            return o if math.isfinite(o) else {"float": repr(o)}
        if isinstance(o, np.generic):
            return {"scalar": str(o.dtype), "value": enc(o.item(), where)}
        if arrays.is_array(o):
            key = f"t{len(tensors)}"
            tensors[key] = o
            dev = str(o.device) if arrays.is_torch(o) else None
            return {"tensor": key, "device": dev}
        if isinstance(o, list | tuple):
            return {"list" if isinstance(o, list) else "tuple":
                    [enc(v, f"{where}[{i}]") for i, v in enumerate(o)]}
        if isinstance(o, Mapping):
            if all(isinstance(k, str) for k in o):
                return {"dict": {k: enc(v, f"{where}.{k}") for k, v in o.items()}}
            return {"items": [[enc(k, where), enc(v, f"{where}[{k!r}]")] for k, v in o.items()]}
        name = type(o).__name__
        if dataclasses.is_dataclass(o) and _STATE_CLASSES.get(name) is type(o):
            return {"dataclass": name, "fields": {f.name: enc(getattr(o, f.name),
                                                              f"{where}.{f.name}")
                                                  for f in dataclasses.fields(o)}}
        raise TypeError(f"cannot store {where} of type {name} in a safe state file "
                        f"(allowed: numbers, strings, lists, dicts, arrays, "
                        f"{', '.join(sorted(_STATE_CLASSES))})")

    return enc(obj, "state"), tensors


def _here(device: str | None) -> str | None:
    """``device`` if this machine has it, else None (the tensor stays on the CPU)."""
    if device in (None, "cpu"):
        return None
    from partialfl.devices import available_devices

    return device if device in available_devices() else None


def decode_state(skeleton: Any, tensors: Mapping[str, Any], device: Any = None) -> Any:
    """Inverse of :func:`encode_state`. Torch tensors go to ``device`` if given, else back
    to their recorded device when this machine has it, else stay on the CPU (a checkpoint
    written on ``cuda:0`` resumes on a CPU-only machine)."""
    classes = _STATE_CLASSES

    def dec(o: Any) -> Any:
        if not isinstance(o, dict):
            return o
        if "float" in o:
            return float(o["float"])
        if "scalar" in o:
            return np.dtype(o["scalar"]).type(dec(o["value"]))
        if "tensor" in o:
            t = tensors[o["tensor"]]
            if not arrays.is_torch(t):
                return t
            to = device if device is not None else _here(o.get("device"))
            return t if to is None else t.to(to)
        if "list" in o:
            return [dec(v) for v in o["list"]]
        if "tuple" in o:
            return tuple(dec(v) for v in o["tuple"])
        if "dict" in o:
            return {k: dec(v) for k, v in o["dict"].items()}
        if "items" in o:
            return {dec(k): dec(v) for k, v in o["items"]}
        if "dataclass" in o:
            if o["dataclass"] not in classes:
                raise FileFormatError(f"unknown state class {o['dataclass']!r}")
            return classes[o["dataclass"]](**{k: dec(v) for k, v in o["fields"].items()})
        raise FileFormatError(f"unknown state entry {sorted(o)}")

    return dec(skeleton)


def save_state(path: str | Path, obj: Any, **metadata: Any) -> str:
    """Store ``obj`` (see :func:`encode_state`) in one safetensors file, atomically; returns
    the file's SHA-256."""
    skeleton, tensors = encode_state(obj)
    return save_tensors(path, tensors, {**metadata, "state": skeleton})


def load_state(path: str | Path, what: str = "state file", *, sha256: str | None = None,
               device: Any = None) -> tuple[Any, dict]:
    """``(obj, metadata)`` from :func:`save_state` (``device``: see :func:`decode_state`);
    errors as in :func:`load_tensors`."""
    tensors, meta = load_tensors(path, what, sha256=sha256)
    if "state" not in meta:
        raise FileFormatError(f"{what} {Path(path)} holds no partialfl state")
    try:
        obj = decode_state(meta.pop("state"), tensors, device)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError,
            RuntimeError, ArithmeticError) as e:
        raise FileFormatError(f"{what} {Path(path)} is corrupt: {str(e)[:200]}") from None
    return obj, meta
