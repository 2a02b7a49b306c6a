"""Adversarial round 57b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 497a5b3: round 56b's ``_weighting`` and
``_on_train``), entered through the algorithms an ``[aggregation]`` / ``weighting`` reaches
and a researcher's own model and data (``model.name = "module:callable"`` with
``--allow-code``, a ``folder`` of per-client ``.npz`` files). Each test below its controls
failed on that code because of the defect it names, and passes since the fix: L2GD takes the
run's aggregation rule and refuses ``weighting = "examples"``; a full-participation
algorithm refuses ``[asynchronous]`` at build; a rule is refused under ``"examples"`` only
when it says it drops the weights (built-in rules declare ``weighted``; a researcher's rule
is taken at its word); ``evaluate`` refuses a non-positive ``--lr`` for every algorithm and
marks a fine-tuning whose test loss is not finite as diverged (warning, exit 1).

* Area 3 (a robust rule that does nothing), ``[aggregation]`` on ``algorithm = "l2gd"`` (a
  closed-form run, ``partialfl run``) is accepted and silently ignored: with ``name = "cm"``
  (coordinate-wise median), ``"tm"`` (δ 0.2) or any other rule the run's θ and w are
  bit-identical to the plain mean's (least squares, 8 clients, 20 rounds, full
  participation; ``summary.md`` records the ``[aggregation]`` table) — while the same rule on
  ``fedavg`` moves θ by 0.2. ``_l2gd`` (:mod:`partialfl.algorithms.l2gd`) builds ``L2GD(tau,
  lam, p)`` and takes only ``ctx.server_opt`` from the context, never ``ctx.aggregator``
  (nor ``ctx.weighting``: its updates carry ``np.ones`` weights), so the algorithm aggregates
  with :class:`~partialfl.algorithms.base.Algorithm`'s default ``Mean()``. A user who asks
  for a robust server without simulating an attacker (a deployment's attackers are real:
  what ``wrap_algorithm`` says of MoNNA) gets the mean, which one huge input moves
  anywhere, without a word; only under ``[attack]`` does the Byzantine wrapper apply the
  rule. Round 56b's fix made ``method.weighting`` refuse a rule that drops the weights; the
  rule itself dropped by the algorithm is the same "option that does nothing". Suspected
  root cause: ``_l2gd`` (no ``aggregator`` passed to ``L2GD``, or the build refusing
  ``[aggregation]`` / ``weighting = "examples"`` for an algorithm that does not aggregate
  through them).

* Area 8 (a bad CLI input accepted), ``partialfl evaluate RUN --lr 0`` of a Ditto (or
  local-only) run runs and prints the table (exit 0): the new clients train with the run's
  own learning rate instead, as if ``--lr`` had not been given. The same option on an FFGG run
  is one line, exit 2 ("lr must be a positive finite number, got 0.0"), and ``--lr nan`` /
  ``-1`` are refused on every run (``SGDConfig``). Cause:
  :func:`partialfl.pipeline.evaluation._evaluate_new_full_personal` takes ``lr or
  (the run's lr)`` — a falsy 0 falls through to the default (``batch_size or …`` alike).

* Area 3/8 (a valid configuration refused with a false message), round 56b's fix refuses
  ``method.weighting = "examples"`` with every registered rule of a researcher's own (a
  ``plugins`` module registering a rule with :func:`partialfl.aggregation.compose.
  register_rule`, the documented way: docs/architecture.md, "A module outside partialfl
  registers the same way") — even a rule that weighs each row by the weight it is given, as
  the aggregator protocol (``__call__(vectors, weights)``) hands it: ``partialfl run
  wp.toml --allow-code`` with ``[aggregation] name = "wmean"`` (a weighted mean) ends
  "method.weighting = 'examples': aggregation 'wmean' does not weight the clients' updates;
  allowed: weighted = true in [aggregation] (mean, gm; without bucketing) ...", exit 2 —
  before round 56b the same run trained with the example weights. The check
  (:func:`partialfl.build.algorithm._weighting`) reads an undocumented ``weighted``
  attribute (``getattr(rule, "weighted", False)``) that only the built-in ``Mean`` and
  ``GeometricMedian`` carry; the plugin interface (docs/architecture.md's table, the toy
  ``DropLargest``) never mentions it, and ``[aggregation] weighted = true`` is refused for
  the plugin ("unknown key 'aggregation.weighted'"). Expected: a rule of unknown weighting is
  trusted (or warned about), or the interface documents how a rule declares it.

* Area 1/8 (a configuration error counted as client failures), ``algorithm = "l2gd"`` (its
  entry declares ``full_participation``: "one call for every client") with an
  ``[asynchronous]`` block (``fedasync`` concurrency 2, or ``fedbuff`` buffer 4) is accepted
  by the build and by ``partialfl run --dry-run`` ("dry run: nothing trained, nothing
  written", exit 0); the run then sends one client per job, every one raises in
  ``L2GD.client_update`` and is reported as a client failure ("skipping client 3 (job 1):
  it failed (ValueError: L2GD needs full participation (clients_per_round = all))", four such
  lines) until the stall check ends the run (exit 2, ``l2.jsonl`` left in ``--out``). The
  synchronous path refuses the same misfit before anything runs
  (:func:`partialfl.build.run._build_closed_form`: "personalize.clients_per_round: l2gd needs
  full participation (0 = all clients)"), but that check looks at ``clients_per_round``
  only, never at ``spec.asynchronous`` (whose steps each aggregate 1 or K arriving updates).
  Expected: a ``ConfigError`` from the build (so ``--dry-run`` says it), no client counted as
  failed. Suspected root cause: ``_build_closed_form``'s ``full_participation`` check.

* Area 8 (a diverged evaluation that does not say so), ``partialfl evaluate RUN --lr 1e300``
  (a positive finite number: accepted) fine-tunes the new clients' w into NaN and prints the
  accuracy of the NaN model as the result: a FedRep run on a user's model gives "after
  fine-tuning 40.00%" in the table and, with ``--json``, ``"diverged": null``, ``"loss":
  NaN``, exit 0, nothing on stderr (the accuracy is argmax over NaN logits; an FFGG run: 0%,
  loss NaN, ``diverged`` null, the case tested; lrs up to 1e20 stay finite). ``partialfl
  train`` with the same fine-tuning lr says "the run diverged ..." (round 53b), and
  ``evaluate``'s own report warns about runs whose *training* diverged (``pipeline.runs``:
  ``diverged`` from ``run_divergence(run)``), but the divergence of the fine-tuning
  ``evaluate`` itself runs is never checked. Expected: the
  evaluation marked diverged (``diverged`` set, a warning), or refused. Suspected root cause:
  :mod:`partialfl.pipeline.runs` / :func:`partialfl.pipeline.evaluation.evaluate_run`
  (``diverged`` read from the run folder only; the new clients' fine-tuned loss not looked
  at).

Tried and held (run unless marked "read"): cold-start held-out clients (0 training, 3 test
examples) through ``train`` of ``ffgg``, ``fedavg`` with ``finetune_split``, ``fedrep``,
``ditto``, ``local`` and ``apfl`` on a user's model (each finishes, ``new_clients.json``
written), then ``evaluate`` (text and ``--json``: no ``train`` entry, ``before`` / ``test``
of 3 examples), ``report`` and ``compare`` of four such runs (the new-client section says
one client, no interval); a cold-start TRAINING client under ``vmap`` and ``threads`` for
``ffgg``, ``ditto``, ``fedrep`` (finish); ``ditto``, ``local``, ``fedrep`` on
``sequential`` / ``threads`` / ``processes`` (metrics identical); ``PersonalizedModels.load``
+ ``evaluate(data=...)`` and ``load_personalized`` of every such run (pooled accuracy equal to
``metrics.json``); kill -9 of a Ditto ``train`` (``checkpoint_every = 1``, client-side
checkpoints ``stage2.g*.client-side.ckpt``, ``client_state_stage2.client-side.safetensors``)
at each of its 1st–41st ``os.replace`` calls, then the same command: ``metrics.json`` equal to
an uninterrupted run (timings aside), no temporary file (at ``run_files.json``: "holds a
finished run", as documented); ``method.weighting`` ``"Examples"`` / ``1`` / ``"none"`` (one
line, exit 2); ``evaluate DITTO_RUN --lr nan`` / ``-1`` (one line, exit 2); ``[aggregation]
weighted = true`` on a plugin rule (one line); (read) ``_weighting``'s walk through
``StaticClipping`` / ``ARC`` / NNM to the rule, stopping at ``Bucketing`` (refused, as
documented); the store's CRC sidecar (keyed by inode, size, mtime and ctime; a racy window of
2 s). Observed, not filed: the pretraining stage (FedAvg, ``stage_algorithm``'s
``MethodConfig(algorithm="fedavg")``) aggregates uniformly whatever ``method.weighting``
says (``[aggregation]`` does reach it); ``evaluate`` of an APFL run trains the new clients'
``v`` alone (λ 0), not APFL's α-mixture its training clients deploy.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _adv_cli import env
from _flower_sims import ls_spec
from _user_project import TINY_MODEL, client_folder, tiny_toml


def _cli(cwd, *args, timeout: float = 170):
    return subprocess.run([sys.executable, "-m", "partialfl", *args], cwd=cwd, env=env(None),
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- area 3
def _closed_form(algorithm: str, aggregation: dict | None):
    """θ, w after 20 full-participation rounds of ``algorithm`` on least squares, or the
    ConfigError the build raises."""
    from partialfl.build import build
    from partialfl.config import ConfigError
    from partialfl.pipeline.closed_form import run_closed_form
    from partialfl.spec import RunSpec

    spec = ls_spec(20, 0, method={"algorithm": algorithm, "w_init": "zero"},
                   personalize={"client": {"name": "gd", "tau": 3}})
    if aggregation is not None:
        spec["aggregation"] = aggregation
    try:
        s = RunSpec.from_dict(spec)
        res = run_closed_form(s, built=build(s))
    except ConfigError as e:
        return e
    return {n: np.asarray(v) for n, v in res.state.theta.items()}


def test_control_aggregation_acts_on_fedavg():
    a = _closed_form("fedavg", None)
    b = _closed_form("fedavg", {"name": "cm"})
    assert any(np.abs(a[n] - b[n]).max() > 1e-3 for n in a)


@pytest.mark.parametrize("aggregation", [{"name": "cm"}, {"name": "tm", "delta": 0.2}])
def test_l2gd_aggregation_acts_or_is_refused(aggregation):
    """Found: θ and w bit-identical to the plain mean's, no warning. Expected: the rule
    aggregates (θ differs), or the build refuses ``[aggregation]`` for l2gd in one line."""
    a = _closed_form("l2gd", None)
    b = _closed_form("l2gd", aggregation)
    if isinstance(b, Exception):
        return  # refused (a ConfigError: one line on the CLI)
    assert any(np.abs(a[n] - b[n]).max() > 0 for n in a), \
        f"[aggregation] {aggregation} left l2gd's θ bit-identical to the mean's"


# ----------------------------------------------------------------------------- area 1/8
@pytest.mark.parametrize("rule", [{"rule": "fedasync", "concurrency": 2},
                                  {"rule": {"name": "fedbuff", "buffer": 4}, "concurrency": 4}])
def test_control_async_rule_builds_for_fedavg(rule):
    from partialfl.build import build
    from partialfl.spec import RunSpec

    spec = ls_spec(4, 0, method={"algorithm": "fedavg"}, asynchronous=rule,
                   personalize={"client": {"name": "gd", "tau": 3}})
    build(RunSpec.from_dict(spec))


@pytest.mark.parametrize("rule", [{"rule": "fedasync", "concurrency": 2},
                                  {"rule": {"name": "fedbuff", "buffer": 4}, "concurrency": 4}])
def test_l2gd_asynchronous_is_refused_by_the_build(rule):
    """Found: built (``--dry-run`` exit 0), then every client job fails with "L2GD needs
    full participation". Expected: a ConfigError naming the misfit, before anything runs."""
    from partialfl.build import build
    from partialfl.config import ConfigError
    from partialfl.spec import RunSpec

    spec = ls_spec(4, 0, method={"algorithm": "l2gd"}, asynchronous=rule,
                   personalize={"client": {"name": "gd", "tau": 3}})
    with pytest.raises(ConfigError):
        build(RunSpec.from_dict(spec))


# ----------------------------------------------------------------------------- area 8
@pytest.fixture(scope="module")
def ditto_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ditto")
    (root / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(root / "data", clients=6)
    cfg = tiny_toml(root / "cfg.toml", "usermodels:tiny", data, name="ditto")
    cfg.write_text(cfg.read_text().replace('algorithm = "ffgg"\nsplit = "output"\n',
                                           'algorithm = "ditto"\noptions = { lam = 0.1 }\n'))
    out = root / "runs" / "ditto"
    p = _cli(root, "train", str(cfg), "--allow-code", "--out", str(out))
    assert p.returncode == 0, p.stderr[-600:]
    return root, out


@pytest.mark.parametrize("lr", ["nan", "-1"])
def test_control_evaluate_ditto_bad_lr_is_one_line(ditto_run, lr):
    root, out = ditto_run
    p = _cli(root, "evaluate", str(out), "--allow-code", "--no-progress", "--lr", lr)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-400:]


def test_evaluate_ditto_lr_zero_is_refused(ditto_run):
    """Found: exit 0, the table printed with the run's own lr. Expected: one line, exit 2,
    as ``evaluate FFGG_RUN --lr 0`` ("lr must be a positive finite number, got 0.0")."""
    root, out = ditto_run
    p = _cli(root, "evaluate", str(out), "--allow-code", "--no-progress", "--lr", "0")
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stdout[-300:])


@pytest.fixture(scope="module")
def ffgg_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ffgg")
    (root / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(root / "data", clients=6)
    cfg = tiny_toml(root / "cfg.toml", "usermodels:tiny", data, name="ffgg")
    out = root / "runs" / "ffgg"
    p = _cli(root, "train", str(cfg), "--allow-code", "--out", str(out))
    assert p.returncode == 0, p.stderr[-600:]
    return root, out


def _evaluate_json(root, out, lr: str):
    import json

    p = _cli(root, "evaluate", str(out), "--allow-code", "--no-progress", "--json",
             "--lr", lr)
    # exit 1: the results printed, with a divergence warning (as `partialfl train`)
    return p, (json.loads(p.stdout)[out.name] if p.returncode in (0, 1) else None)


def test_control_evaluate_finite_lr_is_finite(ffgg_run):
    p, r = _evaluate_json(*ffgg_run, "0.05")
    assert p.returncode == 0 and np.isfinite(r["test"]["loss"]), p.stderr[-400:]


def test_evaluate_diverged_finetuning_says_so(ffgg_run):
    """Found: exit 0, ``"diverged": null``, test loss NaN, an accuracy printed as the
    result, nothing on stderr. Expected: the evaluation marked diverged (or a warning /
    one-line refusal)."""
    p, r = _evaluate_json(*ffgg_run, "1e300")
    if r is None:
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-400:]
        return
    assert not np.isfinite(r["test"]["loss"])  # the fine-tuned model is NaN
    said = r.get("diverged") or "diverg" in p.stderr.lower() or "finite" in p.stderr.lower()
    assert said, (r.get("diverged"), r["test"]["accuracy"], p.stderr[-300:])
    assert p.returncode == 1  # as `partialfl train` ends a diverged run


# ----------------------------------------------------------------------------- area 3/8
WMEAN = """
from dataclasses import dataclass
import numpy as np
from partialfl.aggregation import to_numpy
from partialfl.aggregation.compose import AggregatorOptions, register_rule


@dataclass(frozen=True)
class WMean:
    \"\"\"A weighted mean: each row weighs the weight it is given.\"\"\"

    def __call__(self, vectors, weights=None):
        X, back = to_numpy(vectors)
        a = np.ones(len(X)) if weights is None else np.asarray(weights, np.float64)
        return back(((a[:, None] * X.astype(np.float64)).sum(0) / a.sum()).astype(X.dtype))


@dataclass(frozen=True)
class WOpts(AggregatorOptions):
    \"\"\"No options.\"\"\"


register_rule("wmean", WMean, WOpts, doc="A weighted mean (a researcher's rule).")
"""


def _plugin_run(tmp_path, weighting: str):
    (tmp_path / "wplug.py").write_text(WMEAN)
    cfg = tmp_path / f"{weighting}.toml"
    cfg.write_text(f"""plugins = ["wplug"]
name = "wp"
[problem]
name = "least-squares"
num_clients = 8
n = 200
d_theta = 5
d_w = 3
[method]
algorithm = "fedavg"
weighting = "{weighting}"
[aggregation]
name = "wmean"
[personalize]
rounds = 3
clients_per_round = 0
client = {{ name = "gd", tau = 3 }}
""")
    return _cli(tmp_path, "run", str(cfg), "--allow-code", "--out", str(tmp_path / weighting))


def test_control_plugin_weighted_rule_runs_uniform(tmp_path):
    p = _plugin_run(tmp_path, "uniform")
    assert p.returncode == 0, p.stderr[-400:]


def test_plugin_weighted_rule_accepts_examples_weighting(tmp_path):
    """Found: exit 2, "aggregation 'wmean' does not weight the clients' updates". Expected:
    the run (the rule weighs the example counts it is given)."""
    p = _plugin_run(tmp_path, "examples")
    assert p.returncode == 0, p.stderr.strip().splitlines()[-1]
