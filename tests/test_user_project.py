"""A researcher's own project (issue 23 item 3): a model module beside the config, found by
the ``partialfl`` console script with ``--allow-code`` from any working folder, and
``data.path`` relative to the config file (``--set`` paths relative to the working folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import partialfl
from partialfl.pipeline.train import load_run_spec

MODELS = """
from torch import nn


def tiny_mlp(num_classes: int = 3):
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, num_classes))
"""

CONFIG = """
name = "study"
[model]
name = "mymodels:tiny_mlp"
[data]
source = "folder"
path = "data"
[method]
algorithm = "ffgg"
split = "output"
[pretrain]
rounds = 1
clients_per_round = 2
[personalize]
rounds = 1
clients_per_round = 2
[finetune]
epochs = 1
"""


def _clients(folder: Path, n: int = 4) -> Path:
    folder.mkdir(parents=True)
    for m in range(n):
        rng = np.random.default_rng(m)
        x = rng.standard_normal((12, 4)).astype(np.float32)
        np.savez(folder / f"c{m}.npz", x=x, y=((x[:, 0] > 0).astype(np.int64) + m) % 3)
    return folder


@pytest.fixture
def project(tmp_path):
    """``proj/`` (study.toml, mymodels.py, data/) and an empty working folder beside it."""
    proj = tmp_path / "proj"
    _clients(proj / "data")
    (proj / "mymodels.py").write_text(textwrap.dedent(MODELS))
    (proj / "study.toml").write_text(textwrap.dedent(CONFIG))
    (tmp_path / "elsewhere").mkdir()
    return proj


def _console(args, cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("partialfl", path=str(Path(sys.executable).parent)) or \
        shutil.which("partialfl")
    if exe is None:
        pytest.skip("the partialfl console script is not installed")
    src = str(Path(partialfl.__file__).resolve().parents[1])  # the code under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("PARTIALFL_ALLOW_CODE", None)
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_console_script_finds_the_model_module_beside_the_config(project):
    """From another working folder: without --allow-code one line and exit 2; with it the
    module beside the config is imported (it failed with "No module named 'mymodels'") and
    the data folder is the config's."""
    here = project.parent / "elsewhere"
    r = _console(["train", "../proj/study.toml", "--dry-run"], here)
    assert r.returncode == 2 and "--allow-code" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _console(["train", "../proj/study.toml", "--dry-run", "--allow-code"], here)
    assert r.returncode == 0, r.stderr
    assert "mymodels:tiny_mlp: 67 parameters" in r.stdout  # 4·8+8 + 8·3+3
    assert f"per-client files in {project / 'data'}" in r.stdout
    assert not (here / "runs").exists()


def test_data_path_is_relative_to_the_config_and_set_paths_to_the_working_folder(
        project, monkeypatch):
    here = project.parent / "elsewhere"
    _clients(here / "mine")
    monkeypatch.chdir(here)
    cfg = Path("../proj/study.toml")
    assert load_run_spec(cfg).data.path == str(project / "data")
    # an override is the user's own command line: the working folder's
    assert load_run_spec(cfg, ["data.path=mine"]).data.path == str(here / "mine")
    # a file path that does not exist beside the config falls back to the working folder
    (project / "study.toml").write_text(CONFIG.replace('path = "data"', 'path = "mine"'))
    assert load_run_spec(cfg).data.path == str(here / "mine")


def test_a_run_folder_is_readable_by_the_group_under_umask_002(project, monkeypatch):
    """Every file of a train run (JSON, JSONL, safetensors, checkpoints, PNGs, report) gets
    0o666 less the umask, as a plain open() would: collaborators sharing the folder can read
    them (they were 0600)."""
    from partialfl.cli import main

    monkeypatch.chdir(project.parent / "elsewhere")
    monkeypatch.syspath_prepend(str(project))  # as --allow-code does for the console script
    old = os.umask(0o002)
    try:
        assert main(["train", "../proj/study.toml", "--allow-code", "--no-progress",
                     "--out", "run"]) == 0
    finally:
        os.umask(old)
        sys.modules.pop("mymodels", None)
    files = [p for p in Path("run").rglob("*") if p.is_file()]
    assert len(files) > 10 and any(p.suffix == ".png" for p in files)
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in files} == {
        str(p): oct(0o664) for p in files}
