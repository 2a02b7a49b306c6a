"""The pipeline's files: tensors (safetensors), plain JSON and the deployed model.

Every file is written atomically and holds tensors or plain JSON, never a pickle
(:mod:`partialfl.io`); a pickle-based file of an older version (``*.pt``) in the place of one
of :data:`THETA1`, :data:`THETA2`, :data:`CLIENT_STATE`, :data:`DEPLOY` is refused with a
message naming it, never loaded. ``deploy.safetensors`` (:func:`save_deploy`) holds every
tensor of a run's split model, θ and w_pre, and the split's description, so that
:func:`deployed_split` rebuilds the split from the task's own model factory (no code is loaded
from a run folder).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from partialfl import io as pio
from partialfl.build import Task
from partialfl.config import ConfigError, to_dict
from partialfl.rng import torch_seed
from partialfl.spec import RunSpec, drop_unset

if TYPE_CHECKING:  # torch is imported where a tensor is touched: writing JSON stays cheap
    import torch
    from torch import nn

    from partialfl.split import Split
    from partialfl.types import Params


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON at ``path`` (atomically; numpy arrays and scalars as lists
    and numbers)."""
    pio.write_json(path, obj, indent=1, default=json_default)


def load_params(model: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Module:
    """Copy ``params`` (name → tensor) into ``model``'s parameters of the same names; every
    name must exist in the model with the same shape."""
    import torch

    own = dict(model.named_parameters())
    bad = [n for n in params if n not in own]
    if bad:
        raise KeyError(f"the model has no parameters {bad[:5]}")
    with torch.no_grad():
        for n, v in params.items():
            if own[n].shape != v.shape:
                raise ValueError(f"parameter {n!r}: shape {tuple(v.shape)} does not fit "
                                 f"{tuple(own[n].shape)}")
            own[n].copy_(v)
    return model


def seeded_split(task: Task, model: nn.Module, kind: str, options, seed: int) -> Split:
    """Build a split with the global torch RNG seeded from (seed, "split") (adapter init)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed, "split"))
        return task.make_split(model, kind, options)


#: tensor files of the pipeline (safetensors) and the pickle-based names of older versions
THETA1, THETA2, CLIENT_STATE, DEPLOY = ("theta.safetensors", "theta_stage2.safetensors",
                                        "client_state_stage2.client-side.safetensors",
                                        "deploy.safetensors")
_LEGACY = {THETA1: "theta.pt", THETA2: "theta_stage2.pt",
           CLIENT_STATE: "client_state_stage2.pt", DEPLOY: "deploy.pt"}


def tensor_file(folder: Path, name: str) -> Path | None:
    """``folder/name`` if it exists; None if not; a pickle-based file of an older version
    (or a planted one) in its place is refused, never loaded."""
    path = folder / name
    if path.exists():
        return path
    legacy = folder / _LEGACY[name]
    if legacy.exists():
        raise pio.UnsafeFileError(
            f"{legacy} is a pickle-based file (from an older partialfl or put there by "
            f"someone else): pickle files can run arbitrary code when loaded, so it is not "
            f"loaded; delete it and re-run the stage to write {name}")
    return None


def stage1_identity(cfg: RunSpec, task_name: str) -> dict[str, Any]:
    """What stage 1's result depends on (its folder's ``config.json``): the pre-training
    stage, its seed, the task and the validation carve-out."""
    val = {"validation": to_dict(cfg.validation)} if cfg.validation is not None else {}
    return {"pretrain": drop_unset(to_dict(cfg.pretrain)), "seed": cfg.stage1_seed,
            "task": task_name, **val}


def stage2_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """The part of a run's identity (:meth:`RunSpec.identity`, or a ``config.json``) that
    stage 2 depends on: everything but stage 3 (``finetune``, ``finetune_grid``) and the
    method's ``finetune_split`` and ``label``."""
    out = {k: v for k, v in identity.items() if k not in ("finetune", "finetune_grid")}
    out["method"] = {k: v for k, v in identity.get("method", {}).items()
                     if k not in ("finetune_split", "label")}
    return out


def stamp(identity: Mapping[str, Any]) -> str:
    """SHA-256 of ``identity`` as canonical JSON: written into every stage file, so a file
    is resumed only by the configuration whose stage wrote it."""
    text = json.dumps(identity, sort_keys=True, default=json_default, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def save_stage(path: Path, tensors: Mapping[str, Any], identity: Mapping[str, Any],
               metadata: Mapping[str, Any] | None = None) -> None:
    """A stage's tensor file (atomic safetensors) stamped with its :func:`stamp`."""
    pio.save_tensors(path, tensors, {**dict(metadata or {}), "identity": stamp(identity)})


def read_params(folder: Path, name: str, like: Mapping[str, Any] | None = None,
                identity: Mapping[str, Any] | None = None) -> Params | None:
    """The tensors of ``folder/name`` (one of the pipeline's tensor files), or None. With
    ``like`` (the tensors a fresh stage would produce), the file must hold exactly its names,
    shapes and dtypes, all finite; with ``identity``, it must carry that identity's
    :func:`stamp` (:func:`save_stage`): a stage file replaced, cut down, from another model
    or from another configuration's run is refused in one line
    (:class:`partialfl.io.FileFormatError`), never resumed from."""
    path = tensor_file(folder, name)
    if path is None:
        return None
    params, meta = pio.load_tensors(path, name)
    if identity is not None and meta.get("identity") != stamp(identity):
        raise pio.FileFormatError(
            f"{path} was not written by this configuration's stage (another run's file, or "
            "one of an older partialfl); delete it to re-run its stage")
    if like is not None:
        _check_like(path, params, like)
    return params


def _check_like(path: Path, params: Mapping[str, Any], like: Mapping[str, Any]) -> None:
    import torch

    names, want = set(params), set(like)
    if names != want:
        raise pio.FileFormatError(
            f"{path} does not hold this run's parameters (missing {sorted(want - names)[:3]}, "
            f"unexpected {sorted(names - want)[:3]}); delete it to re-run its stage")
    for n, v in params.items():
        if tuple(v.shape) != tuple(like[n].shape) or v.dtype != like[n].dtype:
            raise pio.FileFormatError(
                f"{path}: {n!r} is {v.dtype} {tuple(v.shape)}, this run's is {like[n].dtype} "
                f"{tuple(like[n].shape)}; delete it to re-run its stage")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise pio.FileFormatError(f"{path}: {n!r} is not finite (a diverged or damaged "
                                      "stage); delete it to re-run its stage")


def json_default(o):
    """``json.dumps``' ``default`` for numpy arrays and scalars."""
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.floating | np.integer):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def check_or_write_json(path: Path, cfg_dict: dict, what: str) -> None:
    """Write ``cfg_dict`` to ``path`` (atomically), or, if the file exists, refuse
    (:class:`ConfigError`) unless it holds the same: a rejected re-run never overwrites it."""
    if path.exists():
        old = pio.read_json(path)
        new = json.loads(json.dumps(cfg_dict, default=json_default))
        if old != new:
            diff = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in
                             config_differences(old, new)[:3])
            raise ConfigError(f"{path.parent} already holds a {what} with a different "
                              f"configuration ({diff}); use a new folder (or delete it) to "
                              "start over")
    else:
        write_json(path, cfg_dict)


def config_differences(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``[(dotted key, old value, new value), ...]`` where two JSON configs differ (a key
    missing on one side: None there)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in config_differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [(prefix.rstrip(".") or "(all)", old, new)]



def save_deploy(run_dir: Path, split: Split, theta: Params, w_pretrained: Params | None,
                built_as: str | None = None, split_options: Mapping[str, Any] | None = None
                ) -> None:
    """``deploy.safetensors``: every tensor of the split model (``model/…``), θ
    (``theta/…``), w_pre (``w_pretrained/…``) and the split's description as JSON."""
    tensors = {f"model/{n}": v for n, v in split.model.state_dict().items()}
    tensors.update({f"theta/{n}": v for n, v in theta.items()})
    tensors.update({f"w_pretrained/{n}": v for n, v in (w_pretrained or {}).items()})
    pio.save_tensors(Path(run_dir) / DEPLOY, tensors, {
        "kind": split.kind, "global_names": list(split.global_names),
        "personal_names": list(split.personal_names),
        "built_as": built_as or split.kind, "split_options": dict(split_options or {})})


def read_deploy(run_dir: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The tensors of ``deploy.safetensors`` grouped by prefix (model, theta, w_pretrained)
    and its metadata; a missing, pickle-based or corrupt file gives a named error."""
    run_dir = Path(run_dir)
    path = tensor_file(run_dir, DEPLOY)
    if path is None:
        raise FileNotFoundError(f"{run_dir / DEPLOY} not found: run the pipeline to the end "
                                "first")
    tensors, meta = pio.load_tensors(path, "deployed model")
    groups: dict[str, dict[str, torch.Tensor]] = {"model": {}, "theta": {}, "w_pretrained": {}}
    for key, v in tensors.items():
        group, _, name = key.partition("/")
        if group not in groups:
            raise pio.FileFormatError(f"{path}: unexpected tensor {key!r}")
        groups[group][name] = v
    _check_deploy_meta(path, meta)
    return groups, meta


def _check_deploy_meta(path: Path, meta: Mapping[str, Any]) -> None:
    """The split description :func:`save_deploy` writes, with its types (a crafted file
    without ``kind`` once ended ``partialfl evaluate`` in a KeyError traceback)."""
    def names(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    ok = {"kind": isinstance(meta.get("kind"), str),
          "built_as": isinstance(meta.get("built_as", ""), str),
          "split_options": isinstance(meta.get("split_options", {}), dict),
          "global_names": names(meta.get("global_names")),
          "personal_names": names(meta.get("personal_names"))}
    bad = [k for k, v in ok.items() if not v]
    if bad:
        raise pio.FileFormatError(f"{path}: corrupt split description (bad or missing "
                                  f"{', '.join(bad)})")


def deployed_split(run_dir: Path, cfg: RunSpec, model_fn, split_fn) -> tuple:
    """``(split, θ, w_pre or None)`` of a finished run: the split rebuilt from ``model_fn`` /
    ``split_fn`` as the run built it, its tensors loaded from ``deploy.safetensors``."""
    groups, meta = read_deploy(run_dir)
    task = Task(data=None, model_fn=model_fn, split_fn=split_fn)
    model = task.model_fn(cfg.stage1_seed)
    split = seeded_split(task, model, meta.get("built_as", meta["kind"]),
                          meta.get("split_options", {}), cfg.seed)
    if (list(split.global_names), list(split.personal_names)) != (meta["global_names"],
                                                                  meta["personal_names"]):
        raise pio.FileFormatError(f"{run_dir / DEPLOY} does not fit the model: its split has "
                                  "other global/personal parameters than the one rebuilt")
    try:
        split.model.load_state_dict(groups["model"], strict=True)
    except RuntimeError as e:
        raise pio.FileFormatError(f"{run_dir / DEPLOY} does not fit the model: {e}") from None
    own = dict(split.model.named_parameters())
    _check_group(run_dir / DEPLOY, "model", groups["model"], split.model.state_dict())
    theta = _check_group(run_dir / DEPLOY, "theta", groups["theta"],
                         {n: own[n] for n in split.global_names})
    if groups["w_pretrained"]:  # w_pre: personal parameters, and the normalization
        # running statistics the problem keeps as client state (when saved)
        from partialfl.problems.model.modules import running_stat_modules

        want = {n: own[n] for n in split.personal_names}
        want.update({n: v for n, v in running_stat_modules(split.model)[1].items()
                     if n in groups["w_pretrained"]})
        w_pre = _check_group(run_dir / DEPLOY, "w_pretrained", groups["w_pretrained"], want)
        return split, theta, w_pre
    return split, theta, None


def _check_group(path: Path, group: str, got: Mapping[str, Any], want: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """``got`` cast to ``want``'s dtypes, after checking that it has exactly ``want``'s names
    and shapes, floats where they are, and finite values once cast (a θ lacking a name once
    ended ``partialfl evaluate`` in a KeyError traceback; a NaN θ scored as a model; a
    float64 θ for a float32 model was a dtype traceback)."""
    if got.keys() != want.keys():
        diff = sorted(set(got) ^ set(want))[:3]
        raise pio.FileFormatError(f"{path}: {group}/ does not fit the model's split ({diff})")
    out: dict[str, Any] = {}
    for n, v in got.items():
        if tuple(v.shape) != tuple(want[n].shape):
            raise pio.FileFormatError(f"{path}: {group}/{n} has shape {tuple(v.shape)}, the "
                                      f"model {tuple(want[n].shape)}")
        if v.is_floating_point() != want[n].is_floating_point():
            raise pio.FileFormatError(f"{path}: {group}/{n} is {v.dtype}, the model "
                                      f"{want[n].dtype}")
        out[n] = c = v.to(want[n].dtype)
        if c.is_floating_point() and not bool(c.isfinite().all()):
            raise pio.FileFormatError(f"{path}: {group}/{n} is not all finite in "
                                      f"{want[n].dtype}")
    return out


__all__ = ["CLIENT_STATE", "DEPLOY", "THETA1", "THETA2", "check_or_write_json",
           "config_differences", "deployed_split", "json_default", "load_params",
           "read_deploy", "read_params", "save_deploy", "save_stage", "seeded_split",
           "stage1_identity", "stage2_identity", "stamp", "tensor_file", "write_json"]
