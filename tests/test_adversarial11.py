"""Adversarial round 11 (issue 21): regression tests for what the eleventh independent round
found (a reviewer who did not write the fixes), in the data store and the files partialfl
reads and writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from partialfl.data.store import StoreWriter, open_store


def _write(path: Path, overwrite: bool = False) -> None:
    with StoreWriter(path, num_classes=2, overwrite=overwrite) as w:
        w.add("a", np.zeros((2, 3), np.float32), np.zeros(2, np.int64),
              np.zeros((1, 3), np.float32), np.zeros(1, np.int64))


def test_overwrite_never_deletes_a_folder_that_is_not_a_store(tmp_path):
    """``StoreWriter(overwrite=True)`` (``partialfl data convert ... --overwrite``) moved
    whatever ``path`` named aside and ``rmtree``-d it: a user's folder given as ``--out`` lost
    all its files, and a plain file there was left behind as ``.NAME.old-…``. Now only a
    client store (or an empty folder) is replaced; anything else is refused, untouched, in
    one line, and the CLI exits 2 naming it."""
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.txt").write_text("irreplaceable")
    with pytest.raises(FileExistsError, match="not a client store"):
        _write(mine, overwrite=True)
    assert (mine / "chapter1.txt").read_text() == "irreplaceable"
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(FileExistsError, match="not a folder"):
        _write(afile, overwrite=True)
    assert afile.read_text() == "mine"
    store = tmp_path / "store"
    _write(store)
    link = tmp_path / "link"
    link.symlink_to(store)
    with pytest.raises(FileExistsError, match="symlink"):
        _write(link, overwrite=True)
    assert link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "notes.txt", "store",
                                                          "thesis"]
    _write(store, overwrite=True)  # a store, and an empty folder, are still replaced
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty", overwrite=True)
    assert open_store(tmp_path / "empty").num_clients == 1
    leaf = tmp_path / "all_data"
    leaf.mkdir()
    users = {f"u{i}": {"x": [[0.5] * 784] * 4, "y": [i, 1, 2, 3]} for i in range(3)}
    (leaf / "d.json").write_text(json.dumps({"users": list(users), "num_samples": [4] * 3,
                                             "user_data": users}))
    r = subprocess.run([sys.executable, "-m", "partialfl", "data", "convert", "leaf-json",
                        str(leaf), str(mine), "--overwrite", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert (mine / "chapter1.txt").read_text() == "irreplaceable"
    assert r.returncode == 2 and "not a client store" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "partialfl", "data", "convert", "leaf-json",
                        str(leaf), str(store), "--overwrite", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and open_store(store).num_clients == 3, r.stderr


def _saved_models(d: Path):
    import torch
    from torch import nn

    from partialfl.pipeline.deploy import PersonalizedModels
    from partialfl.split import build_split

    def net():
        return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))

    split = build_split(net(), "output", {})
    ps = dict(split.model.named_parameters())
    theta = {n: ps[n].detach() for n in split.global_names}
    w = {n: torch.stack([ps[n].detach()] * 2) for n in split.personal_names}
    PersonalizedModels(split, theta, w, ["a", "b"]).save(d)
    return net


def test_a_saved_model_finite_only_in_float64_is_refused(tmp_path):
    """``load_personalized`` checked the saved values' finiteness in their own dtype: a θ
    saved as float64 ``1e300`` passed and became ``inf`` in the float32 module, returned as
    a model to deploy. Now values are checked in the module's dtype."""
    from partialfl import io as pio
    from partialfl.pipeline.deploy import load_personalized

    net = _saved_models(tmp_path)
    theta, _ = pio.load_tensors(tmp_path / "theta.safetensors")
    pio.save_tensors(tmp_path / "theta.safetensors",
                     {n: v.double() * 1e300 for n, v in theta.items()})
    with pytest.raises(ValueError, match="not all finite in the module's dtype"):
        load_personalized(tmp_path, net(), "a")


@pytest.mark.parametrize("edit", [
    lambda i: i.__setitem__("clients", 5),
    lambda i: i.__setitem__("clients", [5]),
    lambda i: i["clients"][0].__setitem__("file", 7),
    lambda i: i.pop("theta_file"),
    lambda i: i.__setitem__("adapters", [1]),
    lambda i: i.__setitem__("global_names", "0.weight"),
])
def test_a_crafted_personalized_index_is_a_file_format_error(tmp_path, edit):
    """A crafted ``index.json`` of saved personalized models (a list, a number or a missing
    entry where the loader expects a name) gave a TypeError/KeyError traceback from
    ``load_personalized`` and ``PersonalizedModels.load``; now a FileFormatError naming it."""
    from partialfl import io as pio
    from partialfl.pipeline.deploy import PersonalizedModels, load_personalized

    net = _saved_models(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    edit(index)
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(pio.FileFormatError, match="index.json"):
        load_personalized(tmp_path, net(), "a")
    with pytest.raises(pio.FileFormatError, match="index.json"):
        PersonalizedModels.load(tmp_path, net())


def test_client_files_that_do_not_fit_together_are_a_file_format_error(tmp_path):
    """``PersonalizedModels.load`` stacked the clients' files unchecked: one client file
    lacking a name gave a KeyError, one of another shape a torch RuntimeError."""
    from partialfl import io as pio
    from partialfl.pipeline.deploy import PersonalizedModels

    net = _saved_models(tmp_path)
    f = tmp_path / "clients" / "000001.safetensors"
    t, _ = pio.load_tensors(f)
    n = sorted(t)[0]
    for bad in ({k: v for k, v in t.items() if k != n}, {**t, n: t[n][:1]}):
        pio.save_tensors(f, bad)
        with pytest.raises(pio.FileFormatError, match="do not fit together"):
            PersonalizedModels.load(tmp_path, net())


def _evaluate_run(tmp_path):
    """A finished-looking femnist-table run folder (tests/test_security.py's) with a valid
    ``deploy.safetensors``; returns ``(go, theta, split)``: ``go(theta=, meta=, metrics=)``
    rewrites the files and runs ``partialfl evaluate`` (exit code, stderr lines)."""
    import torch  # noqa: F401
    from test_security import _payload_run

    from partialfl import io as pio
    from partialfl.build import Task
    from partialfl.build.task import split_of
    from partialfl.cli import main
    from partialfl.pipeline.files import save_deploy, seeded_split
    from partialfl.reproductions.femnist import femnist_model
    from partialfl.spec import RunSpec

    run, data, _ = _payload_run(tmp_path, "deploy.safetensors")
    cfg = RunSpec.from_dict({k: v for k, v in json.loads((run / "config.json").read_text())
                             .items() if k != "task"})
    kind, opts = split_of(cfg.method)
    split = seeded_split(Task(data=None, model_fn=femnist_model),
                         femnist_model(cfg.stage1_seed), kind, opts, cfg.seed)
    ps = dict(split.model.named_parameters())
    theta = {n: ps[n].detach().clone() for n in split.global_names}

    def go(th=theta, meta=None, metrics=None):
        save_deploy(run, split, th, None, kind, opts)
        if meta is not None:
            t, _ = pio.load_tensors(run / "deploy.safetensors")
            pio.save_tensors(run / "deploy.safetensors", t, meta)
        if metrics is not None:
            (run / "metrics.json").write_text(json.dumps(metrics))
        code = main(["evaluate", str(run), "--data-dir", str(data)])
        return code

    return go, theta


def test_evaluate_checks_what_deploy_safetensors_holds(tmp_path, capsys):
    """``partialfl evaluate`` of a received run folder trusted ``deploy.safetensors`` beyond
    its tensor format: metadata without ``kind`` ended in a KeyError traceback, θ lacking a
    global parameter in a KeyError traceback, an integer θ in a torch RuntimeError, and a NaN
    θ was scored (exit 0) as if it were a model; a ``metrics.json`` whose ``finetune_choice``
    is not an object gave a TypeError. Each is now one line naming the file, exit 2."""
    go, theta = _evaluate_run(tmp_path)
    assert go() == 0  # the untouched folder evaluates
    capsys.readouterr()
    n0 = sorted(theta)[0]
    cases = [dict(meta={}), dict(th={k: v for k, v in theta.items() if k != n0}),
             dict(th={**theta, n0: theta[n0].long()}),
             dict(th={**theta, n0: theta[n0] * float("nan")}),
             dict(metrics={"finetune_choice": "x"})]
    for case in cases:
        assert go(**case) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("deploy.safetensors" in err[0] or "metrics.json" in err[0])


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_tensor_or_json_path_that_is_not_a_file_is_not_called_missing(tmp_path, kind):
    """``load_tensors`` and ``read_json`` answered a FIFO or a folder planted under a file's
    name with FileNotFoundError "… not found" (so the CLI told the user a file that is there
    was missing); now FileFormatError "not a regular file", read without blocking."""
    from partialfl import io as pio

    p = tmp_path / "theta.safetensors"
    os.mkfifo(p) if kind == "fifo" else p.mkdir()
    for read in (pio.load_tensors, pio.read_json):
        with pytest.raises(pio.FileFormatError, match="not a regular file"):
            read(p)
    with pytest.raises(FileNotFoundError, match="not found"):
        pio.load_tensors(tmp_path / "missing.safetensors")
