"""ServerApp checkpoints: safe formats only (safetensors for arrays, JSON for the rest; never
pickle), written atomically, validated against the run's configuration on resume.

A checkpoint in ``out-dir`` is two files: ``checkpoint-<round>.safetensors`` (θ as
``theta/<name>``, the server optimizer's arrays as ``opt/<path>``) and ``checkpoint.json``
(format, the run config, the next round to run, the optimizer's non-array state, the
algorithm's counters, the report so far, and the SHA-256 of the tensor file). The JSON file is
written last (temp file + rename): it is the commit point, so a crash mid-write leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.arrays import is_torch, to_numpy, to_torch
from partialfl.flower.config import VOLATILE, ConfigError, FlowerConfig

FORMAT = "partialfl-flower-checkpoint/2"


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged, or written by another configuration."""


_np = to_numpy


def _split(tree: Any, prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    """JSON skeleton of a nested dict/list of arrays and scalars; arrays go to ``arrays``."""
    if isinstance(tree, dict):
        return {"dict": {str(k): _split(v, f"{prefix}/{k}", arrays) for k, v in tree.items()}}
    if isinstance(tree, list | tuple):
        return {"list": [_split(v, f"{prefix}/{i}", arrays) for i, v in enumerate(tree)]}
    if tree is None or isinstance(tree, bool | int | float | str):
        return {"value": tree}
    if hasattr(tree, "shape"):
        arrays[prefix] = np.ascontiguousarray(_np(tree))
        return {"array": prefix, "torch": is_torch(tree)}
    raise CheckpointError(f"cannot checkpoint server state of type {type(tree).__name__} at "
                          f"{prefix!r} (only arrays, numbers, strings, lists and dicts)")


def _join(skel: Any, arrays: dict[str, np.ndarray]) -> Any:
    if "dict" in skel:
        return {k: _join(v, arrays) for k, v in skel["dict"].items()}
    if "list" in skel:
        return [_join(v, arrays) for v in skel["list"]]
    if "value" in skel:
        return skel["value"]
    arr = arrays[skel["array"]]
    return to_torch(arr) if skel.get("torch") else arr


def _show(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def _compare(cfg: FlowerConfig, saved: dict[str, Any]) -> None:
    now = cfg.fingerprint()
    old = {" ".join(str(k).split())[:60]: v for k, v in saved.items() if k not in VOLATILE}
    diff = sorted(k for k in set(now) | set(old) if now.get(k) != old.get(k))
    if diff:
        shown = ", ".join(f"{k}: checkpoint {_show(old.get(k))} vs now {_show(now.get(k))}"
                          for k in diff[:6])
        raise CheckpointError(f"refusing to resume: the checkpoint in {cfg.out_dir} was "
                              f"written by another configuration ({shown})")


def save(cfg: FlowerConfig, state, next_round: int, report: dict[str, Any]) -> Path:
    """Write the checkpoint of ``state`` (rounds < ``next_round`` done) into ``cfg.out_dir``."""
    from safetensors.numpy import save as st_save


    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    skel = {"theta": _split(dict(state.theta), "theta", arrays),
            "opt": _split(state.opt_state, "opt", arrays),
            "extra": _split(dict(state.extra), "extra", arrays)}
    blob = st_save(arrays) if arrays else st_save({"_": np.zeros(0)})
    name = f"checkpoint-{next_round}.safetensors"
    pio.write_bytes(out / name, blob)
    meta = {"format": FORMAT, "config": cfg.fingerprint(), "next_round": int(next_round),
            "state_round": int(state.round), "state": skel, "tensors": name,
            "sha256": hashlib.sha256(blob).hexdigest(), "report": report}
    pio.write_bytes(out / "checkpoint.json", json.dumps(meta, default=float).encode())
    for old in out.glob("checkpoint-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return out / "checkpoint.json"


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CheckpointError(f"checkpoint {what} must be an integer >= 0, got "
                              f"{str(v)[:40]!r}")
    return v


def _skeleton(skel: Any, arrays: dict[str, np.ndarray], depth: int = 0) -> None:
    """Raise unless ``skel`` is what :func:`_split` writes, over arrays in ``arrays``."""
    if depth > 32 or not isinstance(skel, dict) or len(skel) not in (1, 2):
        raise CheckpointError("checkpoint state is not a partialfl state tree")
    kind = next(iter(skel))
    if kind == "dict" and isinstance(skel[kind], dict) and len(skel) == 1:
        for v in skel[kind].values():
            _skeleton(v, arrays, depth + 1)
    elif kind == "list" and isinstance(skel[kind], list) and len(skel) == 1:
        for v in skel[kind]:
            _skeleton(v, arrays, depth + 1)
    elif kind == "value" and len(skel) == 1:
        if not (skel[kind] is None or isinstance(skel[kind], bool | int | float | str)):
            raise CheckpointError("checkpoint state holds a value that is not a scalar")
    elif kind == "array" and set(skel) <= {"array", "torch"} and isinstance(skel[kind], str):
        if skel[kind] not in arrays or not isinstance(skel.get("torch", False), bool):
            raise CheckpointError(f"checkpoint state names a missing array {skel[kind][:80]!r}")
    else:
        raise CheckpointError("checkpoint state is not a partialfl state tree")


def signature(tree: Any) -> Any:
    """The structure of a state tree: dict keys, list lengths, array shapes and dtypes, scalar
    types (what a resumed state must share with a fresh one)."""
    if isinstance(tree, dict):
        return {str(k): signature(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [signature(v) for v in tree]
    if hasattr(tree, "shape"):
        a = _np(tree)
        return ("array", tuple(a.shape), a.dtype.str, is_torch(tree))
    return type(tree).__name__


#: what a failure recorded in a checkpoint holds (:class:`partialfl.flower.report.Failure`)
FAILURE_FIELDS = {"round": int, "kind": str, "partition": int, "clients": list, "reason": str}


def check_report(rep: Any, counters: tuple[str, ...], what: str = "checkpoint") -> dict:
    """``rep`` if it is a saved report: ``failures`` (a list of failure records), the
    integer ``counters`` and, when present, ``history`` (a list of dicts); else
    :class:`CheckpointError`."""
    if not isinstance(rep, dict):
        raise CheckpointError(f"{what} report is not a dict")
    fails = rep.get("failures")
    if not isinstance(fails, list) or not all(
            isinstance(f, dict) and set(f) == set(FAILURE_FIELDS)
            and all(isinstance(f[k], t) and not isinstance(f[k], bool)
                    for k, t in FAILURE_FIELDS.items())
            and all(isinstance(c, int) for c in f["clients"]) for f in fails):
        raise CheckpointError(f"{what} report has malformed failures")
    if "history" in rep and not (isinstance(rep["history"], list)
                                 and all(isinstance(h, dict) for h in rep["history"])):
        raise CheckpointError(f"{what} report has a malformed history")
    for k in counters:
        if k not in rep or isinstance(rep[k], bool) or not isinstance(rep[k], int):
            raise CheckpointError(f"{what} report lacks the integer {k!r}")
    return rep


def load(cfg: FlowerConfig, like=None) -> tuple[Any, int, dict[str, Any]]:
    """``(state, next_round, report)`` from ``cfg.out_dir``, validated (format, hash,
    configuration, the structure of every part; with ``like``, a fresh state, θ and the
    optimizer state must have its :func:`signature`); raises :class:`CheckpointError` (one
    line) naming what is wrong, whatever the files hold."""
    try:
        return _load(cfg, like)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OSError) as e:
        path = Path(cfg.out_dir) / "checkpoint.json"
        raise CheckpointError(f"checkpoint {path} is malformed ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None


def _load(cfg: FlowerConfig, like) -> tuple[Any, int, dict[str, Any]]:
    from safetensors import SafetensorError
    from safetensors.numpy import load as st_load

    from partialfl.algorithms.base import ServerState

    path = Path(cfg.out_dir) / "checkpoint.json"
    if not path.is_file():
        raise CheckpointError(f"run-config key 'resume': no checkpoint at {path}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"checkpoint {path} is not valid JSON: {msg}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file")
    want = {"config": dict, "tensors": str, "sha256": str, "state": dict, "report": dict}
    bad = sorted(k for k, t in want.items() if not isinstance(meta.get(k), t))
    if bad:
        raise CheckpointError(f"checkpoint {path} lacks or has malformed entries {bad}")
    _compare(cfg, meta["config"])
    name = meta["tensors"]
    tensors = path.parent / name
    if Path(name).name != name or name in ("", ".", "..") or not tensors.is_file():
        raise CheckpointError(f"checkpoint {path} names a missing tensor file {name[:80]!r}")
    blob = tensors.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise CheckpointError(f"checkpoint tensor file {tensors} does not match its SHA-256 "
                              "(damaged or replaced)")
    try:
        arrays = st_load(blob)
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"checkpoint tensor file {tensors} is not valid: {e}") from None
    sk = meta["state"]
    if set(sk) != {"theta", "opt", "extra"}:
        raise CheckpointError(f"checkpoint {path} state must have theta, opt and extra")
    for part in sk.values():
        _skeleton(part, arrays)
    state = ServerState(theta=_join(sk["theta"], arrays), opt_state=_join(sk["opt"], arrays),
                        round=_int(meta.get("state_round"), "state_round"),
                        extra=_join(sk["extra"], arrays))
    if not isinstance(state.theta, dict) or not isinstance(state.extra, dict):
        raise CheckpointError(f"checkpoint {path}: θ and the extras must be dicts")
    if like is not None:
        for part, got, ref in (("θ", state.theta, like.theta),
                               ("optimizer state", state.opt_state, like.opt_state)):
            if signature(got) != signature(ref):
                raise CheckpointError(f"checkpoint {path}: the {part} differs in structure, "
                                      "shape or dtype from this run's model and optimizer")
        for k, v in state.extra.items():  # the algorithm's own, or counters it adds later
            if k in like.extra and signature(v) != signature(like.extra[k]) or \
                    k not in like.extra and (type(v) not in (int, float) or v != v):
                raise CheckpointError(f"checkpoint {path}: algorithm state {k[:40]!r} differs "
                                      "from this run's")
    if not all(np.isfinite(_np(v)).all() for v in state.theta.values()):
        raise CheckpointError(f"checkpoint {path}: θ is not finite")
    report = check_report(meta["report"], ("skipped_rounds", "requested", "grads"),
                          f"checkpoint {path}")
    if "history" not in report:
        raise CheckpointError(f"checkpoint {path} report lacks its history")
    return state, _int(meta.get("next_round"), "next_round"), report
