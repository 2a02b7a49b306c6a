"""Adversarial round 31b (issue 21 areas 1, 3, 4, 6, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found; each failed on the code it was written
against (adv31b at b9479e4) because of the defect it names, and passes since the fix."""

from __future__ import annotations

from _adv_cli import cli as _cli
from _adv_cli import femnist_toml

_TINY = femnist_toml("tiny", clients_per_round=2, batch_size=64, eval_every=False,
                     finetune=False)


# -- area 6 / 8: a study's up-front check does not apply the code opt-in ---------------------
def test_a_study_sweeping_to_code_is_refused_before_anything_runs(tmp_path, data_dir):
    (tmp_path / "tiny.toml").write_text(_TINY)
    r = _cli(tmp_path, data_dir, "train", "tiny.toml", "--dry-run", "--out", "sw",
             "--sweep", "model.name=emnist_cnn,os:system")
    assert r.returncode == 2, (r.returncode, r.stdout[-300:], r.stderr[-300:])
    assert "--allow-code" in r.stderr.strip().splitlines()[-1]


# -- area 7: a re-signed header's x_scale overflows float32 --------------------------------
def test_a_resigned_x_scale_never_yields_non_finite_inputs(tmp_path):
    import torch
    from test_store_integrity import _rewrite_header, _store

    from partialfl.data.store import StoreError, open_store

    path = _store(tmp_path)
    _rewrite_header(path, lambda h: h.update(x_scale=1e38))
    try:
        ds = open_store(path)
        xs = [ds.train_x[m] for m in range(ds.num_clients)]
    except StoreError:
        return  # refused at open or on read: fine
    assert all(bool(torch.isfinite(x).all()) for x in xs), "inf inputs from a valid store"


# -- area 8: a closed-form run whose curve grows huge ----------------------------------------
_DIVERGING = """\
seed = 0
[problem]
name = "least-squares"
num_clients = 8
n = 80
d_theta = 10
d_w = 5
seed = 0
[method]
algorithm = "ffgg"
w_init = "zero"
[personalize]
rounds = 100
clients_per_round = 4
eval_every = 25
client = { name = "cg", tau = 5 }
server = { optimizer = "sgd", lr = "50/L" }
"""


def test_a_diverging_closed_form_run_ends_in_one_line_not_a_plot_traceback(tmp_path):
    (tmp_path / "div.toml").write_text(_DIVERGING)
    r = _cli(tmp_path, tmp_path, "run", "div.toml", "--out", "o", "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    assert r.returncode in (0, 2), (r.returncode, r.stderr[-300:])
