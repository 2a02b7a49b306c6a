"""Adversarial round 52a (issue 21, areas 2, 5 and 6, tried again from scratch by someone who
did not write the fixes, against d4a1077: round 51a's stall rule). Each test failed on that
code because of the defect it names, and passes since the fix: ``flower node-data`` builds
the spec inside ``allow_code`` (as ``flower local``), and a θ⁰ leaf name's segments may be
indices (``0.weight``: a Sequential's children), still without empty segments or other
characters.

* Area 6, ``partialfl flower node-data CONFIG OUT --allow-code`` refuses the config's own
  ``module:callable`` model ("model.name: 'usermodels:tiny' names code to import and run ...
  --allow-code") although the user gave ``--allow-code`` on their own machine: the command
  loads the spec inside ``allow_code`` (:func:`partialfl.cli.common.load_spec`) but builds
  it (``build(spec)`` in :func:`partialfl.cli.flower._cmd_flower_node_data`) outside the
  block, so the opt-in the command advertises in its ``--help`` never applies (``flower
  local`` builds inside it and gets past this point). A user with their own model cannot
  write the node stores a deployment on separate machines needs.
* Area 2, found by running ``partialfl flower local cfg.toml --allow-code --insecure`` on
  a user's own ``nn.Sequential`` model (the commonest user model; its parameters are
  named ``1.weight``, ``3.bias``): the honest federation never starts — ``RuntimeError: no
  SuperNode holds 1 partition(s) (0) after 120.0s ... (last refusal: θ⁰ leaf name
  '1.weight' is not a parameter name)``. The ServerApp's check of partition 0's θ⁰
  (:func:`partialfl.flower.codec._decode_theta0`, ``_LEAF_NAME``) requires the first
  segment of a leaf name to be an identifier, which torch's own parameter names (a child
  of a ``Sequential``/``ModuleList`` is named by its index) are not. Shown here in process
  (loopback SuperNodes that allow imports) with the same model and data.

Tried and held (run unless marked "read"): ``flower credentials`` with ``--nodes`` 0 / −1,
``--host`` '' / 300 characters (one line, exit 2), ``'a b'``, ``'*'``, ``999.1.1.1``
(accepted: a name), OUT an existing file or below one (one line), OUT's ``server.key`` and
``supernode-0.key`` symlinks to files outside (replaced, the targets untouched), private keys
0600; ``flower node-data`` without ``--allow-code`` (refused before the model module is
imported: a module writing a marker file never ran); (read) a SuperNode's code check reads
the decoded spec with ``set`` applied before anything is parsed, built or imported, a
``plugins`` string as well as a list, and the node pushes ``allow_code(False)`` so the
server-side ``PARTIALFL_ALLOW_CODE`` of the same process never applies; (read) the server's
``fault-injection`` reaching an honest node: ``extra`` copies the θ-shaped update vectors it
sends anyway, ``slow`` ≤ a day; (read) the registry imports only dotted module names,
``torch.load`` with ``weights_only``, ``np.load`` without pickle, ``hf-disk`` through
``load_from_disk``; (read) discovery: the partition's clients checked exactly, θ⁰ names,
finiteness; (read) the Flower checkpoint: no pickle, failures' fields typed, one-line
reasons, the run's fingerprint.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from _adv_cli import env
from _user_project import TINY_MODEL, client_folder, tiny_toml

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install "
                           "'partialfl[flower]')")

from _flower_loopback import loopback  # noqa: E402, F401 - the fixture


def test_flower_node_data_honours_allow_code(tmp_path):
    """Found: exit 2, "model.name: 'usermodels:tiny' names code to import and run ... unless
    you allow code from configs on your own machine: partialfl … --allow-code" — with
    ``--allow-code`` given. Expected: the node stores are written (node-0, node-1)."""
    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(tmp_path / "data")
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:tiny", data)
    p = subprocess.run([sys.executable, "-m", "partialfl", "flower", "node-data", str(cfg),
                        str(tmp_path / "nd"), "--nodes", "2", "--allow-code"],
                       cwd=tmp_path, env=env(None), capture_output=True, text=True,
                       timeout=170)
    assert p.returncode == 0, p.stderr[-600:]
    assert (tmp_path / "nd" / "node-0").is_dir() and (tmp_path / "nd" / "node-1").is_dir()


def test_control_flower_node_data_without_allow_code_is_refused(tmp_path):
    """The refusal itself is right without the opt-in (one line, exit 2, nothing imported)."""
    (tmp_path / "usermodels.py").write_text(
        TINY_MODEL + "\nimport pathlib\npathlib.Path(__file__).with_name('RAN').touch()\n")
    data = client_folder(tmp_path / "data")
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:tiny", data)
    p = subprocess.run([sys.executable, "-m", "partialfl", "flower", "node-data", str(cfg),
                        str(tmp_path / "nd")], cwd=tmp_path, env=env(None),
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 2 and "--allow-code" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "RAN").exists()


def _sequential_spec(tmp_path, monkeypatch) -> dict:
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "usermodels.py").write_text(TINY_MODEL)  # nn.Sequential: 1.weight, 1.bias, 3.…
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PARTIALFL_ALLOW_CODE", "1")  # the server's user's own opt-in
    data = client_folder(tmp_path / "data")
    client = {"lr": 0.1, "batch_size": 8}
    return {"name": "tiny", "model": {"name": "usermodels:tiny"},
            "data": {"source": "folder", "path": str(data)},
            "method": {"algorithm": "ffgg", "split": "output"},
            "pretrain": {"rounds": 1, "clients_per_round": 2, "client": client},
            "personalize": {"rounds": 1, "clients_per_round": 2, "client": client}}


def test_a_sequential_user_model_runs_on_flower(loopback, tmp_path, monkeypatch):  # noqa: F811
    """Found: ``RuntimeError: no SuperNode holds 1 partition(s) (0) after 3.0s; partitions
    present: 1 (last refusal: θ⁰ leaf name '1.weight' is not a parameter name)`` (live:
    ``partialfl flower local``, the same after 120 s). Expected: the honest federation of
    two SuperNodes (imports allowed by their operator) runs its stage-1 round."""
    from partialfl.flower.server import run_server

    spec = _sequential_spec(tmp_path, monkeypatch)
    grid = loopback(2, node_config={"allow-imports": True})
    logging.disable(logging.WARNING)
    try:
        rep = run_server(grid, {"spec": spec, "stage": "pretrain", "node-wait-timeout": 3,
                                "round-timeout": 10, "poll-interval": 0.01})
    finally:
        logging.disable(logging.NOTSET)
    assert not rep.failures


def test_control_theta0_names_are_still_checked():
    """What the fix must keep: a θ⁰ leaf name that is not a parameter path (an empty
    segment, a control character) is refused. (A space or a slash is a name torch allows —
    ``ModuleDict`` keys — and is accepted since round 55a.)"""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from partialfl.flower.codec import WireFormatError, decode_theta0

    for bad in ("../x", "a..b", "", "a.", ".a", "a\nb", "a\x00b"):
        rec = ArrayRecord({bad: Array(np.zeros(2))})
        with pytest.raises(WireFormatError):
            decode_theta0(rec)
