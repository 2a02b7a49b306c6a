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
from partialfl.flower.config import ConfigError, FlowerConfig

FORMAT = "partialfl-flower-checkpoint/1"
#: run-config keys that may differ between the interrupted run and its resumption
VOLATILE = ("out-dir", "resume", "checkpoint-every", "fault-injection", "round-timeout",
            "poll-interval", "min-nodes", "node-wait-timeout", "max-failure-fraction")


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


def _compare(cfg: FlowerConfig, saved: dict[str, Any]) -> None:
    now = {k: v for k, v in cfg.to_run_config().items() if k not in VOLATILE}
    old = {k: v for k, v in saved.items() if k not in VOLATILE}
    diff = sorted(k for k in set(now) | set(old) if now.get(k) != old.get(k))
    if diff:
        shown = ", ".join(f"{k}: checkpoint {old.get(k)!r} vs now {now.get(k)!r}"
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
    meta = {"format": FORMAT, "config": cfg.to_run_config(), "next_round": int(next_round),
            "state_round": int(state.round), "state": skel, "tensors": name,
            "sha256": hashlib.sha256(blob).hexdigest(), "report": report}
    pio.write_bytes(out / "checkpoint.json", json.dumps(meta, default=float).encode())
    for old in out.glob("checkpoint-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return out / "checkpoint.json"


def load(cfg: FlowerConfig) -> tuple[Any, int, dict[str, Any]]:
    """``(state, next_round, report)`` from ``cfg.out_dir``, validated (format, hash,
    configuration); raises :class:`CheckpointError` naming what is wrong."""
    from safetensors import SafetensorError
    from safetensors.numpy import load as st_load

    from partialfl.algorithms.base import ServerState

    path = Path(cfg.out_dir) / "checkpoint.json"
    if not path.is_file():
        raise CheckpointError(f"run-config key 'resume': no checkpoint at {path}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file")
    _compare(cfg, meta["config"])
    tensors = path.parent / str(meta["tensors"])
    if Path(meta["tensors"]).name != meta["tensors"] or not tensors.is_file():
        raise CheckpointError(f"checkpoint {path} names a missing tensor file {meta['tensors']!r}")
    blob = tensors.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise CheckpointError(f"checkpoint tensor file {tensors} does not match its SHA-256 "
                              "(damaged or replaced)")
    try:
        arrays = st_load(blob)
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"checkpoint tensor file {tensors} is not valid: {e}") from None
    sk = meta["state"]
    state = ServerState(theta=_join(sk["theta"], arrays), opt_state=_join(sk["opt"], arrays),
                        round=int(meta["state_round"]), extra=_join(sk["extra"], arrays))
    return state, int(meta["next_round"]), meta["report"]
