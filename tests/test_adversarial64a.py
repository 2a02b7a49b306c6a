"""Adversarial round 64a (issue 21, areas 2, 5 and 6 on Flower, tried again from scratch by
someone who did not write the fixes, against 323a8f0), going wide: every registered
algorithm on the loopback ServerApp against the in-process run (least squares and a user's
tiny model), DP (central, central + SecAgg+, local, local + SecAgg+, adaptive clipping) on
Flower, ``[attack]`` / ``[faults]`` / robust rules on Flower, zero-round and
sparse-evaluation stages, the node's code check against specs that name code in every
component slot, and ``flower node-data`` with careless options. Each test below (but the
controls) failed on that code because of the defect it names, and passes since the fix: the
``dp`` wrapper's build resolves the DP plan for the run's clients and refuses a stage with
more rounds than the budget or another cohort than the DP options' (``algorithms.dp._dp``),
so ``--dry-run`` and the ServerApp refuse in one line before any SuperNode is asked; FedRep
with a ``gd`` client runs, an epoch of the gd client being one full-gradient step
(``algorithms.presets._fedrep``).

* Area 8/2 (a configuration that can never run passes every check before Flower starts), a
  ``[privacy]`` block whose plan cannot be met — adaptive clipping with a noise multiplier
  the unclipped count's noise cannot follow (``noise_multiplier = 0.5``,
  ``clients_per_round = 3``: "the unclipped count's noise clip_count_std=0.15 must exceed
  z/2=0.25") — is accepted by the build: ``partialfl run CONFIG --dry-run`` (in process and
  ``--engine flower-sim``) prints the plan and "dry run: nothing trained, nothing written",
  exit 0. The real run then fails: in process in one line (exit 2) after writing its log;
  on Flower (``partialfl run|train --engine flower-sim``, 27 s) the federation is started,
  every SuperNode refuses the describe query and the user reads "the Flower run failed:
  RuntimeError: no SuperNode answered the describe query (last refusal: … algorithm.init
  failed on the node (PrivacyBudgetError: the node's DP budget refuses this round) …)",
  exit 1 — the node's budget blamed for the user's own configuration, whose actual
  cause (clip_count_std) never reaches them. Of the same kind, also accepted by the dry
  run: a stage with more rounds than the DP budget (``personalize.rounds = 4``,
  ``privacy.rounds = 2``: the run trains and releases 2 noised rounds, then "DP budget covers
  rounds=2; round 2 would spend more privacy", exit 2, no θ; in process and on the loopback
  ServerApp alike) and a stage ``clients_per_round`` other than the DP options' ("DP samples
  its own cohorts"). Expected: the build resolves the DP plan (it knows the number of
  clients), so the dry run and the ServerApp refuse it in one line naming the cause before
  any SuperNode is asked. Suspected root cause: the ``dp`` wrapper's build
  (:class:`partialfl.algorithms.dp.DifferentiallyPrivate` never calls ``plan`` /
  :func:`partialfl.algorithms.dp.make_plan` before ``init``; ``build.algorithm.
  wrap_algorithm`` / ``flower.train.check_flower_run``).
* Area 8 (a config the error message itself recommends ends in a traceback), ``method.
  algorithm = "fedrep"`` with the stage's client ``gd`` — what the refusal of the default
  client says to give ("fedrep trains on the clients and needs a client optimizer (client =
  sgd or gd)"; on least squares ``sgd`` is refused as "a closed form: give the stage's
  client gd, cg or exact") — ends in ``TypeError: GDConfig.__init__() got an unexpected
  keyword argument 'epochs'`` with a full traceback, exit 1, from ``partialfl run`` (and
  the same at build for a model run, and on every SuperNode of a Flower run). Expected:
  FedRep runs with a ``gd`` client, or is refused in one line (exit 2). Suspected root
  cause: :func:`partialfl.algorithms.presets._fedrep` (``dataclasses.replace(local,
  epochs=..., steps=None)`` assumes the SGD trainer's fields).

Tried and held: on the loopback ServerApp against in process (least squares, 3 rounds):
FFGG, Local FFGG, FedAvg with a ``gd`` client (θ equal to 1e-15), MoNNA/CM/TM rules and a
sign-flip ``[attack]`` (1e-12), central DP (bit for bit) and central DP + SecAgg+ (6e-7,
quantisation), local DP (± SecAgg+; the nodes' noise keys are secret, no evaluation sent:
``eval_withheld_nodes`` 2), ``rounds = 0`` sync and FedAsync (θ⁰ evaluated once, equal),
``eval_every`` above ``rounds``; the stateful methods (APFL, Ditto, FedPer, FedBN,
LG-FedAvg, Local, L2GD, Scaffold, FedAlt/FedSim without ``stateless``) refused by every
node at describe in one line naming the stateless choices; FedAlt and FedSim with
``stateless = true``, FedProx, FedAvg and FFGG's two stages on a user's tiny model over
loopback (train, evaluate over all 6 clients); central DP on the tiny model (ε reported);
local DP on the tiny model (no ``train_loss``, no evaluation sums leave the nodes); the
node's code check (``model.name``, ``plugins`` as a string, ``set`` overrides) and the
registered-name slots (``data.source``, ``method.algorithm``, ``method.split``,
``problem.name``, ``aggregation.name`` = ``"os:system"``: refused by name, nothing
imported; ``model = "os:system"`` as a string: refused as not a table);
``flower node-data`` on a closed-form config, ``--nodes 0``, ``--nodes`` above the client
count (one line, exit 2 each). Not filed: under ``[faults]`` a Flower node that draws one
NaN or raising client fails its whole cohort (6 failed clients against 1 in process:
``refuse_non_finite`` and the node's single ``client_update`` — node granularity, by
design of what a node may send).
"""

from __future__ import annotations

import textwrap

import pytest
from _adv_cli import cli
from _flower_loopback import loopback  # noqa: F401 - the fixture

DP_LS = textwrap.dedent("""
    name = "dpls"
    seed = 3
    [problem]
    name = "least-squares"
    num_clients = 8
    n = 200
    d_theta = 10
    d_w = 5
    [method]
    algorithm = "ffgg"
    [personalize]
    rounds = 3
    client = { name = "cg", tau = 5 }
    [privacy]
    mode = "central"
    clip_norm = 1.0
    noise_multiplier = 0.5
    clients_per_round = 3
    rounds = 3
    adaptive_clipping = true
    """)

FEDREP_LS = textwrap.dedent("""
    name = "fr"
    seed = 3
    [problem]
    name = "least-squares"
    num_clients = 8
    n = 200
    d_theta = 10
    d_w = 5
    [method]
    algorithm = "fedrep"
    [personalize]
    rounds = 2
    clients_per_round = 4
    client = { name = "gd", lr = 0.05 }
    """)


def _err_lines(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def test_control_an_unmet_dp_plan_is_refused_in_one_line_by_the_run(tmp_path):
    """In process the run itself refuses the plan in one line naming the cause (exit 2)."""
    (tmp_path / "dp.toml").write_text(DP_LS)
    p = cli(tmp_path, None, "run", "dp.toml", "--out", "o", "--no-progress")
    assert p.returncode == 2, p.stderr
    assert _err_lines(p) == [ln for ln in _err_lines(p) if "clip_count_std" in ln]
    assert len(_err_lines(p)) == 1


#: DP configurations the build could refuse (it knows the clients, the stage's rounds and
#: cohort): the word the one line should hold, and the config
UNMET = {
    "adaptive": ("clip_count_std", DP_LS),
    "budget": ("rounds", DP_LS.replace("adaptive_clipping = true\n", "").replace(
        "[personalize]\nrounds = 3", "[personalize]\nrounds = 4").replace(
        "rounds = 3\n", "rounds = 2\n")),
    "cohort": ("clients_per_round", DP_LS.replace("adaptive_clipping = true\n", "").replace(
        "client = {", "clients_per_round = 4\nclient = {")),
}


@pytest.mark.parametrize("case", ["budget", "cohort"])
def test_control_the_other_unmet_dp_options_are_refused_by_the_run(tmp_path, case):
    """The run refuses them in one line (exit 2) — before training since round 64a's fix
    (it used to release 2 noised rounds first, then say 'DP budget covers rounds=2; round 2
    would spend more privacy')."""
    word, text = UNMET[case]
    (tmp_path / "dp.toml").write_text(text)
    p = cli(tmp_path, None, "run", "dp.toml", "--out", "o", "--no-progress")
    assert p.returncode == 2 and len(_err_lines(p)) == 1 and word in p.stderr, p.stderr


@pytest.mark.parametrize("engine", ["local", "flower-sim"])
@pytest.mark.parametrize("case", sorted(UNMET))
def test_a_dry_run_refuses_a_dp_plan_that_cannot_be_met(tmp_path, engine, case):
    if engine != "local":
        pytest.importorskip("flwr", reason="flwr is not installed")
    word, text = UNMET[case]
    (tmp_path / "dp.toml").write_text(text)
    p = cli(tmp_path, None, "run", "dp.toml", "--out", "o", "--engine", engine, "--dry-run")
    assert p.returncode == 2, (p.returncode, p.stdout[-300:])
    assert len(_err_lines(p)) == 1 and word in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_the_server_app_names_the_cause_of_an_unmet_dp_plan(loopback):  # noqa: F811
    from _flower_sims import ls_run, quiet

    from partialfl.flower.server import run_server

    run = ls_run(3, None, spec={"privacy": {"mode": "central", "clip_norm": 1.0,
                                            "noise_multiplier": 0.5,
                                            "clients_per_round": 3, "rounds": 3,
                                            "adaptive_clipping": True}})
    grid = loopback(2)
    with pytest.raises(Exception) as e:
        quiet(run_server, grid, {**run, "node-wait-timeout": 2})
    assert "clip_count_std" in str(e.value), str(e.value)
    assert grid.sent == [], "SuperNodes were asked before the plan was checked"


def test_control_fedrep_refuses_the_cg_client_in_one_line(tmp_path):
    """FedRep with a fine-tuning solver is refused in one line that recommends sgd or gd."""
    (tmp_path / "fr.toml").write_text(FEDREP_LS.replace('name = "gd", lr = 0.05',
                                                        'name = "cg", tau = 5'))
    p = cli(tmp_path, None, "run", "fr.toml", "--out", "o", "--no-progress")
    assert p.returncode == 2 and "sgd or gd" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_fedrep_with_the_gd_client_it_recommends_is_no_traceback(tmp_path):
    (tmp_path / "fr.toml").write_text(FEDREP_LS)
    p = cli(tmp_path, None, "run", "fr.toml", "--out", "o", "--no-progress")
    assert "Traceback" not in p.stderr, p.stderr[-400:]
    assert p.returncode == 0 or (p.returncode == 2 and len(_err_lines(p)) == 1), p.stderr
