"""Fuzzing what a user (or an attacker) hands partialfl: run specs, TOML text, command-line
arguments and the LEAF / HAPT / Shakespeare files. Each input either works or is refused with
the project's one-line error (ConfigError, DataFormatError, exit code 2) — never a traceback,
another exception or a hang."""

from __future__ import annotations

import json
import string

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from partialfl.cli import main  # noqa: E402
from partialfl.config import ConfigError, from_dict, load_toml  # noqa: E402
from partialfl.data.federated import DataFormatError  # noqa: E402
from partialfl.spec import RunSpec  # noqa: E402

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

KEYS = ["name", "seed", "threads", "backend", "problem", "method", "personalize", "pretrain",
        "finetune", "model", "data", "aggregation", "attack", "privacy", "asynchronous",
        "algorithm", "split", "client", "server", "rounds", "clients_per_round", "tau", "lr",
        "optimizer", "schedule", "warmup", "num_clients", "n", "d_theta", "d_w", "stateless",
        "lam", "mu", "local_steps", "stop", "validation", "stages", "plugins", "kind", "x"]
NAMES = ["ffgg", "fedavg", "least-squares", "cg", "gd", "sgd", "adam", "output", "none",
         "vmap", "processes", "fedbuff", "dp", "femnist", "emnist_cnn", "os:system", "", "..",
         "../../x", "a" * 200, "ffgg\x00", "ümlaut", "1/L", "auto"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(NAMES),
                    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=20)
SPECS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6)


@FAST
@given(SPECS)
def test_any_spec_dict_validates_or_names_the_problem(data):
    try:
        spec = from_dict(RunSpec, data)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e).strip()
        return
    assert isinstance(spec, RunSpec)
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@FAST
@given(st.text(alphabet=string.printable + "[]{}=\"'\\ü\x00", max_size=200))
def test_any_toml_text_loads_or_is_one_line_error(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("t") / "c.toml"
    p.write_text(text, errors="surrogateescape")
    try:
        load_toml(p)
    except ConfigError as e:
        assert str(e)


@pytest.mark.parametrize("depth", [10, 1000, 100_000])
def test_deeply_nested_toml_is_a_one_line_error(tmp_path, depth, capsys):
    p = tmp_path / "deep.toml"
    p.write_text("a = " + "[" * depth + "]" * depth + "\n")
    try:
        data = load_toml(p)
    except ConfigError as e:
        assert "nested" in str(e) or "valid TOML" in str(e)
    else:
        assert "a" in data
    p.write_text("x = " + "{a = " * depth + "1" + "}" * depth + "\n")
    assert main(["run", str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("partialfl: error:")


SMALL = ('[problem]\nname = "least-squares"\nnum_clients = 3\nn = 20\nd_theta = 3\n'
         'd_w = 2\n[personalize]\nrounds = 1\nclient = { name = "cg", tau = 1 }\n')
FLAGS = ["--set", "--out", "--threads", "--device", "--engine", "--dry-run", "--no-progress",
         "--allow-code", "--supernodes", "--superlink", "-x", "--", "=", "personalize.rounds=2",
         "method.algorithm=fedavg", "problem.n=0", "name=../../evil", "threads=0",
         "personalize.client={name=\"gd\",tau=2}", "a.b.c=[1,", "cpu", "tpu", "flower-sim",
         "0", "-1", "99999999999999999999", "nan", "backend=\"processes\"",
         "plugins=[\"os\"]", "model.name=\"os:system\""]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FLAGS), max_size=6))
def test_cli_arguments_exit_cleanly(tmp_path_factory, capsys, args):
    capsys.readouterr()  # what earlier examples printed
    d = tmp_path_factory.mktemp("cli")
    cfg = d / "c.toml"
    cfg.write_text(SMALL)
    try:
        code = main(["run", str(cfg), "--out", str(d / "o"), "--dry-run", *args])
    except SystemExit as e:  # argparse: a usage error
        assert e.code == 2 and "Traceback" not in capsys.readouterr().err
        return
    assert code in (0, 1, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 2:
        assert err.strip().startswith("partialfl: error:") and len(err.strip().splitlines()) == 1
    assert not list(d.parent.glob("evil*"))


# ----------------------------------------------------------------------------- loaders
LEAF_VALUES = st.recursive(
    st.one_of(st.none(), st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=3)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(["users", "num_samples",
                                                             "user_data", "x", "y", "u0"]),
                                            inner, max_size=4)), max_leaves=25)


@FAST
@given(LEAF_VALUES)
def test_leaf_json_loads_or_names_the_file(tmp_path_factory, doc):
    from partialfl.data.leaf import load_leaf_femnist

    d = tmp_path_factory.mktemp("leaf")
    (d / "train").mkdir()
    (d / "test").mkdir()
    for part in ("train", "test"):
        (d / part / "all_data.json").write_text(json.dumps(doc))
    try:
        load_leaf_femnist(d)
    except (DataFormatError, FileNotFoundError) as e:
        assert str(e)


ROWS = st.lists(st.one_of(st.just("1 2 3"), st.just("0.1 -0.2 9.8"), st.just("1 2"),
                          st.just("nan 1 2"), st.just("a b c"), st.just(""),
                          st.just("1e400 0 0")), max_size=300)
LABELS = st.lists(st.one_of(st.just("1 1 1 0 129"), st.just("1 1 2 130 299"),
                            st.just("2 1 3 0 200"), st.just("1 1 1 50 20"), st.just("1 1 1"),
                            st.just("1 1 1 0 99999"), st.just("x 1 1 0 1")), max_size=6)


@FAST
@given(ROWS, LABELS)
def test_hapt_files_load_or_name_file_and_line(tmp_path_factory, rows, labels):
    from partialfl.data.har import load_hapt

    raw = tmp_path_factory.mktemp("hapt") / "RawData"
    raw.mkdir()
    for e in (1, 2):
        for kind in ("acc", "gyro"):
            (raw / f"{kind}_exp0{e}_user01.txt").write_text("\n".join(rows) + "\n")
    (raw / "labels.txt").write_text("\n".join(labels) + "\n")
    try:
        load_hapt(raw, window=16)
    except DataFormatError as e:
        assert str(e)


@FAST
@given(st.text(alphabet=string.ascii_letters + " :\n.,'!?", max_size=2000))
def test_shakespeare_text_loads_or_names_the_file(tmp_path_factory, text):
    from partialfl.data.shakespeare import load_shakespeare

    p = tmp_path_factory.mktemp("sh") / "plays.txt"
    p.write_text(text)
    try:
        load_shakespeare(path=p, min_train=1, min_test=1, vocab_size=50)
    except DataFormatError as e:
        assert str(e)
