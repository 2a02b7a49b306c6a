"""Adversarial round 56b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against a3ac3f9), entered through a researcher's own
model and data (``model.name = "module:callable"`` with ``--allow-code``, a ``folder`` of
per-client ``.npz`` files). Each test failed on the code it was written against because of
the defect it names, and passes since the fix: the new clients' evaluation scores their
training data only when they have some (:func:`partialfl.pipeline.evaluation._on_train`);
``method.weighting = "examples"`` makes the default mean weighted and is refused in one line
with a rule that drops the weights (:func:`partialfl.build.algorithm._weighting`).

* Area 8 (a run that can never finish), round 54b's fix for held-out clients is partial: a
  held-out (new) client with test examples but NO training example — a cold-start client,
  which the README allows ("A client may have zero test (or train) examples"; a client file
  with ``train_x``/``train_y`` of 0 rows and ``test_x``/``test_y`` of 3) — strands the run:
  ``partialfl train`` pre-trains, personalizes, fine-tunes and writes ``deploy.safetensors``
  and ``metrics.json``, then ends with ``partialfl: error: no example to evaluate on (every
  client has total = 0)``, exit 2, no ``report.md``, no ``new_clients.json`` — and every
  rerun of the same command fails the same way. The message is false: the held-out client
  has 3 test examples (the run's own "before fine-tuning" score of them is computable).
  :func:`partialfl.build.run._build_model_run` refuses, before training, held-out clients
  with no *test* example only; :func:`partialfl.pipeline.evaluation.evaluate_new_clients`
  then also scores the new clients' *train* split, and
  :func:`partialfl.pipeline.evaluation.summarize_counts` raises on its 0 examples. The same
  new-client files given to ``partialfl evaluate RUN --data DIR`` are refused with the same
  false message (exit 2). Suspected root cause: ``evaluate_new_clients`` (an empty train
  split of the new clients is an error, not "no train metrics"), with the build check
  covering test examples only.

* Area 3/8 (an option that does nothing), ``[method] weighting = "examples"`` — documented as
  "aggregation weights: uniform or examples" (docs/config.md; FedAvg's classic
  example-weighted average) — changes nothing under the default aggregation: a user's
  model on clients of 12–24 examples gives a bit-identical θ (``theta_stage2.safetensors``)
  and ``test_loss`` (1.059427839059096) with ``weighting = "uniform"`` and ``"examples"``; no
  warning, and ``config.json`` / the report record ``weighting: examples``. The algorithms
  do send each client's example count as its weight (:func:`partialfl.algorithms.common.
  client_weights`, ``FFGG.client_update``), but the default rule is
  :class:`partialfl.aggregation.basic.Mean` with ``weighted = False``, which drops the
  weights; only with ``[aggregation] name = "mean", weighted = true`` added does the
  weighting act (test_loss 1.0593260526657104). Expected: ``weighting = "examples"`` weights
  the default mean by examples, or the spec refuses / warns that the aggregator ignores
  it. Suspected root cause: the build (:func:`partialfl.build.algorithm.build_algorithm`'s
  default aggregator: an unweighted ``Mean`` whatever ``method.weighting`` says).

Tried and held (run unless marked "read"): kill -9 of ``partialfl train`` (a user's model,
``[validation]`` + ``[finetune_grid]``, ``checkpoint_every = 1``) at each of its
1st–23rd ``os.replace`` calls (checkpoints ``stage1.g*.server.ckpt``, ``stage1.ckpt``,
``stage2*.ckpt``, timing, θ files, ``personalized/``, ``deploy.safetensors``), then the same
command again: metrics identical to an uninterrupted run (timings aside), no temporary file
left; kill -9 of ``reproduce async --quick`` (spawn workers of its real-concurrency run) at
2, 4, 6 and 8 s: no worker process left, the rerun into the same ``--out`` finishes;
``[attack]`` on a model run: ``bit-flip`` bits [64] / [-1], ``alie`` z = nan, ``alie-opt``
evals 0 / ratio 1 (one line, exit 2), ``alie`` z = 1e308 against ``tm`` δ 0.2 (runs, finite,
accuracies sane), the same run on ``processes`` / ``threads`` workers (metrics identical to
sequential) and ``vmap`` (train loss within rounding); ``[validation]`` with
``min_examples = 100`` / ``fraction = 0.99`` (capped as documented), ``[finetune_grid]``
with ``epochs = []`` (one line), ``lr = [1e308]`` / ``[1e30]`` (chosen on validation, finite);
a training client with no training example (runs); ``evaluate --data`` with new clients of
1 example each (one line: none to test), of 1 train + 3 test (runs); ``advise`` on a user's
config, on a config with a cold-start client, on a text (transformer) config, and on one
with a token beyond the vocabulary (one line, nothing written); ``compare`` of runs on
other clients (one line), of a closed-form / reproduction folder (one line); a closed-form
asynchronous FedBuff run with ``[attack]`` and ``tm`` (runs; it writes no checkpoint, as
documented); ``[asynchronous]`` concurrency 0 / 10⁵, speed_sigma 1e308 / 50, pareto shape
0.01 / 1e-300, log-normal shape 700, fedbuff buffer 1000, staleness a = −1 (one line, exit 2),
a = 1e308, constant duration 0 / 1e-320 (run); kill -9 of ``train --overwrite`` (with a new
server lr) at 10 of its ``unlink`` / ``rmdir`` calls, then the same command: metrics equal to
a fresh run of the new config (without ``--overwrite``: "holds a finished run", one line);
kill -9 of a run at two checkpoints, then the same command with a changed lr, seed,
data.seed, validation, finetune_grid, model option, model width or one client's labels
(refused in one line each: "different configuration" / "belongs to a different run"); kill
-9 of a ``spawn``-pool run at four ``os.replace`` instants (no worker left, the resumed run
equal to an uninterrupted one); the plugin ``toy_plugin`` (algorithm ``toy``, rule
``drop-largest``) on a user's model under sequential, ``processes`` spawn / forkserver and
``threads`` (equal accuracies), and against ``[attack]`` fraction 0.3 (an
``UnprotectedWarning``: the rule states no tolerance; with ``nnm`` and δ 0.2 refused in one
line); ``tm`` δ 0.4 with 2 Byzantine of 7 clients and cohorts of 3–7 (per-round warning and
``byz_excess`` count when the cohort holds more than f); run names ``../escape``, absolute,
``..``, ``.``, ``' '`` (one line). Observed, not filed: a run killed mid-stage and resumed
after the user changed the model's code without changing its parameters (``nn.ReLU`` →
``nn.Tanh``) resumes silently from the old checkpoint (the run fingerprint covers the
config, data and parameter shapes, not the code).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _adv_cli import env
from _user_project import TINY_MODEL, client_folder, tiny_toml


def _cli(cwd, *args, timeout: float = 170):
    return subprocess.run([sys.executable, "-m", "partialfl", *args], cwd=cwd, env=env(None),
                          capture_output=True, text=True, timeout=timeout)


def _cold_start_folder(root):
    """8 ordinary clients (user0..user7) and ``user9``: 0 training examples, 3 test
    examples. With 9 clients, ``data.seed = 4`` holds out exactly ``user9``."""
    client_folder(root, clients=8)
    np.savez(root / "user9.npz", train_x=np.zeros((0, 4, 4), np.uint8),
             train_y=np.zeros(0, np.int64), test_x=np.full((3, 4, 4), 100, np.uint8),
             test_y=np.array([0, 1, 2]))
    return root


def _held_out(seed: int = 4, m: int = 9) -> int:
    from partialfl.rng import generator

    return int(generator(seed, "split_clients").permutation(m)[0])


def test_cold_start_held_out_client_does_not_strand_the_run(tmp_path):
    """Found: exit 2 after training ("no example to evaluate on (every client has total =
    0)"), no report.md. Expected: the run finishes (report.md), or it is refused before
    anything trains."""
    assert _held_out() == 8  # user9, the last of 9 sorted client files
    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = _cold_start_folder(tmp_path / "data")
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:tiny", data)
    out = tmp_path / "runs" / "cold"
    p = _cli(tmp_path, "train", str(cfg), "--allow-code", "--out", str(out),
             "--set", "data.seed=4")
    if p.returncode == 0:
        assert (out / "report.md").is_file()
        return
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-600:]
    assert not (out / "deploy.safetensors").exists() and not (out / "stage1").exists(), \
        f"refused only after training: {p.stderr.strip().splitlines()[-1]}"


def test_control_held_out_client_with_one_training_example_finishes(tmp_path):
    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = _cold_start_folder(tmp_path / "data")
    np.savez(data / "user9.npz", train_x=np.full((1, 4, 4), 50, np.uint8),
             train_y=np.array([1]), test_x=np.full((3, 4, 4), 100, np.uint8),
             test_y=np.array([0, 1, 2]))
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:tiny", data)
    out = tmp_path / "runs" / "one"
    p = _cli(tmp_path, "train", str(cfg), "--allow-code", "--out", str(out),
             "--set", "data.seed=4")
    assert p.returncode == 0, p.stderr[-600:]
    assert (out / "report.md").is_file()


def test_evaluate_data_of_cold_start_clients(tmp_path):
    """Found: exit 2, "no example to evaluate on (every client has total = 0)" although the
    new clients hold 6 test examples. Expected: their test accuracy (w at the run's w_pre:
    nothing to fine-tune on), or a refusal that names the missing training examples."""
    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:tiny", data)
    out = tmp_path / "runs" / "ok"
    p = _cli(tmp_path, "train", str(cfg), "--allow-code", "--out", str(out))
    assert p.returncode == 0, p.stderr[-600:]
    new = tmp_path / "new"
    new.mkdir()
    for m in range(2):
        np.savez(new / f"c{m}.npz", train_x=np.zeros((0, 4, 4), np.uint8),
                 train_y=np.zeros(0, np.int64), test_x=np.full((3, 4, 4), 100, np.uint8),
                 test_y=np.array([0, 1, 2]))
    q = _cli(tmp_path, "evaluate", str(out), "--data", str(new), "--allow-code",
             "--no-progress", "--json")
    if q.returncode == 0:
        import json

        assert json.loads(q.stdout)["ok"]["before"]["total"] == 6.0, q.stdout[:600]
        return
    assert "Traceback" not in q.stderr, q.stderr[-600:]
    assert "every client has total = 0" not in q.stderr, q.stderr.strip().splitlines()[-1]


def _weighting_run(tmp_path, weighting: str, extra: str = ""):
    from safetensors.torch import load_file

    (tmp_path / "usermodels.py").write_text(TINY_MODEL)
    data = tmp_path / "data"
    if not data.exists():
        client_folder(data, clients=8)  # 12, 14, ..., 26 examples: unequal weights
    cfg = tiny_toml(tmp_path / f"{weighting}{len(extra)}.toml", "usermodels:tiny", data, extra)
    out = tmp_path / "runs" / f"{weighting}{len(extra)}"
    p = _cli(tmp_path, "train", str(cfg), "--allow-code", "--out", str(out),
             "--set", f"method.weighting={weighting}")
    assert p.returncode == 0, p.stderr[-600:]
    return p, load_file(str(out / "theta_stage2.safetensors"))


def test_control_weighted_mean_makes_examples_weighting_act(tmp_path):
    agg = '[aggregation]\nname = "mean"\nweighted = true\n'
    _, a = _weighting_run(tmp_path, "uniform", agg)
    _, b = _weighting_run(tmp_path, "examples", agg)
    assert any(not bool((a[n] == b[n]).all()) for n in a)


def test_examples_weighting_acts_or_is_refused(tmp_path):
    """Found: θ after stage 2 bit-identical under ``weighting = "uniform"`` and
    ``"examples"`` (clients of 12–26 examples), exit 0, no warning. Expected: θ differs, or
    the spec says the weighting has no effect with this aggregation (warning / refusal)."""
    _, a = _weighting_run(tmp_path, "uniform")
    p, b = _weighting_run(tmp_path, "examples")
    said = "weight" in p.stderr.replace(str(tmp_path), "").lower()
    assert said or any(not bool((a[n] == b[n]).all()) for n in a), \
        "weighting = 'examples' left θ bit-identical to 'uniform', without a word"


@pytest.mark.parametrize("aggregation", [{"name": "cm"}, {"name": "mean"},
                                         {"name": "gm", "weighted": True, "bucketing": 2}])
def test_examples_weighting_with_a_rule_that_drops_the_weights_is_refused(aggregation):
    """The fix's other half: a rule that ignores the weights (unweighted, or behind bucketing)
    refuses ``weighting = "examples"`` naming the rule; the default mean and a weighted one
    weigh (the default's ``weighted`` is then true)."""
    from _flower_sims import ls_spec

    from partialfl.build import build
    from partialfl.config import ConfigError
    from partialfl.spec import RunSpec

    spec = ls_spec(2, method={"algorithm": "fedavg", "weighting": "examples"},
                   personalize={"client": {"name": "gd", "tau": 2}})
    with pytest.raises(ConfigError, match=f"aggregation {aggregation['name']!r} does not "
                       "weight"):
        build(RunSpec.from_dict({**spec, "aggregation": aggregation}))
    assert build(RunSpec.from_dict(spec)).algorithm.aggregator.weighted
    weighted = {"aggregation": {"name": "mean", "weighted": True}}
    assert build(RunSpec.from_dict({**spec, **weighted})).algorithm.aggregator.weighted
