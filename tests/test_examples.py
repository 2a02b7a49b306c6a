"""The examples in the README and examples/ run and do what they say."""

from __future__ import annotations

import importlib.util
import re
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


#: How the README's Python blocks are run at a reduced size: (text in the README, what the
#: test runs instead). Every block must run as it stands (self-contained); a substitution
#: whose text is no longer in the README fails the test, so this list stays in step.
README_SIZE_OVERRIDES = [
    ("num_clients=32, n=10_000, d_theta=100, d_w=50", "num_clients=4, n=60, d_theta=6, d_w=3"),
    ("rounds=3000", "rounds=2000"),
    ("progress=True", "progress=False"),
    ("run_rounds(problem, ffgg, 100, clients_per_round=4", "run_rounds(problem, ffgg, 10, "
                                                           "clients_per_round=4"),
    ("eval_every=25", "eval_every=5"),
]


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_readme_python_block_runs_at_small_size(capsys):
    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    used = set()
    namespaces = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, block in enumerate(blocks):
            for old, new in README_SIZE_OVERRIDES:
                if old in block:
                    block = block.replace(old, new)
                    used.add(old)
            ns: dict = {}  # a fresh namespace: each block must be self-contained
            exec(compile(block, f"README.md python block {i + 1}", "exec"), ns)
            namespaces.append(ns)
    finally:
        torch.set_num_threads(threads)
    assert used == {old for old, _ in README_SIZE_OVERRIDES}
    assert namespaces[0]["result"].history[-1]["rel_dist2"] < 1e-8
    acc = namespaces[1]["result"].history[-1]["test_acc"]
    assert 0 <= acc <= 1 and namespaces[1]["result"].history[-1]["round"] == 10
