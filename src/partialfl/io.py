"""Safe, atomic files: the only way partialfl writes and reads its own files.

* **Atomic writes.** :func:`atomic_write` writes a temporary file next to the target and
  ``os.replace``-s it into place, so an interrupted write never leaves a truncated file and
  never clobbers the previous version (every write in ``src`` goes through it).
* **No code from files.** Nothing is ever unpickled. Tensors (numpy or torch) are stored with
  `safetensors <https://huggingface.co/docs/safetensors>`_ (:func:`save_tensors`,
  :func:`load_tensors`); structured state (a server state with its optimizer state, a metric
  history) is *encoded* into plain JSON plus named tensors (:func:`encode_state`): only
  None/bool/int/float/str, lists, tuples, dicts, numpy/torch arrays and an explicit allowlist
  of partialfl dataclasses (:data:`STATE_CLASSES`) can be stored or restored. A pickle or
  ``torch.save`` file — which may run arbitrary code when loaded — is refused with
  :class:`UnsafeFileError`; a truncated or corrupt file gives :class:`FileFormatError`; both
  name the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from partialfl import arrays


class FileFormatError(ValueError):
    """A file is truncated, corrupt or not in the format expected (the message names it)."""


class UnsafeFileError(FileFormatError):
    """A file is in a format that can execute code when loaded (pickle, ``torch.save``)."""


# --------------------------------------------------------------------------- atomic writes
@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", **kw: Any) -> Iterator[IO]:
    """Open a temporary file in ``path``'s folder for writing; on success it replaces
    ``path`` atomically (``os.replace``), on an exception it is removed and ``path`` is left
    as it was. The parent folder is created."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_json(path: str | Path, obj: Any, **dumps_kw: Any) -> None:
    write_text(path, json.dumps(obj, **dumps_kw))


def read_json(path: str | Path) -> Any:
    """JSON from ``path``; a missing file gives FileNotFoundError, a bad one FileFormatError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileFormatError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from None


def savefig(fig, path: str | Path, **kw: Any) -> None:
    """``fig.savefig`` through :func:`atomic_write` (format from the suffix)."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or "png", **kw)


# --------------------------------------------------------------------------- tensors
_PICKLE_HINT = ("it can run arbitrary code when loaded, so partialfl refuses it; re-create it "
                "with this version of partialfl (tensors are stored with safetensors)")


def _check_safetensors_header(path: Path, data: bytes) -> dict:
    """Parse the safetensors header (8-byte little-endian length, then JSON) or raise.

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
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FileFormatError(f"{path} has a corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end > len(data):
        raise FileFormatError(f"{path} is truncated: {len(data)} bytes, the header announces "
                              f"{8 + n + end}")
    return header


_to_torch = arrays.to_torch


def save_tensors(path: str | Path, tensors: Mapping[str, Any],
                 metadata: Mapping[str, Any] | None = None) -> None:
    """Store named numpy arrays / torch tensors (and JSON ``metadata``) atomically as a
    safetensors file; :func:`load_tensors` gives back the same kinds (numpy stays numpy)."""
    from safetensors.torch import save

    kinds = {n: "torch" if arrays.is_torch(v) else "numpy" for n, v in tensors.items()}
    meta = {"partialfl": json.dumps({"kinds": kinds, "metadata": dict(metadata or {})})}
    data = save({n: _to_torch(v) for n, v in tensors.items()}, metadata=meta)
    write_bytes(path, data)


def load_tensors(path: str | Path, what: str = "tensor file") -> tuple[dict[str, Any], dict]:
    """``(tensors, metadata)`` from a file written by :func:`save_tensors`. Missing:
    FileNotFoundError; pickle / torch.save: :class:`UnsafeFileError`; truncated or corrupt:
    :class:`FileFormatError` (each names ``path`` and ``what`` it should be)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found")
    data = path.read_bytes()
    header = _check_safetensors_header(path, data)
    try:
        tensors = load(data)
        info = json.loads(header.get("__metadata__", {}).get("partialfl", "{}"))
    except (SafetensorError, json.JSONDecodeError, ValueError) as e:
        raise FileFormatError(f"{what} {path} is corrupt: {e}") from None
    kinds = info.get("kinds", {})
    out = {n: (t.numpy() if kinds.get(n) == "numpy" else t) for n, t in tensors.items()}
    return out, info.get("metadata", {})


# --------------------------------------------------------------------------- state codec
def _state_classes() -> dict[str, type]:
    from partialfl.algorithms.base import ServerState
    from partialfl.types import ClientUpdates

    return {"ServerState": ServerState, "ClientUpdates": ClientUpdates}


#: the dataclasses :func:`decode_state` may rebuild (by name, from plain fields)
STATE_CLASSES = ("ServerState", "ClientUpdates")


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
        if dataclasses.is_dataclass(o) and name in STATE_CLASSES:
            return {"dataclass": name, "fields": {f.name: enc(getattr(o, f.name),
                                                              f"{where}.{f.name}")
                                                  for f in dataclasses.fields(o)}}
        raise TypeError(f"cannot store {where} of type {name} in a safe state file "
                        f"(allowed: numbers, strings, lists, dicts, arrays, "
                        f"{', '.join(STATE_CLASSES)})")

    return enc(obj, "state"), tensors


def decode_state(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """Inverse of :func:`encode_state` (tensors back on their recorded device)."""
    classes = _state_classes()

    def dec(o: Any) -> Any:
        if not isinstance(o, dict):
            return o
        if "float" in o:
            return float(o["float"])
        if "scalar" in o:
            return np.dtype(o["scalar"]).type(dec(o["value"]))
        if "tensor" in o:
            t = tensors[o["tensor"]]
            return t.to(o["device"]) if o.get("device") not in (None, "cpu") else t
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


def save_state(path: str | Path, obj: Any, **metadata: Any) -> None:
    """Store ``obj`` (see :func:`encode_state`) in one safetensors file, atomically."""
    skeleton, tensors = encode_state(obj)
    save_tensors(path, tensors, {**metadata, "state": skeleton})


def load_state(path: str | Path, what: str = "state file") -> tuple[Any, dict]:
    """``(obj, metadata)`` from :func:`save_state`; errors as in :func:`load_tensors`."""
    tensors, meta = load_tensors(path, what)
    if "state" not in meta:
        raise FileFormatError(f"{what} {Path(path)} holds no partialfl state")
    try:
        obj = decode_state(meta.pop("state"), tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise FileFormatError(f"{what} {Path(path)} is corrupt: {e}") from None
    return obj, meta
