"""Small trust defects left by the adversarial rounds (issue 21), one regression test each:
configs with NaN stepsizes and integers past int64, `report` on a plain file."""

from __future__ import annotations

import pytest

from partialfl.cli import main

LS = """
[problem]
name = "least-squares"
num_clients = 4
n = 40
d_theta = 5
d_w = 3
seed = 0
[method]
algorithm = "ffgg"
[personalize]
rounds = 3
client = { name = "cg" }
server = { optimizer = "sgd", lr = 0.1 }
"""


@pytest.mark.parametrize(("override", "message"), [
    ("personalize.server.lr=nan", "personalize.server.lr: expected a finite number, got nan"),
    ("personalize.server.lr=inf", "personalize.server.lr: expected a finite number, got inf"),
    ("personalize.rounds=1000000000000000000000000000000",
     "personalize.rounds: 1000000000000000000000000000000 is out of range"),
    ("seed=100000000000000000000000000", "seed: 100000000000000000000000000 is out of range"),
])
def test_bad_numbers_in_a_config_give_one_line_naming_key_and_value(tmp_path, capsys, override,
                                                                     message):
    """A NaN stepsize used to say 'expected float or str, got nan' (a NaN is a float); an
    integer of 10^30 rounds was accepted (every integer option now lies in int64's range)."""
    cfg = tmp_path / "ls.toml"
    cfg.write_text(LS)
    assert main(["run", str(cfg), "--dry-run", "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert main(["run", str(cfg), "--dry-run", "--set", "personalize.rounds=9"]) == 0


def test_report_on_a_plain_file_says_it_is_not_a_folder(tmp_path, capsys):
    f = tmp_path / "history.json"
    f.write_text("{}")
    assert main(["report", str(f)]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and "does not exist" not in err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _train_config(tmp_path, rounds: int, algorithm: str = "fedalt"):
    import numpy as np

    d = tmp_path / "clients"
    if not d.exists():
        d.mkdir()
        rng = np.random.default_rng(0)
        for m in range(4):
            np.savez(d / f"u{m}.npz", x=rng.integers(0, 255, (8, 28, 28)).astype(np.uint8),
                     y=rng.integers(0, 3, 8))
    cfg = tmp_path / f"t{rounds}.toml"
    cfg.write_text(f'name = "t"\n[model]\nname = "emnist_cnn"\n[data]\nsource = "folder"\n'
                   f'path = "{d}"\n[method]\nalgorithm = "{algorithm}"\n[pretrain]\nrounds = 1\n'
                   f'[personalize]\nrounds = {rounds}\n')
    return cfg


@pytest.mark.parametrize("name", ["theta_stage2.safetensors",
                                  "client_state_stage2.client-side.safetensors",
                                  "stage1/theta.safetensors"])
def test_a_stage_file_of_another_configuration_is_never_resumed(tmp_path, capsys, name):
    """θ₂ (or the clients' state, or θ₁ of another pre-training seed) of a 2-round run copied
    into the folder of a 1-round run of the same model was resumed as that run's stage (its
    report said 1 round).
    Every stage file now carries the SHA-256 of the configuration its stage depends on, and
    a file without this run's is refused in one line naming it; the run's own files still
    resume (same metrics)."""
    import json
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", str(_train_config(tmp_path, 2)), "--out", str(a),
                 "--no-progress"]) == 0
    cfg_b = _train_config(tmp_path, 1)
    if name.startswith("stage1"):  # another stage 1: another pre-training seed
        cfg_b.write_text(cfg_b.read_text().replace('name = "t"',
                                                   'name = "t"\npretrain_seed = 7'))
    assert main(["train", str(cfg_b), "--out", str(b), "--no-progress"]) == 0
    first = json.loads((b / "metrics.json").read_text())
    own = (b / name).read_bytes()
    for f in ("report.md", "metrics.json", "deploy.safetensors"):  # resume from stage files
        (b / f).unlink()
    shutil.copy(a / name, b / name)
    capsys.readouterr()
    assert main(["train", str(cfg_b), "--out", str(b), "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("partialfl:")]
    assert len(err) == 1 and name in err[0] and "not written by this configuration" in err[0]
    (b / name).write_bytes(own)
    assert main(["train", str(cfg_b), "--out", str(b), "--no-progress"]) == 0
    again = json.loads((b / "metrics.json").read_text())
    assert again["test_acc"] == first["test_acc"] and again["test_loss"] == first["test_loss"]


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_run_whose_every_client_computation_was_lost_is_not_finished(loop):
    """Fewer than ``min_attempts`` (20) client computations, all lost (FedProx with μ = 1e308
    made every update non-finite): the run ended with θ⁰ and exit 0, the losses only
    counted. Now the end of a run with no successful client computation raises
    ClientFaultError naming the losses — unless max_failure_fraction = 1 tolerates them; the
    asynchronous loop, which counts server steps, then drew jobs forever (a hang): it stops
    after min_attempts computations of which none succeeded."""
    from conftest import SMALL

    from partialfl.algorithms import FFGG
    from partialfl.local import GradientDescent
    from partialfl.problems.least_squares import LeastSquaresProblem
    from partialfl.runtime import run_rounds
    from partialfl.runtime.asynchronous import run_async
    from partialfl.runtime.faults import ClientFaultError, FaultInjector
    from partialfl.server import SGD

    p = LeastSquaresProblem(SMALL, basis="eigen")
    alg = FaultInjector(FFGG(GradientDescent(3), SGD(0.5 / p.L)), rate=1.0, kinds=("nan",))

    def go(**kw):
        if loop == "sync":
            return run_rounds(p, alg, 3, clients_per_round=2, seed=0, **kw)
        return run_async(p, alg, steps=4, concurrency=2, seed=0, **kw)

    # (the asynchronous loop keeps drawing jobs until a step succeeds: its abort rule fires)
    want = ("none of the 6 client computations succeeded .* 6 non-finite" if loop == "sync"
            else "20 of 20 client computations were lost .* 20 non-finite")
    with pytest.raises(ClientFaultError, match=want):
        go()
    if loop == "sync":  # every loss tolerated: the rounds end, the losses counted
        res = go(max_failure_fraction=1.0)
        assert res.faults.succeeded == 0 and res.faults.nonfinite == 6
    else:  # the asynchronous loop would draw jobs forever (it counts server steps): it stops
        with pytest.raises(ClientFaultError, match="none of the 20 client computations"):
            go(max_failure_fraction=1.0)


def test_dp_noise_that_would_overflow_float32_is_refused_before_training():
    """clip_norm = 1e308 with noise: the server's noise was inf and every round's update was
    blamed on the clients (counted non-finite). The plan now refuses a noise std z·C beyond
    1e30, naming both values."""
    from partialfl.algorithms.dp import DPOptions, make_plan

    with pytest.raises(ValueError, match=r"noise std z·C = 1 × 1e\+308 exceeds 1e\+30"):
        make_plan(DPOptions(noise_multiplier=1.0, clip_norm=1e308), 10)
    assert make_plan(DPOptions(noise_multiplier=1.0, clip_norm=1e6), 10).delta == 0.1
