"""The one run specification and the one builder (partialfl.spec, partialfl.build)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from partialfl.build import build, build_algorithm
from partialfl.cli import main
from partialfl.config import ConfigError, from_dict, to_dict
from partialfl.registry import Component, entry, names
from partialfl.spec import MethodConfig, RunSpec, StageConfig

ROOT = Path(__file__).resolve().parents[1]
LS = {"name": "least-squares", "num_clients": 3, "n": 40, "d_theta": 4, "d_w": 2}


def _final(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.jsonl").read_text().splitlines()[-1])


def _ls(algorithm: str = "ffgg", client=None, **over) -> RunSpec:
    stage = {"rounds": 2, "clients_per_round": 0,
             "client": client or {"name": "gd", "tau": 3}, **over.pop("stage", {})}
    return from_dict(RunSpec, {"problem": LS, "method": {"algorithm": algorithm},
                               "personalize": stage, **over})


@pytest.mark.parametrize("config", ["ls-scaffold", "ls-ffgg"])
def test_run_server_table_is_not_ignored(tmp_path, config):
    """`partialfl run configs/ls-scaffold.toml --set personalize.server.lr=0.5` changes the
    result (the server table applies to every algorithm)."""
    small = ["--set", "problem.num_clients=4", "--set", "problem.n=60", "--set",
             "problem.d_theta=6", "--set", "problem.d_w=3", "--set", "personalize.rounds=6",
             "--set", "personalize.eval_every=3", "--set", "personalize.clients_per_round=4",
             "--no-progress"]
    res = {}
    for lr in (None, "0.5"):
        out = tmp_path / str(lr)
        extra = [] if lr is None else ["--set", f"personalize.server.lr={lr}"]
        assert main(["run", str(ROOT / "configs" / f"{config}.toml"), "--out", str(out),
                     *small, *extra]) == 0
        res[lr] = _final(out, config)
    assert res[None]["round"] == res["0.5"]["round"] == 6
    assert abs(res[None]["rel_dist2"] - res["0.5"]["rel_dist2"]) > 1e-6 * res[None]["rel_dist2"]


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "l2gd"])
def test_server_lr_one_is_the_plain_baseline(name):
    """``auto`` (and lr 1) is the baselines' own averaging step."""
    a = build(_ls(name)).algorithm
    b = build(_ls(name, stage={"server": {"lr": 0.25}})).algorithm
    assert a.server_opt.lr == 1.0 and b.server_opt.lr == 0.25


def test_ffgg_auto_lr_is_one_over_L():
    run = build(_ls("ffgg"))
    assert run.algorithm.server_opt.lr == pytest.approx(1.0 / run.problem.L)


def test_local_gd_is_fedavg_with_gd_steps_and_shares_w():
    """The same FedAvg code under one name: ``local-gd`` is an alias of ``fedavg``; on a
    closed-form problem it shares w (standard basis)."""
    assert MethodConfig(algorithm="local-gd").algorithm == "fedavg"
    run = build(_ls("local-gd"))
    assert type(run.algorithm).__name__ == "FedAvg" and run.algorithm.share_w
    assert run.problem.basis == "standard"
    assert build(_ls("ffgg")).problem.basis == "eigen"


@pytest.mark.parametrize("data, key, bad", [
    ({"method": {"algorithm": "fedproxx"}}, "method.algorithm", "fedproxx"),
    ({"personalize": {"server": {"optimizer": "rmsprop"}}}, "personalize.server.optimizer",
     "rmsprop"),
    ({"personalize": {"server": {"schedule": "cosine"}}}, "personalize.server.schedule",
     "cosine"),
    ({"problem": {"name": "svm"}}, "problem.name", "svm"),
    ({"personalize": {"client": {"name": "adamw"}}}, "personalize.client.name", "adamw"),
])
def test_bad_names_give_key_value_and_allowed(data, key, bad):
    with pytest.raises(ConfigError) as e:
        from_dict(RunSpec, data)
    msg = str(e.value)
    assert key in msg and repr(bad) in msg and "allowed" in msg


def test_bad_options_name_the_key_and_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"personalize\.server\.lrr.*\[personalize\.server\]"):
        from_dict(RunSpec, {"personalize": {"server": {"lrr": 1}}})
    with pytest.raises(ConfigError, match=r"unknown key 'method\.mu'.*allowed keys in "
                                          r"\[method\]: algorithm, .*local_steps"):
        from_dict(RunSpec, {"method": {"algorithm": "local-ffgg", "mu": 1}})
    with pytest.raises(ConfigError, match=r"personalize\.client\.tua.*did you mean 'tau'"):
        from_dict(RunSpec, {"problem": LS, "personalize": {"client": {"name": "gd",
                                                                      "tua": 3}}})
    with pytest.raises(ConfigError, match="lam"):
        MethodConfig(algorithm="ditto")


def test_algorithm_options_live_in_the_method_table_and_round_trip():
    m = from_dict(MethodConfig, {"algorithm": "ditto", "lam": 0.5})
    assert m.option("lam") == 0.5 and to_dict(m)["lam"] == 0.5
    assert MethodConfig(algorithm="ditto", options={"lam": 0.5}) == m
    spec = from_dict(RunSpec, {"method": {"algorithm": "fedalt", "stateless": True},
                               "personalize": {"rounds": 3}})
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.method.name == "fedalt-output-stateless"


def test_spec_choices_come_from_the_registry():
    assert {"fedavg", "ffgg", "local-ffgg", "fedalt", "fedsim", "ditto", "local", "fedper",
            "fedrep", "lg-fedavg", "fedbn", "scaffold", "l2gd"} <= set(names("algorithm"))
    with pytest.raises(ConfigError, match="method.algorithm.*allowed:.*fedavg"):
        MethodConfig(algorithm="nope")


def test_closed_form_and_model_algorithms_are_one_kind():
    """The same entry builds FFGG on least squares (its GD fine-tuner) and on a model (its SGD
    fine-tuner); FedAvg likewise (GD steps / SGD epochs)."""
    cf = build(_ls("ffgg")).algorithm
    assert type(cf.solver).__name__ == "GradientDescent"
    m = build_algorithm(RunSpec(), StageConfig(rounds=3), wrap=False)
    assert type(m).__name__ == "FFGG" and type(m.solver).__name__ == "SGDFineTuner"
    for algo in ("fedavg", "local-ffgg", "fedalt", "fedsim", "scaffold"):
        alg = build_algorithm(RunSpec(method=MethodConfig(algorithm=algo)), StageConfig())
        assert alg.name.startswith(entry("algorithm", algo).name.split("-")[0])


def test_a_fine_tuning_solver_is_not_a_client_optimizer():
    with pytest.raises(ConfigError, match="fedavg trains on the clients.*client optimizer"):
        build(_ls("fedavg", client={"name": "cg", "tau": 3}))


def test_traits_replace_name_checks():
    with pytest.raises(ConfigError, match="fedavg trains one shared model"):
        MethodConfig(algorithm="fedavg", split="output")
    with pytest.raises(ConfigError, match="ffgg needs personal parameters"):
        MethodConfig(algorithm="ffgg", split="none")
    with pytest.raises(ConfigError, match="defines its own split"):
        MethodConfig(algorithm="fedrep", split="input")
    with pytest.raises(ConfigError, match="finetune_split applies to algorithms that train one"):
        MethodConfig(algorithm="ffgg", finetune_split="output")
    assert MethodConfig(algorithm="fedavg", finetune_split="adapter").finetune_split.name == \
        "adapter"
    with pytest.raises(ConfigError, match="full participation"):
        build(_ls("l2gd", stage={"clients_per_round": 2}))


def test_no_name_checks_in_the_run_layers():
    """Nothing outside an entry checks an algorithm by its name."""
    src = ROOT / "src" / "partialfl"
    pat = re.compile(r"""(==|!=) *['"](ffgg|fedavg|local-ffgg|fedalt|fedsim|ditto|"""
                     r"""local-gd|scaffold|l2gd)['"]|in \(['"](ffgg|fedavg)['"]""")
    found = [f"{f.relative_to(src)}:{i}" for f in src.rglob("*.py")
             for i, line in enumerate(f.read_text().splitlines(), 1) if pat.search(line)]
    assert not found, found


def test_components_accept_their_options_objects():
    from partialfl.local.sgd import SGDConfig

    st = StageConfig(client=SGDConfig(lr=0.5, epochs=2))
    assert st.client == Component("local", "sgd", SGDConfig(lr=0.5, epochs=2))
    assert StageConfig(client="gd").client.name == "gd"


def test_import_spec_loads_no_torch():
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import sys, partialfl.spec, partialfl.registry;"
                          "print('torch' in sys.modules)"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_closed_form_spec_validation_loads_no_torch():
    import subprocess

    code = ("import sys; from partialfl.config import load_toml, from_dict; "
            "from partialfl.spec import RunSpec; "
            f"s = from_dict(RunSpec, load_toml({str(ROOT / 'configs' / 'ls-ffgg.toml')!r})); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_code_in_configs_needs_allow_code(tmp_path, capsys):
    """A config naming ``module:callable`` does not import it unless the user allows it."""
    cfg = tmp_path / "evil.toml"
    cfg.write_text('[model]\nname = "os:system"\noptions = { command = "touch PWNED" }\n'
                   '[data]\nsource = "femnist"\n')
    rc = main(["train", str(cfg), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "--allow-code" in err and "os:system" in err
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()
    cfg2 = tmp_path / "plug.toml"
    cfg2.write_text('plugins = ["os"]\n[problem]\nname = "least-squares"\n')
    rc = main(["run", str(cfg2), "--dry-run"])
    assert rc == 2 and "--allow-code" in capsys.readouterr().err


def test_none_in_toml_sets_an_optional_number_and_round_trips():
    """TOML has no null: ``"none"`` sets an ``X | None`` option (X not a string) to None, and a
    spec holding None where the default is not None is written back as ``"none"``."""
    import tomllib

    from partialfl.config import toml_text

    raw = {"problem": {"name": "least-squares"},
           "privacy": {"name": "dp", "clip_norm": "none", "noise_multiplier": 0.0},
           "backend": {"name": "vmap", "max_examples": "none"}}
    spec = RunSpec.from_dict(raw)
    assert spec.privacy.clip_norm is None and spec.backend.max_examples is None
    text = toml_text(spec.to_dict())
    assert 'clip_norm = "none"' in text
    assert RunSpec.from_dict(tomllib.loads(text)) == spec
    with pytest.raises(ConfigError, match="privacy.noise_multiplier: expected a number"):
        RunSpec.from_dict({**raw, "privacy": {"name": "dp", "noise_multiplier": "nothing"}})
    # a string option keeps "none" as a value (the split named "none")
    assert from_dict(MethodConfig, {"algorithm": "fedavg", "split": "none"}).split.name == "none"
