"""The examples in the README and examples/ run and do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_own_model_example_learns_personal_labelings():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        acc = _load(ROOT / "examples" / "own_model.py").main(rounds=10)
    finally:
        torch.set_num_threads(threads)
    assert acc > 0.9  # every client relabels the classes: only a personal head can fit all


def test_readme_python_example_runs_at_small_size():
    text = (ROOT / "README.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    code = block.replace("num_clients=32, n=10_000, d_theta=100, d_w=50",
                         "num_clients=4, n=60, d_theta=6, d_w=3")
    code = code.replace("rounds=3000", "rounds=2000").replace("progress=True", "progress=False")
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["result"].history[-1]["rel_dist2"] < 1e-8
