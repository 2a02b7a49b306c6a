"""Regressions from the second adversarial battery (issue 21, tried again from scratch): each
case once gave a traceback, a wrong error or lost data; now it works or gives one line."""

from __future__ import annotations

import numpy as np
import pytest

from partialfl.cli import main
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec

_LS = """seed = 0
[problem]
name = "least-squares"
num_clients = 6
n = 60
d_theta = 3
d_w = 2
seed = 0
[method]
algorithm = "ffgg"
w_init = "zero"
[personalize]
rounds = 3
clients_per_round = 3
eval_every = 1
client = { name = "cg", tau = 2 }
server = { optimizer = "sgd", lr = "1/L" }
"""


@pytest.fixture
def ls_toml(tmp_path):
    p = tmp_path / "ls.toml"
    p.write_text(_LS)
    return p


def _run(argv, capsys):
    rc = main([str(a) for a in argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return rc, err


def test_random_w_init_deploys_on_closed_forms(ls_toml, tmp_path, capsys):
    """``w_init = "random"`` on a closed form: deployment (round -1) once raised 'purpose ints
    must be non-negative' — the evaluation's round is an offline one (rng.round_path)."""
    pb = LeastSquaresProblem(LeastSquaresSpec(num_clients=4, n=20, d_theta=2, d_w=3, seed=0))
    w_dep, w_r0 = (pb.init_w(np.arange(4), "random", 0, r)["w"] for r in (-1, 0))
    assert w_dep.shape == (4, 3) and np.isfinite(w_dep).all() and not np.allclose(w_dep, w_r0)
    rc, err = _run(["run", ls_toml, "--out", tmp_path / "o", "--no-progress",
                    "--set", "method.w_init=random"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("flag", [["--threads", "99999999999999999999"],
                                  ["--set", "threads=4294967296"]])
def test_absurd_thread_counts_are_one_line(ls_toml, tmp_path, capsys, flag):
    """A thread count beyond a C int once escaped as a ctypes OverflowError traceback from
    threadpoolctl; now the spec refuses it (exit 2, one line naming the range)."""
    rc, err = _run(["run", ls_toml, "--out", tmp_path / "o", "--no-progress", *flag], capsys)
    assert rc == 2 and len(err) == 1 and ("threads must be an integer in [1, " in err[0]
                                          or "threads: 99999999999999999999 is out of range "
                                          "(integers must lie in [-2^63" in err[0]), err


@pytest.mark.parametrize("z", ["1e10", "1e300"])
def test_huge_noise_multiplier_is_one_line(ls_toml, tmp_path, capsys, z):
    """z = 1e300 escaped as an OverflowError traceback from dp_accounting, z = 1e10 with
    fixed-size sampling as 'math domain error'; the mechanism now bounds z (one line)."""
    rc, err = _run(["run", ls_toml, "--out", tmp_path / "o", "--no-progress", "--set",
                    f"privacy={{clip_norm=1, noise_multiplier={z}, sampling='fixed'}}"], capsys)
    assert rc == 2 and len(err) == 1 and "noise multiplier must be in [0, 1e+06]" in err[0], err


@pytest.mark.parametrize("backend", ["sequential", "threads"])
def test_every_client_failing_by_injection_is_one_line(ls_toml, tmp_path, capsys, backend):
    """``faults = {rate = 1}``: every client raises, so the first error is re-raised as is
    (a systematic failure); the injected fault once escaped the CLI as a traceback."""
    rc, err = _run(["run", ls_toml, "--out", tmp_path / "o", "--no-progress", "--set",
                    "faults={rate=1.0, kinds=['raise']}", "--set", f"backend='{backend}'"],
                   capsys)
    assert rc == 1 and err[-1].startswith("partialfl: error: injected raise fault in client")


@pytest.mark.parametrize("bit", [-1e300, 1e300])
def test_a_forged_unclipped_count_cannot_break_adaptive_clipping(bit):
    """DP's adaptive clip norm reads each client's unclipped bit b_m ∈ {0, 1} (a Flower node
    sends their sum, checked finite only): b = -1e300 once crashed the server step with an
    OverflowError in exp, b = 1e300 set C to 0. The server clamps each b_m to [0, 1]."""
    from test_dp import Fixed, _fixed_problem

    from partialfl.algorithms.dp import UNCLIPPED, DifferentiallyPrivate, DPOptions
    from partialfl.runtime import run_rounds

    class Forged(DifferentiallyPrivate):
        def client_update(self, state, problem, cohort, ctx, client_state=None):
            res = super().client_update(state, problem, cohort, ctx, client_state)
            res.updates.metrics[UNCLIPPED][0] = bit  # one hostile client
            return res

    rows = np.ones((4, 2))  # every norm is sqrt(2) > C: every honest bit is 0
    opts = DPOptions(clip_norm=0.5, noise_multiplier=0.0, adaptive_clipping=True,
                     clients_per_round=4, target_quantile=0.5)
    res = run_rounds(_fixed_problem(4, 2), Forged(Fixed(rows), opts), 1,
                     theta0={"theta": np.zeros(2)}, seed=0)
    clip = res.state.extra["dp_clip_norm"]
    b = 0.0 if bit < 0 else 1.0  # the forged bit counts as at most one client's
    assert clip == pytest.approx(0.5 * np.exp(-0.2 * (b / 4 - 0.5)))


def _updates(**over):
    from partialfl.types import ClientUpdates

    k = 2
    base = dict(vectors={"theta": np.zeros((k, 3))}, weights=np.ones(k), cohort=np.arange(k),
                grad_evals=1)
    return ClientUpdates(**{**base, **over})


_W = np.array([[1.5, 2.5], [3.5, 4.5]])  # two clients' personal w


@pytest.mark.parametrize("field", [
    {"weights": _W},                                   # w as a [k, d_w] "weight"
    {"weights": np.array(["1.5,2.5", "3.5,4.5"])},     # w as text
    {"cohort": np.array([1.5, 2.5])},                  # w as float "client ids"
    {"cohort": np.array(["w=1.5", "w=2.5"])},
    {"grad_evals": _W},                                # w as the "work done"
    {"grad_evals": "w=1.5,2.5"},
])
def test_privacy_screen_checks_weights_cohort_and_grad_evals_by_value(field):
    """The screen checked vectors, extras and metrics by value but not the bookkeeping
    channels: w passed as weights [k, d_w], strings, float ids or an array of grad_evals."""
    from partialfl.privacy import screen

    ok, why = screen(_updates(**field), {"theta": np.zeros(3)})
    assert not ok.any() and why.startswith(f"client message field {next(iter(field))} must be")
    assert screen(_updates(), {"theta": np.zeros(3)})[0].all()  # the honest message passes


@pytest.mark.parametrize("generation", [True, -1, 1, 99])
def test_a_pointer_naming_another_generation_deletes_nothing(tmp_path, generation):
    """A checkpoint pointer whose generation number disagrees with the files it names (a
    crafted or damaged pointer) made clean() delete the committed generation's files — the
    only complete state — before load failed. Now it is a corrupt pointer: nothing removed."""
    from partialfl import io as pio
    from partialfl.runtime.checkpoint import Checkpoint

    ck = Checkpoint(tmp_path / "ck.safetensors", {"seed": 0})
    for r in (1, 2):
        ck.save({"theta": np.full(3, float(r))}, {"w": np.ones((2, 2))}, progress={"round": r})
    _, meta = pio.load_tensors(ck.path, "pointer")
    pio.save_tensors(ck.path, {}, {**meta, "generation": generation})
    files = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(pio.FileFormatError, match="corrupt pointer"):
        Checkpoint(ck.path, {"seed": 0}).load()
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    pio.save_tensors(ck.path, {}, meta)  # the true pointer back: generation 2 resumes
    assert Checkpoint(ck.path, {"seed": 0}).load().server["theta"][0] == 2.0


def test_the_run_log_is_never_written_through_a_planted_symlink(ls_toml, tmp_path, capsys):
    """A symlink named like the run's JSONL log in its folder (a folder received from
    someone, a shared /tmp) made the run overwrite the link's target with its log; every
    other file was replaced atomically. Now: one line, exit 2, the target untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "ls.jsonl").symlink_to(victim)
    rc, err = _run(["run", ls_toml, "--out", out, "--no-progress"], capsys)
    assert victim.read_text() == "precious\n"
    assert rc == 2 and len(err) == 1 and "is a symbolic link" in err[0], err


def test_a_process_pool_never_starts_more_workers_than_clients():
    """``backend = {name = "processes", workers = 100000}`` tried to start 100000 worker
    processes for an 8-client problem (the test harness was killed, out of memory); the
    pool starts at most one worker per client and gives the same θ."""
    from partialfl.algorithms import FFGG
    from partialfl.local import GradientDescent
    from partialfl.runtime import run_rounds
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.server import SGD

    pb = LeastSquaresProblem(LeastSquaresSpec(num_clients=3, n=20, d_theta=2, d_w=2, seed=0))

    def run(backend):
        return run_rounds(pb, FFGG(GradientDescent(2, 0.1), SGD(0.1)), 2, clients_per_round=3,
                          seed=1, backend=backend).state.theta["theta"]

    with ProcessBackend(workers=64) as be:
        theta = run(be)
        assert be._pool.n == 3
    assert np.array_equal(theta, run(None))


@pytest.mark.parametrize("flag", ["nonsense=1", "round-timeout=nan", "secagg=maybe"])
def test_a_dry_run_refuses_the_flower_keys_the_run_refuses(ls_toml, capsys, flag):
    """``--dry-run --engine flower-sim --flower nonsense=1`` said the plan was fine (exit 0)
    while the same command without --dry-run refuses the key; the dry run checks it too."""
    pytest.importorskip("flwr")
    rc, err = _run(["run", ls_toml, "--dry-run", "--engine", "flower-sim", "--flower", flag],
                   capsys)
    assert rc == 2 and len(err) == 1 and flag.split("=")[0] in err[0], err


def test_report_of_a_run_folder_with_a_deeply_nested_spec_is_one_line(tmp_path, capsys):
    """``partialfl report`` on a received run folder whose spec.json is 10⁵ nested arrays
    escaped as a RecursionError traceback (the report read it with json.loads)."""
    from partialfl import io as pio

    (tmp_path / "spec.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(pio.FileFormatError, match="nested too deeply"):
        pio.read_json(tmp_path / "spec.json")
    rc, err = _run(["report", tmp_path], capsys)
    assert rc == 2 and len(err) == 1 and "nested too deeply" in err[0], err


def test_dp_with_the_asynchronous_runtime_is_refused_before_running(ls_toml, capsys):
    """``[privacy]`` with ``[asynchronous]``: the dry run said yes (exit 0), the run itself
    refused only once the first update arrived. The spec refuses the pair."""
    rc, err = _run(["run", ls_toml, "--dry-run", "--set", "asynchronous={}", "--set",
                    "privacy={clip_norm=1, noise_multiplier=1}"], capsys)
    assert rc == 2 and len(err) == 1 and "asynchronous" in err[0], err


@pytest.mark.parametrize("key", ["seed", "pretrain_seed"])
def test_a_negative_seed_is_refused_by_name(ls_toml, tmp_path, capsys, key):
    """``--set seed=-1`` passed --dry-run, then the run failed with numpy's 'expected
    non-negative integer' (no key named); the spec names the key and the range."""
    rc, err = _run(["run", ls_toml, "--dry-run", "--set", f"{key}=-1"], capsys)
    assert rc == 2 and err == [f"partialfl: error: {key} must be an integer >= 0, got -1"]


def test_more_supernodes_than_clients_is_refused_before_flower_starts(ls_toml, capsys):
    """``--supernodes 9`` for 8 clients started the whole Flower simulation, every node
    refused its partition and the CLI died with a RuntimeError traceback; a dry run said
    yes. Both now refuse it first (one line, exit 2)."""
    pytest.importorskip("flwr")
    rc, err = _run(["run", ls_toml, "--dry-run", "--engine", "flower-sim", "--supernodes",
                    "7"], capsys)
    assert rc == 2 and err == ["partialfl: error: 7 SuperNodes for 6 clients: each SuperNode "
                               "holds at least one client; use at most 6"], err


def test_an_attribute_attached_to_an_update_row_never_reaches_the_server():
    """A client's row object may carry more than its values (a Python attribute on a torch
    tensor, an ndarray subclass with a payload): the server's view holds plain arrays only,
    with the same values."""
    import torch

    from partialfl.privacy import server_view
    from partialfl.types import ClientUpdates

    class Carrier(np.ndarray):
        pass

    t = torch.ones(2, 3)
    t.secret_w = torch.arange(5.0)
    a = np.zeros((2, 4)).view(Carrier)
    a.secret_w = np.arange(5.0)
    e = torch.full((2, 1), 2.0)
    e.secret_w = 1
    upd = ClientUpdates({"t": t, "a": a}, np.ones(2), np.arange(2), 1, {}, {"c": {"x": e}})
    seen = server_view(upd)
    rows = [seen.vectors["t"], seen.vectors["a"], seen.extra["c"]["x"]]
    assert not any(hasattr(r, "secret_w") for r in rows)
    assert type(seen.vectors["a"]) is np.ndarray and type(seen.vectors["t"]) is torch.Tensor
    assert torch.equal(seen.vectors["t"], t) and np.array_equal(seen.vectors["a"], a)
    assert torch.equal(seen.extra["c"]["x"], e)


def test_failed_clients_leaving_too_few_for_the_robust_rule_skip_the_step(ls_toml, tmp_path):
    """Faults drop a round's NaN updates; if the k left are too few for the trimmed mean
    (f = ⌊δk⌋ = 0) that round's step is skipped with a warning and counted, as a round that
    lost every client, instead of ending the run with a configuration error."""
    import json
    import warnings

    from partialfl.aggregation.protection import UnprotectedWarning

    out = tmp_path / "o"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["run", str(ls_toml), "--out", str(out), "--no-progress",
                   "--set", "faults={rate=0.3, kinds=['nan']}",
                   "--set", "aggregation={name='tm', delta=0.25}",
                   "--set", "personalize.clients_per_round=4",
                   "--set", "personalize.rounds=6", "--set", "max_failure_fraction=0.9"])
    assert rc == 0
    skipped = [w for w in caught if issubclass(w.category, UnprotectedWarning)
               and "step is skipped" in str(w.message)]
    last = json.loads(next(out.glob("*.jsonl")).read_text().splitlines()[-1])
    assert skipped and last["rounds_unprotected"] == len(skipped) >= 1
    assert last["updates_nonfinite"] >= 1
