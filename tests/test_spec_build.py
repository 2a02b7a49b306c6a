"""The one run specification and the one builder (partialfl.spec, partialfl.build)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from partialfl.build import REGISTRY, build, build_algorithm, names
from partialfl.cli import main
from partialfl.config import ConfigError, from_dict
from partialfl.spec import ClosedFormConfig, MethodConfig, StageConfig

ROOT = Path(__file__).resolve().parents[1]


def _final(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("config", ["ls-scaffold", "ls-ffgg"])
def test_run_server_table_is_not_ignored(tmp_path, config):
    """`partialfl run configs/ls-scaffold.toml --set server.lr=0.5` changes the result (the
    [server] table used to be ignored for local-gd, scaffold and l2gd)."""
    small = ["--set", "problem.num_clients=4", "--set", "problem.n=60", "--set",
             "problem.d_theta=6", "--set", "problem.d_w=3", "--set", "run.rounds=6",
             "--set", "run.eval_every=3", "--set", "run.clients_per_round=4", "--no-progress"]
    res = {}
    for lr in (None, "0.5"):
        out = tmp_path / str(lr)
        extra = [] if lr is None else ["--set", f"server.lr={lr}"]
        assert main(["run", str(ROOT / "configs" / f"{config}.toml"), "--out", str(out),
                     *small, *extra]) == 0
        res[lr] = _final(out, config)
    assert res[None]["round"] == res["0.5"]["round"] == 6
    assert abs(res[None]["rel_dist2"] - res["0.5"]["rel_dist2"]) > 1e-6 * res[None]["rel_dist2"]


@pytest.mark.parametrize("name", ["local-gd", "scaffold", "l2gd"])
def test_server_lr_one_is_the_plain_baseline(name):
    """``auto`` (and lr 1) is the baselines' own averaging step: the server table default
    reproduces what these algorithms did before it applied to them."""
    base = {"problem": {"num_clients": 3, "n": 40, "d_theta": 4, "d_w": 2},
            "algorithm": {"name": name, "tau": 3}, "run": {"rounds": 2}}
    a = build(from_dict(ClosedFormConfig, base)).algorithm
    b = build(from_dict(ClosedFormConfig, {**base, "server": {"lr": 0.25}})).algorithm
    assert a.server_opt.lr == 1.0 and b.server_opt.lr == 0.25


def test_ffgg_auto_lr_is_one_over_L():
    cfg = from_dict(ClosedFormConfig, {"problem": {"num_clients": 3, "n": 40, "d_theta": 4,
                                                   "d_w": 2}, "run": {"rounds": 2}})
    run = build(cfg)
    assert run.algorithm.server_opt.lr == pytest.approx(1.0 / run.problem.L)


@pytest.mark.parametrize("data, key, bad", [
    ({"algorithm": {"name": "fedprox"}}, "algorithm.name", "fedprox"),
    ({"server": {"optimizer": "rmsprop"}}, "server.optimizer", "rmsprop"),
    ({"server": {"schedule": "cosine"}}, "server.schedule", "cosine"),
    ({"problem": {"kind": "svm"}}, "problem.kind", "svm"),
])
def test_bad_names_give_key_value_and_allowed(data, key, bad):
    with pytest.raises(ConfigError) as e:
        from_dict(ClosedFormConfig, data)
    msg = str(e.value)
    assert key in msg and repr(bad) in msg and "allowed" in msg


def test_unknown_key_is_named_with_its_table():
    with pytest.raises(ConfigError, match=r"lrr.*\[server\]"):
        from_dict(ClosedFormConfig, {"server": {"lrr": 1}})


def test_spec_choices_come_from_the_registry():
    assert set(names("algorithm")) >= {"fedavg", "ffgg", "local-ffgg", "fedalt", "fedsim"}
    for kind in ("optimizer", "schedule", "model", "dataset", "partitioner"):
        assert names(kind) == tuple(REGISTRY[kind])
    # splits: the registry's, then one "preset:NAME" per registered preset
    assert names("split") == (*REGISTRY["split"], *(f"preset:{p}" for p in names("preset")))
    assert {"ditto", "local", *names("preset")} <= set(names("algorithm"))
    with pytest.raises(ConfigError, match="method.algorithm.*fedavg"):
        MethodConfig(algorithm="nope")


def test_model_algorithms_all_build():
    stage = StageConfig(rounds=3)
    for algo, split in (("fedavg", "none"), ("ffgg", "output"), ("local-ffgg", "adapter"),
                        ("fedalt", "output"), ("fedsim", "input")):
        alg = build_algorithm(MethodConfig(algorithm=algo, split=split), stage)
        assert alg.name.replace("_", "-").lower().startswith(algo.split("-")[0]) or alg.name


def test_no_other_choice_helpers_or_name_tables():
    """The builder is the only place that maps names to classes: no `_choice` helper and no
    `if name == "..."` dispatch to constructors elsewhere in the run layers."""
    src = ROOT / "src" / "partialfl"
    for f in (src / "experiments" / "closed_form.py", src / "experiments" / "pipeline.py",
              src / "flower" / "config.py", src / "flower" / "models.py"):
        text = f.read_text()
        assert "def _choice" not in text, f
        assert not re.search(r'^\s+if (name|a\.name|method\.algorithm) == "', text, re.M), f


def test_presets_register_in_one_place_and_build(monkeypatch, tmp_path):
    """A preset (as `partialfl.algorithms.presets.PRESETS` provides them) registered through
    `build.preset_entry` is a method algorithm with its own split, usable from a train spec."""
    from torch import nn

    from partialfl import build as B
    from partialfl.algorithms.model import FedSim
    from partialfl.split import make_split

    calls = {}

    class FakePreset:
        def make_algorithm(self, local, *, w_init, server_opt, weighting, **options):
            calls["alg"] = options
            return FedSim(local, w_init=w_init, server_opt=server_opt, weighting=weighting)

        def make_split(self, model, example_input, **options):
            calls["split"] = options
            return make_split(model, "input")

    names("algorithm")  # load the real presets (if any) first
    monkeypatch.setitem(B.REGISTRY["preset"], "fakeper", B.preset_entry(FakePreset()))
    m = MethodConfig(algorithm="fakeper", split_options={"layers": 1})
    assert m.split == "preset:fakeper"
    alg = build_algorithm(m, StageConfig(rounds=1))
    assert isinstance(alg, FedSim) and calls["alg"] == {"layers": 1}
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    split = B.build_split(model, m.split, m.split_options)
    assert split.personal_names == ("0.weight", "0.bias") and calls["split"] == {"layers": 1}
    with pytest.raises(ConfigError, match="defines its own split"):
        MethodConfig(algorithm="fakeper", split="input")
