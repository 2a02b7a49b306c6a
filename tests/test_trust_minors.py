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
