"""The examples in the README and examples/ run and do what they say."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
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
    ("run_rounds(problem, algorithm, 30,", "run_rounds(problem, algorithm, 3,"),
    ('folder = "out/personalized"', 'folder = __import__("tempfile").mkdtemp()'),
    ('"runs/mine"', '__import__("tempfile").mkdtemp()'),  # the train snippet's output folder
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


def test_the_package_declares_and_ships_its_mit_licence():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    assert meta["authors"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text
    assert (ROOT / "src" / "partialfl" / "py.typed").exists()
    for doc in ("CHANGELOG.md", "CONTRIBUTING.md"):
        assert (ROOT / doc).stat().st_size > 500


@pytest.mark.slow
def test_the_built_wheel_carries_the_licence_and_py_typed(tmp_path):
    import subprocess
    import sys
    import zipfile
    from importlib.metadata import version

    # an older setuptools cannot build SPDX licence metadata: then pip fetches a newer one
    isolation = ["--no-build-isolation"] if int(version("setuptools").split(".")[0]) >= 77 else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("partialfl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert lic and z.read(lic[0]).decode().startswith("MIT License")
        assert "partialfl/py.typed" in names
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata and "License-File: LICENSE" in metadata


def test_every_top_level_module_has_an_api_reference_page():
    import pkgutil

    import partialfl

    text = (ROOT / "mkdocs.yml").read_text()
    for mod in pkgutil.iter_modules(partialfl.__path__):
        if mod.name.startswith("_"):
            continue
        page = ROOT / "docs" / "api" / f"{mod.name}.md"
        assert page.exists() and f"::: partialfl.{mod.name}" in page.read_text(), (
            f"add docs/api/{mod.name}.md ('::: partialfl.{mod.name}') and list it in mkdocs.yml")
        assert f"api/{mod.name}.md" in text


@pytest.mark.slow
def test_the_api_reference_builds_without_warnings(tmp_path):
    import shutil
    import subprocess

    if shutil.which("mkdocs") is None:
        pytest.skip("mkdocs not installed (pip install -e '.[docs]')")
    r = subprocess.run(["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FFGG" in (tmp_path / "site" / "api" / "algorithms" / "index.html").read_text()


def test_quick_start_is_two_commands_in_a_virtual_environment():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.strip().splitlines()
    assert len(commands) == 2
    assert commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "partialfl reproduce ls-tau --quick" in commands[0] and "pytest" in commands[1]
    # the torch pin is explained in general words: any torch >= 2.2, how to get a CPU build
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "any torch ≥ 2.2 works" in quick and "download.pytorch.org/whl/cpu" in quick
    assert "these machines" not in quick


def test_readme_presets_and_deploy_block_saves_what_it_evaluates():
    """The README's preset + deploy block: the client model loaded from the saved folder into
    a fresh module has the accuracy that the per-client table reports."""
    (block,) = [b for b in readme_python_blocks() if "build_preset" in b]
    for old, new in README_SIZE_OVERRIDES:
        block = block.replace(old, new)
    ns: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(block, "README.md presets block", "exec"), ns)
    finally:
        torch.set_num_threads(threads)
    table, data = ns["models"].evaluate(), ns["dataset"]
    with torch.no_grad():
        hits = (ns["net"](data.test_x[0]).argmax(-1) == data.test_y[0]).sum().item()
    assert hits == table["site0"]["correct"] and table["site0"]["total"] == 10
    assert ns["run"].state.round == 3
