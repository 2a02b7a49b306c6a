"""Devices and precision: names, errors, autocast, loss scaling, device-independent runs.

The CPU half runs everywhere; the CUDA half skips with a reason when no GPU is present
(``benchmarks/device_check.py`` is the one-call GPU check for a lent accelerator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nn_toy import max_diff, one_thread, toy_data, toy_model

from partialfl.algorithms.model import model_ffgg
from partialfl.build import Task
from partialfl.config import ConfigError
from partialfl.devices import LossScaler, available_devices, check_precision, resolve_device
from partialfl.local.sgd import SGDConfig
from partialfl.pipeline.stages import run_pipeline
from partialfl.problems.model import ModelProblem
from partialfl.runtime import SequentialBackend, run_rounds
from partialfl.server import SGD
from partialfl.spec import FinetuneConfig, MethodConfig, RunSpec, StageConfig
from partialfl.split import make_split

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none on this machine; "
                                "run benchmarks/device_check.py where one is lent)")


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _problem(device="cpu", precision="fp32", vectorize=False, **kw):
    split = make_split(toy_model(0), "output")
    return ModelProblem(split, toy_data(6), vectorize=vectorize, device=device,
                        precision=precision, **kw)


def _ffgg_theta(problem, rounds=3):
    alg = model_ffgg(SGDConfig(lr=0.1, epochs=1, batch_size=4), server_opt=SGD(lr=0.5))
    res = run_rounds(problem, alg, rounds, clients_per_round=3, seed=1,
                     backend=SequentialBackend())
    return {n: v.detach().cpu() for n, v in res.state.theta.items()}


# ----------------------------------------------------------------------------- names
def test_resolve_device_names_and_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else resolve_device("auto").type)
    assert "cpu" in available_devices()
    with pytest.raises(ValueError, match=r"unknown device 'gpu'.*allowed: cpu, cuda, cuda:N"):
        resolve_device("gpu")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match=r"'cuda' is not available.*available: cpu"):
            resolve_device("cuda")
        with pytest.raises(ValueError, match=r"'cuda:3' is not available"):
            resolve_device("cuda:3")


def test_precision_validation():
    assert check_precision("bf16", torch.device("cpu")) == "bf16"
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'.*fp32, bf16, fp16"):
        check_precision("fp8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="precision"):
        RunSpec(precision="half")
    with pytest.raises(ConfigError, match=r"device: 'gpu0' is not allowed"):
        RunSpec(device="gpu0")


def test_problem_refuses_missing_device_clearly():
    if HAS_CUDA:
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="available: cpu"):
        _problem(device="cuda")


# ----------------------------------------------------------------------------- precision
def test_bf16_autocast_is_applied_and_close_to_fp32():
    p32, p16 = _problem(), _problem(precision="bf16")
    cohort = np.arange(3)
    theta = p32.init_theta()
    w = p32.init_w(cohort, "pretrained", 0, 0)
    g32 = p32.grad_theta(cohort, theta, w)
    g16 = p16.grad_theta(cohort, theta, w)
    diff = sum(((g32[n] - g16[n]) ** 2).sum() for n in g32).sqrt()
    norm = sum((g32[n] ** 2).sum() for n in g32).sqrt()
    # autocast changed the arithmetic (bf16 keeps 8 mantissa bits), but only by rounding
    assert 0 < diff / norm < 0.1
    assert all(v.dtype == torch.float32 for v in g16.values())  # grads stay fp32


def test_fp16_run_is_finite_and_close_to_fp32():
    t32 = _ffgg_theta(_problem())
    p = _problem(precision="fp16")
    t16 = _ffgg_theta(p)
    assert all(torch.isfinite(v).all() for v in t16.values())
    assert p.scaler is not None and p.scaler.scale >= 1.0
    assert 0 < max_diff(t32, t16) < 0.05


def test_loss_scaler_backs_off_and_grows():
    sc = LossScaler(init_scale=2.0**10, growth_interval=3)
    calls = []

    def grad_fn(scale):  # overflows whenever the scale exceeds 64
        calls.append(scale)
        v = torch.tensor([scale * 2.0]) if scale <= 64 else torch.tensor([float("inf")])
        return {"a": v}, None

    g, _ = sc.run(grad_fn)
    assert calls == [1024.0, 512.0, 256.0, 128.0, 64.0]
    assert sc.scale == 64.0 and torch.equal(g["a"], torch.tensor([2.0]))
    sc.run(grad_fn)
    assert sc.scale == 64.0
    sc.run(grad_fn)
    assert sc.scale == 128.0  # grew after 3 finite steps in a row (the first one included)


def test_loss_scaler_returns_nonfinite_at_min_scale():
    sc = LossScaler(init_scale=4.0, min_scale=1.0)
    g, _ = sc.run(lambda s: ({"a": torch.tensor([float("nan")])}, None))
    assert sc.scale == 1.0 and torch.isnan(g["a"]).all()


# ----------------------------------------------------------------------------- pipeline
def test_pipeline_device_is_not_part_of_run_identity(tmp_path):
    stage = StageConfig(rounds=2, clients_per_round=3, client=SGDConfig(lr=0.1, batch_size=4))
    cfg = RunSpec(method=MethodConfig(algorithm="ffgg", split="output"), pretrain=stage,
                         personalize=stage, finetune=FinetuneConfig(lr=0.1, epochs=1))
    task = Task(data=toy_data(6), model_fn=toy_model, name="toy")
    a = run_pipeline(cfg, task, tmp_path / "r", progress=False)
    # the same run folder, opened with device "auto": accepted, and the finished run is reused
    cfg2 = RunSpec(**{**cfg.__dict__, "device": "auto"})
    b = run_pipeline(cfg2, task, tmp_path / "r", progress=False)
    assert a.metrics["test_acc"] == b.metrics["test_acc"]
    # precision IS part of the identity: another precision is another run
    cfg3 = RunSpec(**{**cfg.__dict__, "precision": "bf16"})
    with pytest.raises(ConfigError, match="different configuration"):
        run_pipeline(cfg3, task, tmp_path / "r", progress=False)


# ----------------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize("on_device", [True, False])
def test_cuda_matches_cpu(vectorize, on_device):
    t_cpu = _ffgg_theta(_problem(vectorize=vectorize))
    p = _problem(device="cuda", vectorize=vectorize, data_on_device=on_device)
    assert next(iter(p.init_theta().values())).is_cuda
    t_gpu = _ffgg_theta(p)
    assert max_diff(t_cpu, t_gpu) < 1e-4


@needs_cuda
def test_cuda_random_w_init_is_the_cpu_one():
    a = _problem().init_w(np.arange(4), "random", 3, 7)
    b = _problem(device="cuda").init_w(np.arange(4), "random", 3, 7)
    assert max_diff(a, {n: v.cpu() for n, v in b.items()}) == 0.0


@pytest.mark.slow
def test_device_check_script_runs_its_cpu_half(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--quick", "--json", str(tmp_path / "r.json")])
    assert out["agreement_ok"] and out["agreement"]["cpu_vmap_fp32"]["round1"] < 1e-5
    assert set(out["seconds_per_round"]["cpu k=3"]) == {"sequential", "vmap", "vmap_speedup"}
    if not HAS_CUDA:
        assert out["gpu_half"].startswith("skipped")
    assert (tmp_path / "r.json").exists()


def test_bf16_under_vmap_matches_plain_bf16():
    cohort = np.arange(3)
    pv, pp = _problem(precision="bf16", vectorize=True), _problem(precision="bf16")
    theta = pv.init_theta()
    w = pv.init_w(cohort, "pretrained", 0, 0)
    gv, gp = pv.grad_theta(cohort, theta, w), pp.grad_theta(cohort, theta, w)
    assert all(v.dtype == torch.float32 for v in gv.values())
    g32 = _problem().grad_theta(cohort, theta, w)

    def rel(a, b):
        return float(sum(((a[n] - b[n]) ** 2).sum() for n in a).sqrt()
                     / sum((b[n] ** 2).sum() for n in b).sqrt())

    # both bf16 paths approximate the fp32 gradient to bf16 rounding (8 mantissa bits)
    assert rel(gv, g32) < 0.1 and rel(gp, g32) < 0.1 and rel(gv, gp) < 0.1


def test_tables_run_on_the_device_they_are_given(monkeypatch, tmp_path):
    """`partialfl reproduce femnist-table --device D --backend vmap` reaches every run's spec
    (and a table on an accelerator runs its jobs in this one process)."""
    from partialfl.cli import main
    from partialfl.reproductions import femnist as F

    cfg = F.FEMNIST.config(F.FULL, F.FEMNIST.rows[0][1], 0, "vmap", "cuda")
    assert cfg.device == "cuda" and cfg.backend is not None
    seen = {}

    def fake(self, out_dir, **kw):
        seen.update(kw)
        (out_dir / "summary.md").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.md").write_text("ok\n")
        return out_dir / "summary.md"

    monkeypatch.setattr(type(F.FEMNIST), "reproduce", fake)
    assert main(["reproduce", "femnist-table", "--quick", "--device", "cuda:0", "--backend",
                 "vmap", "--out", str(tmp_path / "t"), "--no-progress"]) == 0
    assert seen["device"] == "cuda:0" and seen["backend"] == "vmap" and seen["workers"] is None
    assert main(["reproduce", "femnist-table", "--quick", "--workers", "3", "--out",
                 str(tmp_path / "t"), "--no-progress"]) == 0 and seen["workers"] == 3
    assert main(["reproduce", "ls-tau", "--quick", "--device", "cuda", "--out",
                 str(tmp_path / "u")]) == 2  # a reproduction without a device option
