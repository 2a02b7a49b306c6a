"""A user's own project for the study tests: a model module, per-client data, a tiny TOML."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

TINY_MODEL = '''
import torch
from torch import nn


def tiny(num_classes: int = 3, width: int = 6):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, width), nn.ReLU(),
                         nn.Linear(width, num_classes))
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's own model module ``usermodels.tiny`` on sys.path (code named by a config:
    allowed on this machine, as ``--allow-code`` does)."""
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "usermodels.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    yield "usermodels:tiny"
    sys.modules.pop("usermodels", None)


def client_folder(root: Path, clients: int = 5, classes: int = 3, seed: int = 0) -> Path:
    """Per-client npz files (4×4 uint8 images) with client-specific label skews."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for m in range(clients):
        n = 12 + 2 * m
        y = (rng.integers(0, 2, n) + m) % classes
        x = (rng.integers(0, 60, (n, 4, 4)) + 60 * y[:, None, None]).astype(np.uint8)
        np.savez(root / f"user{m}.npz", x=x, y=y)
    return root


def tiny_toml(path: Path, model: str, data_dir: Path | str, extra: str = "",
              name: str = "tiny", options: str = "") -> Path:
    """A two-round-per-stage FFGG spec on ``data_dir`` (a folder of client files);
    ``options``: the model's options as a TOML inline table."""
    path.write_text(textwrap.dedent(f"""
        name = "{name}"
        [model]
        name = "{model}"
        {f"options = {options}" if options else ""}
        [data]
        source = "folder"
        path = "{data_dir}"
        holdout = 1
        [method]
        algorithm = "ffgg"
        split = "output"
        [pretrain]
        rounds = 2
        clients_per_round = 3
        client = {{ lr = 0.1, batch_size = 8 }}
        [personalize]
        rounds = 2
        clients_per_round = 3
        eval_every = 1
        client = {{ lr = 0.05, batch_size = 8 }}
        server = {{ lr = 0.1 }}
        [finetune]
        lr = 0.05
        epochs = 1
        batch_size = 8
        [logging]
        progress = false
        """) + extra)
    return path


def train_user_model(folder: Path, module: str, source: str, model: str, name: str):
    """``partialfl train --allow-code`` (in a subprocess) of ``module:model`` — the module
    file ``source`` written into ``folder`` — on a 5-client folder of data, one round per
    stage: the finished process (text output)."""
    import subprocess

    from _adv_cli import env

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(source)
    data = client_folder(folder / "data")
    (folder / "cfg.toml").write_text(textwrap.dedent(f"""
        name = "{name}"
        [model]
        name = "{module}:{model}"
        [data]
        source = "folder"
        path = "{data}"
        [method]
        algorithm = "ffgg"
        split = "output"
        [pretrain]
        rounds = 1
        clients_per_round = 2
        client = {{ lr = 0.1, batch_size = 8 }}
        [personalize]
        rounds = 1
        clients_per_round = 2
        client = {{ lr = 0.1, batch_size = 8 }}
        [logging]
        progress = false
        """))
    return subprocess.run([sys.executable, "-m", "partialfl", "train", "cfg.toml", "--out",
                           str(folder / "out"), "--allow-code"], cwd=folder, env=env(None),
                          capture_output=True, text=True, timeout=170)
