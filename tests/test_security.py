"""Security and bookkeeping: no code runs from a run folder, every write is atomic, broken
files give named errors, resume is validated, bad inputs give exit code 2 (issue 13)."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
from _nn_toy import toy_data, toy_model
from conftest import SMALL

from partialfl import io as pio
from partialfl.algorithms import FFGG
from partialfl.build import Task
from partialfl.cli import main
from partialfl.data import DataFormatError
from partialfl.data.femnist import FEMNIST_NPZ
from partialfl.local import GradientDescent
from partialfl.local.sgd import SGDConfig
from partialfl.metrics import closed_form_metrics
from partialfl.pipeline.stages import run_pipeline
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
from partialfl.runtime import run_rounds
from partialfl.runtime.sync import ResumeError
from partialfl.server import SGD
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig


class _Payload:
    """Unpickling this creates a file: what a crafted run-folder file could do."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _fake_femnist(folder, writers=("f0000_01", "f0001_02", "f0002_03")):
    rng = np.random.default_rng(0)
    n_tr, n_te = 18, 9
    k = len(writers)
    np.savez(folder / FEMNIST_NPZ,
             train_x=rng.integers(0, 256, (n_tr, 28, 28)).astype(np.uint8),
             train_y=rng.integers(0, 62, n_tr).astype(np.int16),
             train_client=(np.arange(n_tr) % k).astype(np.int32),
             test_x=rng.integers(0, 256, (n_te, 28, 28)).astype(np.uint8),
             test_y=rng.integers(0, 62, n_te).astype(np.int16),
             test_client=(np.arange(n_te) % k).astype(np.int32), writers=np.array(writers))


def _payload_run(tmp_path, name="deploy.pt"):
    """A femnist-table-like run folder whose model file is a crafted pickle."""
    data, run = tmp_path / "data", tmp_path / "table" / "seed0" / "ffgg-output"
    data.mkdir()
    run.mkdir(parents=True)
    _fake_femnist(data)
    (tmp_path / "table" / "data.json").write_text(json.dumps(
        {"train_writers": ["f0000_01", "f0001_02"], "new_writers": ["f0002_03"],
         "pixel_mean": np.zeros((28, 28)).tolist(), "pixel_std": np.ones((28, 28)).tolist()}))
    (run / "config.json").write_text(json.dumps({**RunSpec().to_dict(), "task": "x"}))
    marker = tmp_path / "pwned"
    (run / name).write_bytes(pickle.dumps(_Payload(marker)))
    return run, data, marker


@pytest.mark.parametrize("name", ["deploy.pt", "deploy.safetensors"])
def test_cli_evaluate_never_runs_code_from_a_run_folder(tmp_path, capsys, name):
    run, data, marker = _payload_run(tmp_path, name)
    code = main(["evaluate", str(run), "--data-dir", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists()
    assert code == 2
    assert len(err) == 1 and name in err[0] and "pickle" in err[0], err


def _ls_kw():
    return dict(clients_per_round=3, seed=4, eval_every=4,
                evaluate=lambda *a: closed_form_metrics(*a, with_loss=False))


def test_a_crafted_checkpoint_is_refused_not_executed(tmp_path):
    p = LeastSquaresProblem(SMALL)
    ckpt, marker = tmp_path / "run.ckpt", tmp_path / "pwned"
    ckpt.write_bytes(pickle.dumps({"state": _Payload(marker)}))
    with pytest.raises(pio.UnsafeFileError, match="run.ckpt.*pickle"):
        run_rounds(p, FFGG(GradientDescent(2), SGD(1 / p.L)), 4, checkpoint=ckpt,
                   checkpoint_every=2, resume=True, **_ls_kw())
    assert not marker.exists()


def test_truncated_checkpoint_gives_a_named_error(tmp_path):
    p = LeastSquaresProblem(SMALL)
    ckpt = tmp_path / "run.ckpt"
    run_rounds(p, FFGG(GradientDescent(2), SGD(1 / p.L)), 4, checkpoint=ckpt,
               checkpoint_every=2, **_ls_kw())
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    with pytest.raises(pio.FileFormatError, match="run.ckpt.*truncated"):
        run_rounds(p, FFGG(GradientDescent(2), SGD(1 / p.L)), 8, checkpoint=ckpt,
                   checkpoint_every=2, resume=True, **_ls_kw())


def test_resume_restores_grad_evals_from_the_checkpoint(tmp_path):
    p = LeastSquaresProblem(SMALL)

    def make():
        return FFGG(GradientDescent(3), SGD(1 / p.L))

    full = run_rounds(p, make(), 12, **_ls_kw())
    ckpt = tmp_path / "c.ckpt"

    def crash(r, state):
        if r == 6:  # checkpoint at round 6, last evaluation at round 4
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rounds(p, make(), 12, checkpoint=ckpt, checkpoint_every=3, on_round=crash,
                   **_ls_kw())
    res = run_rounds(p, make(), 12, checkpoint=ckpt, checkpoint_every=3, resume=True,
                     **_ls_kw())
    assert [h["grad_evals"] for h in res.history] == [h["grad_evals"] for h in full.history]
    np.testing.assert_array_equal(res.state.theta["theta"], full.state.theta["theta"])


@pytest.mark.parametrize("change", ["seed", "solver", "problem"])
def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, change):
    p = LeastSquaresProblem(SMALL)
    ckpt = tmp_path / "c.ckpt"
    kw = _ls_kw()
    run_rounds(p, FFGG(GradientDescent(3), SGD(1 / p.L)), 4, checkpoint=ckpt,
               checkpoint_every=2, **kw)
    alg = FFGG(GradientDescent(3), SGD(1 / p.L))
    if change == "seed":
        kw["seed"] = 5
    elif change == "solver":
        alg = FFGG(GradientDescent(7), SGD(1 / p.L))
    else:
        spec = LeastSquaresSpec(SMALL.num_clients, SMALL.n, SMALL.d_theta, SMALL.d_w, seed=9)
        p = LeastSquaresProblem(spec)
    key = {"solver": "algorithm"}.get(change, change)
    with pytest.raises(ResumeError, match=f"different run.*{key}"):
        run_rounds(p, alg, 8, checkpoint=ckpt, checkpoint_every=2, resume=True, **kw)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    f = tmp_path / "a.json"
    pio.write_json(f, {"v": 1})
    with pytest.raises(RuntimeError), pio.atomic_write(f) as fh:
        fh.write('{"v": 2')
        raise RuntimeError("crash mid-write")
    assert json.loads(f.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def _tiny_cfg(algorithm="fedalt", split="output", rounds=1):
    st = StageConfig(rounds=rounds, clients_per_round=2,
                     client=SGDConfig(lr=0.1, batch_size=4), eval_every=1)
    return RunSpec(method=MethodConfig(algorithm=algorithm, split=split), pretrain=st,
                          personalize=st, finetune=FinetuneConfig(lr=0.1, epochs=1,
                                                                batch_size=4),
                          checkpoint_every=1)


def test_every_pipeline_file_is_written_atomically(tmp_path, monkeypatch):
    replaced = []
    real = os.replace
    monkeypatch.setattr(pio.os, "replace", lambda a, b: (replaced.append(str(b)), real(a, b)))
    run_pipeline(_tiny_cfg(), Task(toy_data(4), toy_model, name="toy"), tmp_path / "r",
                 progress=False)
    written = {str(p) for p in (tmp_path / "r").rglob("*") if p.is_file()
               and p.suffix != ".jsonl"}  # JSONL logs are append-only, line by line
    assert written and written <= set(replaced)
    assert not any(p.suffix == ".pt" for p in (tmp_path / "r").rglob("*"))


def test_a_planted_stage_file_is_refused(tmp_path):
    task = Task(toy_data(4), toy_model, name="toy")
    run_pipeline(_tiny_cfg(), task, tmp_path / "r", progress=False)
    marker = tmp_path / "pwned"
    (tmp_path / "r" / "theta_stage2.safetensors").unlink()
    (tmp_path / "r" / "metrics.json").unlink()
    (tmp_path / "r" / "theta_stage2.pt").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pio.UnsafeFileError, match="theta_stage2.pt"):
        run_pipeline(_tiny_cfg(), task, tmp_path / "r", progress=False)
    assert not marker.exists()


def test_rejected_rerun_keeps_data_json(tmp_path):
    from partialfl.config import ConfigError
    from partialfl.reproductions import femnist

    data = tmp_path / "data"
    data.mkdir()
    _fake_femnist(data, writers=("f0", "f1", "f2", "f3"))
    out = tmp_path / "table"
    (out / "stage1").mkdir(parents=True)
    old = {"train_writers": ["f0", "f1"], "new_writers": ["f2"], "pixel_mean": [0.0],
           "pixel_std": [1.0]}
    (out / "data.json").write_text(json.dumps(old))
    (out / "stage1" / "config.json").write_text(json.dumps({"other": "run"}))
    size = femnist.Size(pretrain_rounds=1, rounds=1, eval_every=0, finetune_epochs=0,
                        num_writers=None, holdout=1, seeds=(0,), threads=1, workers=1)
    with pytest.raises(ConfigError, match="already holds"):
        femnist.reproduce_table(out, data_dir=data, size=size, progress=False)
    assert json.loads((out / "data.json").read_text()) == old


# ----------------------------------------------------------------------------- inputs
def test_nan_pixel_in_leaf_json_is_refused(tmp_path):
    from partialfl.data.leaf import load_leaf_femnist

    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        x = np.full((2, 784), 0.5).tolist()
        if split == "train":
            x[1][3] = float("nan")
        (tmp_path / split / "a.json").write_text(json.dumps(
            {"users": ["u1"], "num_samples": [2],
             "user_data": {"u1": {"x": x, "y": [1, 2]}}}))
    with pytest.raises(DataFormatError, match="train: user 'u1' has 1 non-finite"):
        load_leaf_femnist(tmp_path)


def test_nan_pixel_in_tff_h5_is_refused(tmp_path):
    h5py = pytest.importorskip("h5py")
    from partialfl.data.tff_emnist import load_tff_emnist_h5

    paths = {}
    for split in ("train", "test"):
        paths[split] = tmp_path / f"fed_emnist_{split}.h5"
        with h5py.File(paths[split], "w") as f:
            g = f.create_group("examples/w1")
            x = np.full((3, 28, 28), 0.5, np.float32)
            if split == "train":
                x[0, 1, 1] = np.nan
            g["pixels"] = x
            g["label"] = np.array([1, 2, 3], np.int32)
    with pytest.raises(DataFormatError, match="fed_emnist_train.h5.*w1.*non-finite"):
        load_tff_emnist_h5(tmp_path)


def test_federated_dataset_refuses_non_finite_inputs():
    d = toy_data(3)
    x = [t.clone() for t in d.train_x]
    x[2][0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="client 'c2'.*non-finite"):
        type(d)(x, d.train_y, d.test_x, d.test_y, d.client_ids, d.num_classes)


# ----------------------------------------------------------------------------- CLI
_TOML = ('[problem]\nname = "least-squares"\nnum_clients = 4\nn = 30\nd_theta = 5\nd_w = 2\n'
         '[method]\nalgorithm = "ffgg"\n[personalize]\nrounds = 5\n'
         'client = { name = "gd", tau = 2 }\n')


@pytest.mark.parametrize("case,match", [
    ("folder", "not a file"),
    ("out-file", "is a file"),
    ("huge-n", "GiB"),
    ("name-escape", "name"),
    ("nan-lr", "finite"),
])
def test_cli_edge_cases_exit_2_with_one_line(tmp_path, capsys, case, match):
    cfg = tmp_path / "c.toml"
    cfg.write_text(_TOML)
    out = tmp_path / "out"
    args = ["run", str(cfg), "--out", str(out), "--no-progress"]
    if case == "folder":
        args[1] = str(tmp_path)
    elif case == "out-file":
        out.write_text("x")
    elif case == "huge-n":
        args += ["--set", "problem.n=10000000000000"]
    elif case == "name-escape":
        args += ["--set", "name=../../escaped"]
    else:
        args += ["--set", "personalize.client.lr=nan"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]
    assert not (tmp_path.parent / "escaped.jsonl").exists()
    assert not list(tmp_path.parent.glob("escaped*"))


def test_cli_diverged_run_warns_and_exits_non_zero(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(_TOML)
    code = main(["run", str(cfg), "--out", str(tmp_path), "--no-progress",
                 "--set", "personalize.server.lr=1e6", "--set", "personalize.rounds=60"])
    err = capsys.readouterr().err
    assert code == 1 and "diverged" in err


def test_divergence_is_never_silent(tmp_path):
    from dataclasses import replace

    from partialfl.pipeline.stages import pretrain
    from partialfl.spec import ServerConfig

    cfg = _tiny_cfg("ffgg")
    # the server step overflows: θ is not finite after stage 1, a warning says so
    huge = replace(cfg.pretrain, server=ServerConfig("sgd", 1e300))
    with pytest.warns(RuntimeWarning, match="stage 1 diverged"):
        pretrain(replace(cfg, pretrain=huge), Task(toy_data(4), toy_model, name="toy"),
                 tmp_path / "s1")
    # θ overflows in a server step: the run stops there with a warning naming the round
    p = LeastSquaresProblem(SMALL)
    with pytest.warns(RuntimeWarning, match="the run diverged: θ is not finite after the "
                      "server step of round"), np.errstate(over="ignore", invalid="ignore"):
        res = run_rounds(p, FFGG(GradientDescent(2), SGD(1e30)), 60)
    assert res.diverged and res.state.round < 60


def test_load_tensors_round_trip_keeps_kinds(tmp_path):
    f = tmp_path / "t.safetensors"
    pio.save_tensors(f, {"a": np.arange(3.0), "b": torch.ones(2, dtype=torch.float32)},
                     {"k": 1})
    t, meta = pio.load_tensors(f)
    assert isinstance(t["a"], np.ndarray) and t["a"].tolist() == [0.0, 1.0, 2.0]
    assert isinstance(t["b"], torch.Tensor) and meta == {"k": 1}


@pytest.mark.parametrize("low_byte", [0x80, 0x50])
def test_safetensors_whose_header_length_starts_like_a_pickle_or_zip_loads(tmp_path, low_byte):
    """A header length with low byte 0x80 (b"\\x80", a pickle's first byte) or 0x50 (b"P") is a
    valid safetensors file; CI once refused a real checkpoint whose header was 0x1680 bytes."""
    f = tmp_path / "t.safetensors"
    for pad in range(600):
        pio.save_tensors(f, {"a": np.arange(3.0)}, {"pad": "x" * pad})
        if f.read_bytes()[0] == low_byte:
            break
    else:
        pytest.fail(f"no padding gave a header length with low byte {low_byte:#x}")
    if low_byte == 0x50:  # make the second byte "K" too: b"PK" is a zip's magic
        start = pad
        for pad in range(start, start + 70000, 256):
            pio.save_tensors(f, {"a": np.arange(3.0)}, {"pad": "x" * pad})
            if f.read_bytes()[:2] == b"PK":
                break
        assert f.read_bytes()[:2] == b"PK"
    t, meta = pio.load_tensors(f)
    assert t["a"].tolist() == [0.0, 1.0, 2.0] and len(meta["pad"]) == pad
    # a real pickle with the same first byte is still refused
    g = tmp_path / "p.safetensors"
    g.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(pio.UnsafeFileError, match="pickle"):
        pio.load_tensors(g)
