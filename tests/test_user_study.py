"""Issue 23's "Done when": a researcher's own project, end to end, as a user runs it.

A project folder holds a model module beside its config and an ``hf-disk`` dataset (written
with Hugging Face ``datasets``' ``save_to_disk``); from ANOTHER working directory the
``partialfl`` command trains it for two seeds (a study folder, two worker processes), compares
and evaluates the runs, and a client's model is loaded with ``load_personalized``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

MODEL = '''
from torch import nn


def tiny(num_classes: int = 4, width: int = 8):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, width), nn.ReLU(),
                         nn.Linear(width, num_classes))
'''

CONFIG = '''
name = "mystudy"

[model]
name = "mymodels:tiny"          # mymodels.py beside this file

[data]
source = "hf-disk"
path = "data"                   # relative to this file
input_key = "image"
label_key = "label"
holdout = 2
partition = { name = "iid", num_clients = 8, seed = 0 }

[method]
algorithm = "ffgg"
split = "output"

[pretrain]
rounds = 2
clients_per_round = 3
client = { lr = 0.1, batch_size = 16 }

[personalize]
rounds = 2
clients_per_round = 3
client = { lr = 0.05, batch_size = 16 }
server = { lr = 0.1 }

[finetune]
lr = 0.05
epochs = 1
batch_size = 16
'''


def _project(root: Path, side: int = 4, classes: int = 4) -> Path:
    """A project folder: the model module, the config and an ``hf-disk`` dataset of
    ``side``×``side`` images of ``classes`` classes in ``data/``."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("flwr_datasets")
    root.mkdir()
    (root / "mymodels.py").write_text(MODEL)
    (root / "study.toml").write_text(textwrap.dedent(CONFIG))
    rng = np.random.default_rng(0)
    y = rng.integers(0, classes, 320)
    x = (rng.integers(0, 50, (320, side, side)) + 50 * (y[:, None, None] % 4)).astype(np.uint8)
    feats = datasets.Features({"image": datasets.Array2D((side, side), "uint8"),
                               "label": datasets.ClassLabel(num_classes=classes)})
    datasets.Dataset.from_dict({"image": x, "label": y}, features=feats).save_to_disk(
        str(root / "data"))
    return root


def _partialfl(args: list[str], cwd: Path) -> str:
    """The ``partialfl`` command (the console script if installed, as a user types it)."""
    exe = shutil.which("partialfl")
    cmd = [exe] if exe else [sys.executable, "-m", "partialfl"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("PARTIALFL_ALLOW_CODE", None)
    res = subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_a_users_study_end_to_end(tmp_path, monkeypatch):
    project = _project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _partialfl(["train", str(project / "study.toml"), "--seeds", "0", "1",
                      "--allow-code", "--no-progress"], elsewhere)
    assert out.startswith("run        mystudy")  # the plan first
    study = elsewhere / "runs" / "mystudy"
    index = json.loads((study / "study.json").read_text())
    assert [r["folder"] for r in index["runs"]] == ["seed=0", "seed=1"]

    # compare and evaluate in this process (the command's `main`), from the same folder
    from partialfl.cli import main

    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --allow-code adds the config's folder
    monkeypatch.delenv("PARTIALFL_ALLOW_CODE", raising=False)
    assert main(["compare", "runs/mystudy"]) == 0
    text = (study / "compare.md").read_text()
    assert "## Training clients" in text and "## New clients" in text
    assert "6 clients per seed, 2 seeds" in text and "2 new clients per seed" in text
    assert (study / "compare.png").stat().st_size > 0

    assert main(["evaluate", "runs/mystudy", "--allow-code", "--json", "ev.json",
                 "--no-progress"]) == 0
    ev = json.loads((elsewhere / "ev.json").read_text())
    for seed in (0, 1):
        new = json.loads((study / f"seed={seed}" / "new_clients.json").read_text())
        assert ev[f"seed={seed}"]["test"]["accuracy"] == new["test_acc"]

    # a client's deployed model, loaded into the user's own module
    sys.modules.pop("mymodels", None)
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")
    import torch
    from mymodels import tiny

    from partialfl.build import build
    from partialfl.pipeline.deploy import load_personalized
    from partialfl.pipeline.train import load_run_spec

    try:
        run_dir = study / "seed=1"
        m = json.loads((run_dir / "metrics.json").read_text())
        data = build(load_run_spec(project / "study.toml", ["seed=1"])).task.data
        i = 2
        net = load_personalized(run_dir, tiny(), m["client_ids"][i])
        with torch.no_grad():
            acc = (net(data.test_x[i]).argmax(-1) == data.test_y[i]).float().mean().item()
        assert acc == pytest.approx(m["per_client_test_acc"][i], abs=1e-6)
    finally:
        sys.modules.pop("mymodels", None)


#: the README study section at test size: (text in the README, what the test runs instead);
#: every substitution must still match the README (so this list stays in step)
README_STUDY_SIZE = [("rounds = 20", "rounds = 2"), ("epochs = 2", "epochs = 1"),
                     ("--seeds 0 1 2", "--seeds 0")]


def _block(text: str, marker: str) -> str:
    return text.split(f"<!-- {marker} -->", 1)[1].split("\n", 2)[2].split("```", 1)[0]


def test_readme_study_section_runs_as_written(tmp_path, monkeypatch):
    """The README's "Your own study": its model module, config and commands, executed as
    written (sizes reduced), then its `load_personalized` block (fenced `py`: it needs the
    study's files, so the README's self-contained `python` blocks test leaves it out)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Your own study", 1)[1].split("\n## ", 1)[0]
    blocks = {m: _block(section, m) for m in ("study-model", "study-config", "study-commands",
                                              "study-load")}
    for old, new in README_STUDY_SIZE:
        hits = [m for m in blocks if old in blocks[m]]
        assert hits, old
        blocks = {m: b.replace(old, new) for m, b in blocks.items()}
    project = tmp_path / "myproject"
    _project(project, side=28, classes=10)  # the README's model: 28×28, 10 classes
    (project / "mymodels.py").write_text(blocks["study-model"])
    (project / "study.toml").write_text(blocks["study-config"])
    import shlex

    from partialfl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --allow-code adds the config's folder
    monkeypatch.delenv("PARTIALFL_ALLOW_CODE", raising=False)
    for line in blocks["study-commands"].strip().splitlines():  # in-process: `main(argv)`
        args = shlex.split(line)
        assert args[0] == "partialfl"
        assert main(args[1:] + ["--no-progress"] * (args[1] in ("train", "evaluate"))) == 0, line
    study = tmp_path / "runs" / "mystudy"
    assert len(json.loads((study / "study.json").read_text())["runs"]) == 2
    assert "| ffgg-input |" in (study / "compare.md").read_text()
    ns: dict = {}
    try:
        exec(compile(blocks["study-load"], "README study-load", "exec"), ns)
    finally:
        sys.modules.pop("mymodels", None)
    assert not ns["net"].training and ns["net"][-1].out_features == 10
