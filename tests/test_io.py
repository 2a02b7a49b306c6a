"""partialfl.io: files keep the umask's mode, tensors load onto a device this machine has."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from partialfl import io as pio


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_respect_the_umask(tmp_path, umask):
    """Every atomic write gets 0o666 less the umask, as a plain open() would (the temporary
    file's 0600 used to stay)."""
    old = os.umask(umask)
    try:
        pio.write_text(tmp_path / "a.txt", "x")
        pio.save_tensors(tmp_path / "b.safetensors", {"t": np.ones(2)})
    finally:
        os.umask(old)
    for f in ("a.txt", "b.safetensors"):
        assert (tmp_path / f).stat().st_mode & 0o777 == 0o666 & ~umask, f


def _cuda_file(path, obj):
    """``obj`` saved as if written on cuda:0 (every tensor's recorded device)."""
    skeleton, tensors = pio.encode_state(obj)

    def on_cuda(o):
        if isinstance(o, dict):
            return {k: ("cuda:0" if k == "device" else on_cuda(v)) for k, v in o.items()}
        return [on_cuda(v) for v in o] if isinstance(o, list) else o

    return pio.save_tensors(path, tensors, {"state": on_cuda(skeleton)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a machine without CUDA")
def test_a_state_written_on_cuda_loads_on_a_cpu_machine(tmp_path):
    f = tmp_path / "s.safetensors"
    _cuda_file(f, {"theta": {"w": torch.arange(3.0)}, "opt": [torch.ones(2)], "n": 4})
    obj, _ = pio.load_state(f)
    assert obj["theta"]["w"].device.type == "cpu" and obj["theta"]["w"].tolist() == [0, 1, 2]
    assert obj["opt"][0].device.type == "cpu" and obj["n"] == 4
    obj, _ = pio.load_state(f, device="cpu")  # or the device the run asks for
    assert obj["opt"][0].device.type == "cpu"


def test_a_checkpoint_written_on_cuda_resumes_on_a_cpu_machine(tmp_path, monkeypatch):
    """The sync loop's checkpoint, its server file rewritten as if saved on cuda:0, resumes
    (onto the problem's device) and finishes like the uninterrupted run."""
    from _nn_toy import max_diff, toy_data, toy_model

    from partialfl.algorithms.model import FedAvg
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.runtime import run_rounds
    from partialfl.runtime.checkpoint import SERVER, Checkpoint
    from partialfl.split import make_split

    def run(rounds, **kw):
        p = ModelProblem(make_split(toy_model(), "none"), toy_data(4), vectorize=False)
        return run_rounds(p, FedAvg(SGDConfig(lr=0.1, batch_size=4)), rounds,
                          clients_per_round=2, seed=1, **kw)

    ck = tmp_path / "c.ckpt"
    run(2, checkpoint=ck, checkpoint_every=2)
    server = Checkpoint(ck).files()[SERVER]
    body, _ = pio.load_state(server)
    sha = _cuda_file(server, body)
    ptr, pmeta = pio.load_tensors(ck)
    pmeta["files"][SERVER]["sha256"] = sha
    pio.save_tensors(ck, ptr, pmeta)
    assert b"cuda:0" in server.read_bytes()[:8000]
    resumed = run(3, checkpoint=ck, checkpoint_every=2, resume=True)
    assert max_diff(resumed.state.theta, run(3).state.theta) == 0


def test_write_npz_keeps_every_name_and_reads_back(tmp_path):
    """``io.write_npz`` writes what ``np.savez`` would, for names that clash with its keywords
    (``file`` raised a TypeError, ``allow_pickle`` was silently dropped) and dotted names."""
    from partialfl.io import read_npz, write_npz

    arrays = {"file": np.arange(3.0), "allow_pickle": np.ones((2, 2), np.float32),
              "layers.0.weight": np.zeros(4, np.int64)}
    write_npz(tmp_path / "t.npz", arrays)
    back = read_npz(tmp_path / "t.npz")
    assert back.keys() == arrays.keys()
    for n, a in arrays.items():
        assert back[n].dtype == a.dtype and np.array_equal(back[n], a)
    with np.load(tmp_path / "t.npz", allow_pickle=False) as z:  # numpy's own reader agrees
        assert sorted(z.files) == sorted(arrays)
    assert not list(tmp_path.glob("*.tmp*"))  # atomic: no temporary file left
