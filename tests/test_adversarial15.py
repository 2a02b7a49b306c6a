"""Adversarial round 15 (issue 21): regression tests for what the fifteenth independent round
found.

Found, before, now:

* A config's ``plugins`` module (or a ``module:callable`` model's module), allowed with
  ``--allow-code``, that raises at import, or registers a component with options that are not a
  frozen dataclass, was a traceback; a relative or path-like name (``../x``) was a TypeError
  traceback. An installed entry-point plugin that fails to load was a traceback from every
  command. Now one line naming the module (:func:`partialfl.registry.import_module`).
* A plugin could take over a built-in component by registering an *alias* of it (or a
  name equal to one): ``aliases=["median"]`` made ``aggregation = "median"`` run the plugin's
  code; only equal names were refused. Now every name and alias of another module's entry is.
* DP accounting with a tiny noise multiplier: RDP reported ε = 0 (perfect privacy) at
  z = 1e-155, a ZeroDivisionError traceback at z = 1e-200; PLD raised or tried to allocate
  38 GiB at z = 1e-3. Now ε = ∞ below ``Z_MIN`` (no meaningful guarantee), and a solved z is
  checked to meet its target.
* ``[asynchronous]``: a duration distribution drawing inf or 1e308 made the simulated clock
  inf and the run stopped with "the run diverged … lower the step sizes" (exit 1, the wrong
  cause); FedBuff with a buffer larger than the stage's rounds never stepped and wrote θ⁰ as
  the result (exit 0). Now both one line, exit 2 (the buffer at ``--dry-run``).
* ``data convert … OUT --overwrite`` where OUT is a client store that also holds a user's
  file or folder (another store put inside it) deleted them with the old store. Now refused
  naming the first foreign entry (the store's own files and its ``.verified.json`` go).
* Ditto with ``lam = 1e308``: the proximal map (v + ηλc)/(1 + ηλ) overflowed float32 to
  inf/inf, every personal model v_m became NaN, and the run evaluated and fine-tuned them
  (test_loss NaN, exit 0, nothing counted): the runtime checked a client's update but not
  its new client state. Now the map is computed as c + (v − c)/(1 + ηλ) when ηλ is huge, and
  a client whose new state holds NaN/inf is a counted non-finite result (state not kept).
* ``reproduce faults --seeds -1`` said only "expected non-negative integer" (numpy's
  message, naming neither flag nor value). Now it names both.
* ``run --sweep a=1,…,3000 --sweep b=…(2999 values) --dry-run`` validated 9 M specs one by
  one (still running after minutes: a hang for a typo). Now a study has at most
  ``MAX_RUNS`` = 10,000 runs, refused in one line before any is built.
* ``run --engine flower-sim --flower spec=x`` (or ``stage=…``) was a TypeError traceback.
  Now one line: partialfl sets those keys itself.
* ``run --sweep … --jobs 0 --dry-run`` said the plan was fine (exit 0; the run then refused it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_adversarial import _run

from partialfl.algorithms.base import ClientResult
from partialfl.algorithms.wrapper import AlgorithmWrapper

LS = """plugins = [{plugins}]
[problem]
name = "least-squares"
num_clients = 4
n = 40
d_theta = 3
d_w = 2
[method]
algorithm = "ffgg"
[personalize]
rounds = 2
clients_per_round = 2
client = {{ name = "cg", tau = 2 }}
"""

_PLUGINS = {
    "raises": ("raise RuntimeError('boom at import')\n", "failed at import: RuntimeError: boom"),
    "bad_options": ("from partialfl.registry import register\nclass O: pass\n"
                    "@register('algorithm', 'adv15-evil', options=O)\ndef b(o, c): return None\n",
                    "options must be a frozen dataclass"),
}


@pytest.mark.parametrize("kind", sorted(_PLUGINS))
@pytest.mark.parametrize("where", ["plugins", "model"])
def test_a_plugin_failing_at_import_is_one_line(tmp_path, capsys, monkeypatch, kind, where):
    code, says = _PLUGINS[kind]
    mod = f"adv15_{kind}_{where}"
    (tmp_path / f"{mod}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    if where == "plugins":
        text = LS.format(plugins=f'"{mod}"')
    else:
        text = f'[model]\nname = "{mod}:f"\n[method]\nalgorithm = "ffgg"\n'
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    rc, err = _run(["train", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run",
                    "--allow-code"], capsys)
    assert rc == 2 and len(err) == 1 and mod in err[0] and says in err[0], err


@pytest.mark.parametrize("name", ["../x", "", "a..b", "/etc/x", ".rel"])
def test_a_plugin_name_that_is_not_a_module_name_is_one_line(tmp_path, capsys, name):
    cfg = tmp_path / "c.toml"
    cfg.write_text(LS.format(plugins=f'"{name}"'))
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run",
                    "--allow-code"], capsys)
    assert rc == 2 and len(err) == 1 and "is not a module name" in err[0], err


def test_an_installed_plugin_failing_to_load_is_one_line(monkeypatch):
    import importlib.metadata

    from partialfl import registry
    from partialfl.config import ConfigError

    ep = importlib.metadata.EntryPoint("broken", "adv15_no_such_module_xyz", "partialfl.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep] if group == registry.PLUGIN_GROUP else [])
    monkeypatch.setattr(registry, "_PLUGINS_LOADED", False)
    with pytest.raises(ConfigError, match="installed plugin 'broken'.*failed to load"):
        registry.names("algorithm")


@pytest.mark.parametrize("z", [1e-300, 1e-200, 1e-155, 1e-3])
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_a_tiny_noise_multiplier_is_never_accounted_as_private(z, accountant):
    pytest.importorskip("dp_accounting")
    from partialfl.dp_accounting import Mechanism, epsilon

    assert epsilon(Mechanism(z, 32, 8), 6, 1 / 32, accountant) == float("inf")


def test_a_tiny_noise_multiplier_run_reports_infinite_epsilon(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    cfg = tmp_path / "c.toml"
    cfg.write_text(LS.format(plugins="") + '[privacy]\nname = "dp"\nnoise_multiplier = 1e-155\n')
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress"], capsys)
    assert rc == 0, err
    last = [json.loads(ln) for ln in (tmp_path / "o" / "c.jsonl").read_text().splitlines()][-1]
    assert float(last["dp_epsilon"]) == float("inf"), last


def test_a_dry_run_refuses_a_bad_job_count(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nname = "emnist_cnn"\n[method]\nalgorithm = "ffgg"\n')
    rc, err = _run(["train", cfg, "--out", tmp_path / "o", "--seeds", "0", "1", "--jobs", "0",
                    "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1 and "--jobs must be >= 1, got 0" in err[0], err


ASYNC = '[asynchronous]\nconcurrency = 2\n'


@pytest.mark.parametrize("duration", ['{ name = "constant", scale = 1e308 }',
                                      '{ name = "pareto", scale = 1.0, shape = 1e-300 }'])
def test_an_infinite_simulated_duration_is_one_line_not_a_divergence(tmp_path, capsys,
                                                                     duration):
    cfg = tmp_path / "c.toml"
    cfg.write_text(LS.format(plugins="") + ASYNC + f"duration = {duration}\n")
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "asynchronous.duration" in err[0], err


def test_a_fedbuff_buffer_past_the_rounds_is_refused_at_the_dry_run(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(LS.format(plugins="") + ASYNC + 'rule = { name = "fedbuff", buffer = 3 }\n')
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1 and "buffer 3 is more than the stage's 2 rounds" in err[0]
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run",
                    "--set", "asynchronous.rule.buffer=2"], capsys)
    assert rc == 0, err


def test_advise_refuses_pretrain_rounds_beyond_int64(tmp_path, capsys, data_dir):
    """``advise har --pretrain-rounds 99999999999999999999`` started a 10^20-round stage 1
    (the int64 range check of round 14 lives in the config parser; a table builds its stage
    in code). Now the stage itself refuses it, before stage 1 starts."""
    rc, err = _run(["advise", "har", "--pretrain-rounds", "99999999999999999999", "--out",
                    tmp_path / "o", "--no-progress", "--data-dir", data_dir], capsys)
    assert rc == 2 and len(err) == 1 and "below 2^63" in err[0], err
    assert not (tmp_path / "o" / "stage1").exists()


def test_overwrite_never_deletes_what_a_user_put_inside_a_store(tmp_path):
    from _nn_toy import toy_data

    from partialfl.data.store import ClientStore, write_store

    path = write_store(tmp_path / "s", toy_data(num_clients=3, seed=1))
    ClientStore(path).verify()  # leaves the .verified.json sidecar: still replaceable
    write_store(path, toy_data(num_clients=3, seed=2), overwrite=True)
    (path / "inner").mkdir()
    (path / "inner" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="also holds 'inner'"):
        write_store(path, toy_data(num_clients=3, seed=3), overwrite=True)
    assert (path / "inner" / "mine.txt").read_text() == "keep me"


def test_ditto_with_a_huge_lambda_keeps_finite_personal_models():
    import torch

    from partialfl.local.sgd import _prox_step

    v = {"a": torch.tensor([[1.0, -2.0], [3.0, 4.0]])}
    c = {"a": torch.tensor([0.5, 0.25])}
    out = _prox_step(v, (1e308, c), 0.05, np.array([True, False]))["a"]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], c["a"])
    torch.testing.assert_close(out[1], v["a"][1])


class _NaNState(AlgorithmWrapper):
    """Client ``target``'s new client state (w_m) comes back NaN; its update is finite."""

    def __init__(self, base, target: int) -> None:
        super().__init__(base)
        self.target, self.name = target, base.name

    def client_update(self, state, problem, cohort, ctx, client_state=None):
        res = self.base.client_update(state, problem, cohort, ctx, client_state)
        if list(np.asarray(cohort)) != [self.target]:
            return res
        return ClientResult(res.updates, {n: v * np.nan for n, v in res.client_state.items()})


def test_a_client_whose_new_state_is_nan_is_one_counted_non_finite_result():
    from partialfl.algorithms import FedAlt
    from partialfl.local import GDConfig
    from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec
    from partialfl.runtime import run_rounds
    from partialfl.runtime.backends import SequentialBackend
    from partialfl.runtime.faults import FaultInjector

    def run(alg):
        pb = LeastSquaresProblem(LeastSquaresSpec(num_clients=4, n=40, d_theta=3, d_w=2,
                                                  seed=0))
        return run_rounds(pb, alg, 3, seed=1, backend=SequentialBackend(),
                          clients_per_round=4, max_failure_fraction=0.9)

    alg = FedAlt(GDConfig(2, 0.05), w_init="zero")
    ref = run(FaultInjector(alg, at={(r, 2): "nan" for r in range(3)}))
    res = run(_NaNState(FedAlt(GDConfig(2, 0.05), w_init="zero"), 2))
    assert (res.faults.nonfinite, res.faults.lost) == (3, 3)
    assert np.isfinite(res.client_state["w"]).all()
    np.testing.assert_array_equal(res.state.theta["theta"], ref.state.theta["theta"])
    np.testing.assert_array_equal(res.client_state["w"], ref.client_state["w"])


@pytest.mark.parametrize("name, aliases", [("adv15-agg", ["median"]), ("rfa", []),
                                           ("adv15-agg2", ["tm"])])
def test_a_plugin_cannot_take_over_a_builtin_name_or_alias(name, aliases):
    from partialfl import registry

    before = registry.entry("aggregator", "median").module
    with pytest.raises(ValueError, match="is registered twice"):
        registry.register("aggregator", name, aliases=aliases)(lambda o, c: None)
    assert registry.entry("aggregator", "median").module == before
    assert registry.canonical("aggregator", "rfa") == "gm"
    assert name not in registry.names("aggregator")


def test_reproduce_names_a_bad_seed(tmp_path, capsys):
    rc, err = _run(["reproduce", "faults", "--quick", "--seeds", "0", "-1", "--out",
                    tmp_path / "o", "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "--seeds: -1" in err[0], err


@pytest.mark.timeout(20)
def test_a_huge_sweep_grid_is_refused_at_once(tmp_path, capsys):
    import time

    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nname = "emnist_cnn"\n[method]\nalgorithm = "ffgg"\n')
    many = ",".join(str(i) for i in range(1, 3001))
    t0 = time.perf_counter()
    rc, err = _run(["train", cfg, "--out", tmp_path / "o", "--sweep", f"personalize.rounds={many}",
                    "--sweep", f"pretrain.rounds={many}", "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1 and "make 9000000 runs" in err[0], err
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("key", ["spec=x", "stage=pretrain", "init_from=/etc/hostname",
                                 "out-dir=elsewhere"])  # (out-dir: round 62a, was replaced)
def test_a_flower_option_partialfl_sets_itself_is_one_line(tmp_path, capsys, key):
    cfg = tmp_path / "c.toml"
    cfg.write_text(LS.format(plugins=""))
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run",
                    "--engine", "flower-sim", "--flower", key], capsys)
    assert rc == 2 and len(err) == 1 and "partialfl sets this key itself" in err[0], err
