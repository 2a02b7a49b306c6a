"""The one checkpoint codec of the runtimes: crash-consistent, pickle-free, fingerprinted.

A checkpoint named ``path`` is a set of *generations*; generation g is

* ``<stem>.g<g>.server<suffix>`` — the server's part: what the loop saves as server state
  (θ, optimizer state, history, counters, ...) and a transport's own bookkeeping
  (``extra``, e.g. the Flower ServerApp's report);
* ``<stem>.g<g>.client-side<suffix>`` — the clients' part (their state, e.g. FedAlt's w_m,
  Scaffold's c_m): held by the clients in a deployment, never in the server's file. Only
  with ``private=False`` (an explicit choice) does it go into the server file instead;

and ``path`` itself is the *pointer*: a small safetensors file whose metadata names the
current generation, the SHA-256 of each of its files, the loop's progress (round / step)
and the run's fingerprint. Every file is safetensors + JSON (:mod:`partialfl.io`; never a
pickle), written atomically.

Crash consistency. :meth:`Checkpoint.save` writes every file of generation g+1 under its
new name (temp file, fsync, rename), fsyncs the folder, then switches the pointer with ONE
atomic ``os.replace`` (+ fsync of the folder): that rename is the commit point. Only then
are the older generations removed. A kill at any instant therefore leaves either the
previous generation or the new one, complete and consistent; temp files of a killed write
and generations the pointer does not name are removed when the checkpoint is next opened
(:meth:`Checkpoint.clean`, called by :meth:`load` and :meth:`save`).

Resuming checks the pointer's fingerprint against the run's (:func:`run_fingerprint`:
problem, algorithm, seed, cohort size, configuration) and raises :class:`ResumeError`
naming what differs; a damaged or replaced file fails its SHA-256 check
(:class:`~partialfl.io.FileFormatError`). Tensors come back on the current device
(:func:`partialfl.io.decode_state`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import arrays
from partialfl import io as pio

FORMAT = "partialfl-checkpoint-3"
#: the roles of a generation's files
SERVER, CLIENT = "server", "client-side"


class ResumeError(ValueError):
    """A checkpoint does not belong to the run that tries to resume it."""


# --------------------------------------------------------------------------- fingerprint
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
#: attributes that are not part of a run's identity: the device (a run resumes on another one)
#: and state that changes while training (fp16 loss scaling)
_NOT_IDENTITY = frozenset({"device", "scaler"})


def _key(item: tuple) -> str:
    """A dict item's sort key: its key as text (not the item: ``str`` of an array value
    prints the array, the larger part of a problem's description time)."""
    return str(item[0])


def _sha256(buf: memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()[:16]


def _crc32(buf: memoryview) -> str:
    return f"{zlib.crc32(buf):08x}"


def _describe(o: Any, depth: int = 0, fast: bool = False) -> Any:
    """A stable, JSON-able description of a configuration object: public attributes,
    recursively; arrays by shape, dtype and a hash of their bytes (SHA-256; ``fast``: CRC-32);
    functions by name. ``fast`` describes one process's objects for a change check, so
    functions and modules also by identity and function-valued attributes too (a swapped
    ``loss_fn`` is a change); otherwise what is stable across processes only."""
    if o is None or isinstance(o, bool | int | str):
        return o
    if isinstance(o, float):
        return repr(o)
    if isinstance(o, np.generic):
        return repr(o.item())
    if arrays.is_array(o):
        a = np.ascontiguousarray(arrays.to_numpy(o))
        try:  # the bytes in place (no copy)
            buf = memoryview(a.reshape(-1)).cast("B")
        except (ValueError, TypeError):  # a dtype without a buffer format (datetime64)
            buf = memoryview(a.tobytes())
        return [list(a.shape), str(a.dtype), (_crc32 if fast else _sha256)(buf)]
    here = f"@{id(o):x}" if fast else ""
    if depth > 4:
        return type(o).__qualname__ + here
    if isinstance(o, dict):
        return {str(k): _describe(v, depth + 1, fast) for k, v in sorted(o.items(), key=_key)}
    if isinstance(o, list | tuple):
        return [_describe(v, depth + 1, fast) for v in o]
    if isinstance(o, _FUNCTIONS) or isinstance(o, type):
        return getattr(o, "__qualname__", type(o).__qualname__) + here
    if hasattr(o, "named_parameters"):  # a torch module: its architecture, not its values
        return [type(o).__qualname__ + here,
                [(n, list(p.shape)) for n, p in o.named_parameters()]]
    attrs = getattr(o, "__dict__", None)
    if attrs is None:
        return type(o).__qualname__ + here
    return {"class": type(o).__qualname__,
            **{k: _describe(v, depth + 1, fast) for k, v in sorted(attrs.items())
               if not k.startswith("_") and k not in _NOT_IDENTITY
               and (fast or not isinstance(v, _FUNCTIONS))}}


def content_digest(o: Any, fast: bool = False) -> str:
    """A short hash of :func:`_describe` (o): its settings and its arrays' bytes — what a run
    fingerprint compares (SHA-256), and, ``fast`` (arrays by CRC-32, functions and modules by
    identity: a change check within this process, not a tamper check), what a worker pool
    compares before reusing its copy of a problem."""
    desc = _describe(o, fast=fast)
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str)
                          .encode()).hexdigest()[:16]


def run_fingerprint(problem, algorithm, seed: int, clients_per_round: int | None,
                    extra: dict | None = None) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the problem (its data and settings), the
    algorithm (its solver, optimizer, aggregator and hyper-parameters), the seed and the
    cohort size (plus ``extra``, e.g. a configuration dict)."""
    return {"problem": f"{type(problem).__qualname__}:{content_digest(problem)}",
            "algorithm": f"{algorithm.name}:{content_digest(algorithm)}", "seed": int(seed),
            "clients_per_round": clients_per_round, "num_clients": int(problem.num_clients),
            **({"config": content_digest(extra)} if extra else {})}


def check_fingerprint(path: Path, old: dict | None, fingerprint: dict | None) -> None:
    """A :class:`ResumeError` naming what differs when a checkpoint's fingerprint ``old`` is
    not the run's ``fingerprint``."""
    if fingerprint is not None and old is not None and old != fingerprint:
        diff = [f"{k}: {old.get(k)!r} in the checkpoint, {fingerprint.get(k)!r} now"
                for k in sorted(set(old) | set(fingerprint)) if old.get(k) != fingerprint.get(k)]
        raise ResumeError(f"checkpoint {path} belongs to a different run ({'; '.join(diff)}); "
                          "use a new checkpoint path (or delete it) to start over")


# --------------------------------------------------------------------------- the codec
@dataclass
class Saved:
    """One generation of a checkpoint: the ``server`` part, the ``client`` (client-side)
    part, the transport's ``extra`` bookkeeping and the loop's ``progress`` label."""

    server: Any
    client: Any = None
    extra: Any = None
    progress: dict[str, Any] = field(default_factory=dict)
    generation: int = 0


#: why a checkpoint file may not be a symbolic link
_OWN_FOLDER = "a checkpoint is read only from its own run folder"


class Checkpoint:
    """The checkpoint at ``path`` (the pointer; see the module docstring) of a ``kind`` of
    loop (``"sync"``, ``"async"``, or a transport's own), validated against
    ``fingerprint`` (None: not checked); ``private``: the client part in its own
    client-side file (default) or, explicitly, in the server file."""

    def __init__(self, path: str | Path, fingerprint: dict | None = None, *,
                 kind: str = "sync", private: bool = True) -> None:
        self.path, self.fingerprint = Path(path), fingerprint
        self.kind, self.private = kind, bool(private)
        stem, suffix = re.escape(self.path.stem), re.escape(self.path.suffix)
        self._gen = re.compile(rf"^{stem}\.g(\d+)\.(server|client-side){suffix}$")
        names = rf"{re.escape(self.path.name)}|{stem}\.g\d+\.(?:server|client-side){suffix}"
        self._tmp = re.compile(rf"^\.(?:{names})\.[A-Za-z0-9_]+\.tmp$")

    def __str__(self) -> str:
        return str(self.path)

    def file(self, generation: int, role: str) -> Path:
        """The file of ``generation`` in ``role`` (:data:`SERVER` or :data:`CLIENT`)."""
        return self.path.with_name(f"{self.path.stem}.g{generation}.{role}{self.path.suffix}")

    def exists(self) -> bool:
        """Whether a generation was committed (the pointer exists)."""
        return self.path.is_file()

    def files(self) -> dict[str, Path]:
        """The current generation's files by role (empty if there is none)."""
        if not self.exists():
            return {}
        ptr = self._pointer()
        return {role: self.path.with_name(f["name"]) for role, f in ptr["files"].items()}

    # -- writing -------------------------------------------------------------------------
    def save(self, server: Any, client: Any = None, *, extra: Any = None,
             progress: dict[str, Any] | None = None) -> int:
        """Commit a new generation (see the module docstring); returns its number.
        ``server``, ``client``, ``extra``: anything :func:`partialfl.io.encode_state`
        stores; ``progress``: a small JSON label (e.g. ``{"round": r}``)."""
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True)
        g = 1 + max([self._current(), *self._generations()], default=0)
        progress = dict(progress or {})
        files: dict[str, dict[str, str]] = {}
        body: dict[str, Any] = {"server": server, "extra": extra}
        if self.private and client is not None:
            f = self.file(g, CLIENT)
            files[CLIENT] = {"name": f.name, "sha256": pio.save_state(
                f, client, side="client", kind=self.kind, generation=g, **progress,
                note="client-side state: stays on the clients")}
        else:
            body["client"] = client
        f = self.file(g, SERVER)
        files[SERVER] = {"name": f.name, "sha256": pio.save_state(
            f, body, side="server", kind=self.kind, generation=g, **progress)}
        pio.fsync_dir(folder)  # the generation's files are durable before the commit
        pio.save_tensors(self.path, {}, {"format": FORMAT, "kind": self.kind,
                                         "generation": g, "fingerprint": self.fingerprint,
                                         "private": self.private, "progress": progress,
                                         "files": files})
        pio.fsync_dir(folder)  # the commit point
        self.clean()
        return g

    # -- reading -------------------------------------------------------------------------
    def load(self, device=None) -> Saved | None:
        """The committed generation (after :meth:`clean`), None if there is none; raises
        :class:`ResumeError` (another run), :class:`~partialfl.io.FileFormatError`
        (damaged, another kind or format). Tensors go to ``device`` (None: see
        :func:`partialfl.io.decode_state`)."""
        if not self.path.parent.is_dir():
            return None
        self.clean()
        if not self.exists():
            return None
        ptr = self._pointer()
        check_fingerprint(self.path, ptr.get("fingerprint"), self.fingerprint)
        files = ptr.get("files", {})
        if SERVER not in files:
            raise pio.FileFormatError(f"checkpoint {self.path} names no server file")
        body = self._read(files[SERVER], "checkpoint server file", device)
        client = (self._read(files[CLIENT], "client-side checkpoint file", device)
                  if CLIENT in files else body.get("client"))
        return Saved(body.get("server"), client, body.get("extra"),
                     dict(ptr.get("progress", {})), int(ptr["generation"]))

    def _pointer(self) -> dict[str, Any]:
        pio.refuse_link(self.path, _OWN_FOLDER)
        _, meta = pio.load_tensors(self.path, "checkpoint")
        if meta.get("format") != FORMAT:
            raise pio.FileFormatError(f"checkpoint {self.path} has format "
                                      f"{meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("kind") != self.kind:
            raise pio.FileFormatError(f"checkpoint {self.path} is of a {meta.get('kind')!r} "
                                      f"run, not a {self.kind!r} one")
        if not isinstance(meta.get("generation"), int) or not isinstance(meta.get("files"),
                                                                         dict) \
                or not isinstance(meta.get("fingerprint"), dict | None) \
                or not isinstance(meta.get("progress", {}), dict):
            raise pio.FileFormatError(f"checkpoint {self.path} has a corrupt pointer")
        g = meta["generation"]
        for entry in meta["files"].values():  # the files are the generation's: clean() keeps
            if not isinstance(entry, dict):    # only those
                raise pio.FileFormatError(f"checkpoint {self.path} has a corrupt pointer")
            name = str(entry.get("name", ""))
            if (m := self._gen.match(name)) is None:  # never follow a name out of it
                raise pio.FileFormatError(f"checkpoint {self.path} names a foreign file "
                                          f"{name!r}")
            if isinstance(g, bool) or int(m.group(1)) != g:
                raise pio.FileFormatError(f"checkpoint {self.path} has a corrupt pointer "
                                          f"(generation {g!r} does not name its files)")
        return meta

    def _read(self, entry: Any, what: str, device) -> Any:
        if not isinstance(entry, dict):
            raise pio.FileFormatError(f"checkpoint {self.path} has a corrupt pointer")
        name = str(entry.get("name", ""))
        if not self._gen.match(name):  # never follow a name out of this checkpoint
            raise pio.FileFormatError(f"checkpoint {self.path} names a foreign file {name!r}")
        sha = entry.get("sha256")
        if not isinstance(sha, str):
            raise pio.FileFormatError(f"checkpoint {self.path} gives no SHA-256 for {name}")
        pio.refuse_link(self.path.with_name(name), _OWN_FOLDER)
        obj, _ = pio.load_state(self.path.with_name(name), what, sha256=sha, device=device)
        if not isinstance(obj, dict):
            raise pio.FileFormatError(f"{what} {name} of checkpoint {self.path} is corrupt")
        return obj

    # -- housekeeping ----------------------------------------------------------------------
    def _current(self) -> int:
        """The committed generation's number (0: none, or an unreadable pointer)."""
        try:
            return int(self._pointer()["generation"]) if self.exists() else 0
        except (pio.FileFormatError, FileNotFoundError, ValueError):
            return 0

    def _generations(self) -> list[int]:
        folder = self.path.parent
        if not folder.is_dir():
            return []
        return [int(m.group(1)) for f in folder.iterdir() if (m := self._gen.match(f.name))]

    def clean(self) -> list[Path]:
        """Remove temp files of killed writes and the generations the pointer does not name
        (an unreadable pointer removes nothing); returns what was removed."""
        folder = self.path.parent
        if not folder.is_dir():
            return []
        keep = self._current() if self.exists() else 0
        if self.exists() and keep == 0:
            return []  # an unreadable pointer: leave everything for the user to inspect
        gone = []
        for f in folder.iterdir():
            m = self._gen.match(f.name)
            if self._tmp.match(f.name) or (m and int(m.group(1)) != keep):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f)
                    gone.append(f)
        return gone

