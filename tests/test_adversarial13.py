"""Adversarial round 13 (issue 21): regression tests for what the thirteenth independent round
found (a reviewer who did not write the fixes), in ``partialfl report`` and ``partialfl
compare`` over received run and study folders.

Found, before, now:

* ``report`` wrote ``per_client_accuracy.png`` with a plain ``fig.savefig``: a planted
  symlink of that name was written through (a file outside the run folder overwritten), and
  a killed write left a truncated plot. Now every plot goes through ``pio.savefig`` (atomic,
  replaces the link).
* ``report`` read its logs, ``metrics.json`` and ``spec.json`` unchecked: a record without
  an integer ``round``, a number given as a list or an integer past the float range, a
  ``spec.json`` whose ``method`` is a string, a DP record missing ``dp_delta`` ended in
  KeyError / TypeError / OverflowError / AttributeError tracebacks (or a message not naming
  the file). Now one line naming the file, record and key.
* ``compare`` read per-client counts and seeds unchecked: counts given as a dict or a seed
  given as a list were tracebacks; nested lists, ``null`` counts, 1e308 examples, booleans
  or counts of another length than ``client_ids`` were tabled as a (wrong) accuracy. A
  crafted ``study.json`` (``runs`` a string, no ``runs``) was a traceback. Now one line.
* ``report`` and ``compare`` followed a ``metrics.json`` / log that is a symbolic link out
  of the run folder and tabled another run's numbers as this one's (``evaluate`` already
  refused a linked ``deploy.safetensors``). Now refused by name.
* A ``folder`` data source with one label 10^15 (or ``num_classes = 10^12``) made the model
  builder allocate an output layer of that many rows: torch's allocator RuntimeError
  traceback (a label of 10^7 allocated 40 GB); a re-signed store header with
  ``num_classes = 10^15`` opened. Now the dataset and the store refuse more than
  ``MAX_CLASSES`` classes in one line; a ``model.options`` width the allocator refuses is a
  one-line MemoryError naming the model.
* ``evaluate`` rebuilt a train run's held-out clients from ``spec.json`` alone: a spec with
  another ``data.seed`` held out training clients and scored them as new ones (exit 0). Now
  the rebuilt clients must be the run's (none in ``metrics.json``, those of
  ``new_clients.json``).
"""

from __future__ import annotations

import json

import pytest
from test_adversarial import _run


def _train_run(path, metrics=None, files=None):
    """A hand-made `partialfl train` run folder: the files `report` reads."""
    path.mkdir(parents=True)
    m = {"method": "ffgg", "test_acc": 0.5, "client_ids": [1, 2, 3],
         "per_client_test_acc": [0.25, 0.5, 0.75]}
    (path / "metrics.json").write_text(metrics if isinstance(metrics, str) else json.dumps(
        m if metrics is None else {**m, **metrics}))
    (path / "stage2.jsonl").write_text('{"round": 0, "test_acc": 0.5}\n')
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_report_never_writes_a_plot_through_a_planted_symlink(tmp_path, capsys):
    run = _train_run(tmp_path / "run")
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep")
    (run / "per_client_accuracy.png").symlink_to(victim)
    rc, err = _run(["report", run], capsys)
    assert rc == 0, err
    assert victim.read_bytes() == b"keep"
    plot = run / "per_client_accuracy.png"
    assert not plot.is_symlink() and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name,text,says", [
    ("stage2.jsonl", '{"round": "x", "test_acc": 0.5}\n', "record 1: round is 'x'"),
    ("stage2.jsonl", '{"test_acc": 0.5}\n', "record 1: round is 'None'"),
    ("stage2.jsonl", '{"round": ' + '9' * 400 + ', "test_acc": 0.5}\n', "record 1: round is"),
    ("stage2.jsonl", '{"round": 0, "test_acc": 0.5, "dp_epsilon": 1.0}\n', "DP record needs"),
    ("stage2.jsonl", '{"round": 0, "test_acc": 0.5, "dp_epsilon": [1], "dp_delta": 0, '
     '"dp_noise_multiplier": 1, "dp_clip_norm": 1}\n', "dp_epsilon is '[1]', not a number"),
    ("stage2_train.jsonl", '{"train_loss": 1.0}\n', "record 1: round is 'None'"),
    ("metrics.json", '{"test_acc": [1]}', "test_acc is '[1]', not a number"),
    ("metrics.json", '{"test_acc": ' + '9' * 400 + '}', "test_acc is"),
    ("metrics.json", '{"per_client_test_acc": {"a": 1}}', "per_client_test_acc is"),
    ("new_clients.json", '{"client_ids": 5}', "client_ids is '5', not a list"),
    ("spec.json", '{"method": "ffgg"}', "method is 'ffgg', not a table"),
    ("spec.json", '{"method": {"algorithm": {"a": 1}}}', "method.algorithm is"),
], ids=["round-str", "round-missing", "round-bigint", "dp-partial", "dp-list", "train-log",
        "acc-list", "acc-bigint", "per-client-dict", "new-ids", "spec-method", "spec-alg"])
def test_report_of_a_crafted_run_folder_is_one_line(tmp_path, capsys, name, text, says):
    run = _train_run(tmp_path / "run", files={name: text})
    rc, err = _run(["report", run, *(["--tensorboard"] if "train" in name else [])], capsys)
    assert rc == 2 and len(err) == 1 and name in err[0] and says in err[0], err


def _compare_run(path, metrics=None, config=None):
    path.mkdir(parents=True)
    (path / "deploy.safetensors").write_bytes(b"")  # compare looks for it only
    m = {"method": "ffgg", "client_ids": [1, 2, 3], "per_client_test_correct": [1, 2, 3],
         "per_client_test_total": [4, 4, 4]}
    (path / "metrics.json").write_text(json.dumps({**m, **(metrics or {})}))
    (path / "config.json").write_text(json.dumps({"method": {"name": "ffgg"}, "seed": 0,
                                                  **(config or {})}))
    return path


@pytest.mark.parametrize("metrics,config,says", [
    ({"per_client_test_correct": {"a": 1}}, None, "per_client_test_correct is"),
    ({"per_client_test_correct": [[1], [2], [3]]}, None, "per_client_test_correct is"),
    ({"per_client_test_correct": None}, None, "per_client_test_correct is 'None'"),
    ({"per_client_test_correct": [1e308, 1, 1], "per_client_test_total": [1e308, 4, 4]},
     None, "per_client_test_correct is"),
    ({"per_client_test_correct": [True, False, True]}, None, "per_client_test_correct is"),
    ({"per_client_test_correct": [1, 2, 3, 4], "per_client_test_total": [4, 4, 4, 4]}, None,
     "not 3 counts"),
    ({"client_ids": "abc"}, None, "client_ids is 'abc'"),
    ({"client_ids": [1, 1, 2]}, None, "client_ids is"),
    (None, {"seed": [1]}, "seed is '[1]'"),
    (None, {"seed": "0"}, "seed is '0'"),
], ids=["dict", "nested", "null", "huge", "bool", "length", "ids-str", "ids-dup",
        "seed-list", "seed-str"])
def test_compare_refuses_crafted_counts_and_seeds(tmp_path, capsys, metrics, config, says):
    run = _compare_run(tmp_path / "run", metrics, config)
    rc, err = _run(["compare", run], capsys)
    assert rc == 2 and len(err) == 1 and says in err[0], err
    assert not (run / "compare.md").exists()


@pytest.mark.parametrize("index", [{"runs": "x"}, {}, {"runs": [1]},
                                   {"runs": [{"folder": [1]}]}],
                         ids=["str", "missing", "ints", "folder-list"])
def test_compare_of_a_crafted_study_index_is_one_line(tmp_path, capsys, index):
    _compare_run(tmp_path / "study" / "a")
    (tmp_path / "study" / "study.json").write_text(json.dumps(
        {"format": "partialfl.study/1", **index}))
    rc, err = _run(["compare", tmp_path / "study"], capsys)
    assert rc == 2 and len(err) == 1 and "study.json: runs is not a list" in err[0], err


@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_metrics_file_linked_from_another_run_is_refused(tmp_path, capsys, command):
    other = _compare_run(tmp_path / "other", {"per_client_test_correct": [4, 4, 4]})
    run = (_train_run if command == "report" else _compare_run)(tmp_path / "run")
    (run / "metrics.json").unlink()
    (run / "metrics.json").symlink_to(other / "metrics.json")
    rc, err = _run([command, run], capsys)
    assert rc == 2 and len(err) == 1 and "metrics.json is a symbolic link" in err[0], err


def _folder_toml(tmp_path, label):
    import numpy as np

    d = tmp_path / "clients"
    d.mkdir()
    rng = np.random.default_rng(0)
    for m in range(5):
        y = rng.integers(0, 3, 14)
        y[0] = label if m == 0 else y[0]
        np.savez(d / f"u{m}.npz", x=rng.integers(0, 255, (14, 28, 28)).astype(np.uint8), y=y)
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'name = "t"\nstages = ["pretrain"]\n[model]\nname = "emnist_cnn"\n'
                   f'[data]\nsource = "folder"\npath = "{d}"\n[method]\nalgorithm = "fedavg"\n'
                   '[pretrain]\nrounds = 1\n')
    return cfg


def test_a_folder_label_of_ten_to_the_fifteen_is_one_line_before_any_allocation(tmp_path,
                                                                                   capsys):
    """A client file with one label 10^15 made the model builder allocate an output layer
    of 10^15 rows (torch's allocator RuntimeError traceback; a label of 10^7 allocated
    40 GB). The dataset now refuses more than MAX_CLASSES classes by name."""
    cfg = _folder_toml(tmp_path, 10 ** 15)
    rc, err = _run(["train", cfg, "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1, err
    from partialfl.data.federated import MAX_CLASSES

    assert f"num_classes must be at most {MAX_CLASSES:,}, got {10 ** 15 + 1}" in err[0], err


def test_a_model_option_too_large_to_allocate_is_one_line(tmp_path, capsys):
    """``model.options.hidden = 10^12`` (12.5 PB of parameters) ended in torch's allocator
    RuntimeError traceback; now a MemoryError line naming the model and model.options."""
    cfg = _folder_toml(tmp_path, 2)
    rc, err = _run(["train", cfg, "--dry-run", "--set", 'model.name="leaf_cnn"', "--set",
                    "model.options.hidden=1000000000000"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert "model 'leaf_cnn': its parameters do not fit in memory" in err[0], err


def test_a_store_header_with_ten_to_the_fifteen_classes_is_refused_at_open(tmp_path):
    """A consistent (re-signed) store header with ``num_classes = 10^15`` opened, and the
    model built on it tried to allocate an output layer of 10^15 rows."""
    from test_store_integrity import _rewrite_header, _store

    from partialfl.data.store import StoreError, open_store

    path = _store(tmp_path)
    _rewrite_header(path, lambda h: h.update(num_classes=10 ** 15))
    with pytest.raises(StoreError, match="num_classes must be an integer in 1..1048576"):
        open_store(path)


def test_evaluate_refuses_a_spec_that_holds_out_training_clients(tmp_path, capsys):
    """`partialfl evaluate` rebuilds the held-out clients from ``spec.json``; one whose
    ``data.seed`` differs from the run's (edited, or copied from another run) held out other
    clients, training clients among them, and their scores were reported as those of clients
    "never seen in training" (exit 0). Now refused by name; the untouched run still
    evaluates."""
    cfg = _folder_toml(tmp_path, 2)
    cfg.write_text(cfg.read_text().replace('stages = ["pretrain"]\n', "").replace(
        'algorithm = "fedavg"', 'algorithm = "ffgg"\nsplit = "output"').replace(
        '[pretrain]', '[personalize]\nrounds = 1\n[finetune]\nepochs = 1\n'
        '[logging]\nprogress = false\n[pretrain]').replace(
        '[data]\n', '[data]\nholdout = 2\n'))
    run = tmp_path / "run"
    assert _run(["train", cfg, "--out", run], capsys)[0] == 0
    assert _run(["evaluate", run, "--no-progress"], capsys)[0] == 0
    trained = json.loads((run / "metrics.json").read_text())["client_ids"]
    spec = json.loads((run / "spec.json").read_text())
    for seed in range(1, 20):  # a data seed that holds out a training client
        from partialfl.build import build
        from partialfl.pipeline.train import load_run_spec

        spec["data"]["seed"] = seed
        if set(build(load_run_spec(data=spec)).new_clients.client_ids) & set(trained):
            break
    else:
        pytest.fail("no data seed in 1..19 holds out a training client")
    (run / "spec.json").write_text(json.dumps(spec))
    rc, err = _run(["evaluate", run, "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "does not describe this run" in err[0], err
