"""Adversarial round 42b (issue 21 areas 1, 3, 4, 7, 8, tried again from scratch by someone
who did not write the fixes): the defects found. Each test failed on the code it was written
against (adv42b at 85262fc) because of the defect it names, and passes since the fix: a study
refuses folder links below its ``--out``; the Flower engines resume a stage file only if this
configuration wrote it (``read_params`` with the stage's identity, as in process); and a
Flower submission's stale ``result.json`` / ``theta.npz`` are removed before it runs.

* Area 8, a study never writes through a linked run folder: round 41b's
  :func:`partialfl.pipeline.run_files.refuse_linked_folders` refuses a folder link *below* a
  run's folder, and "``--out`` itself is the user's choice" — but a study's run folders
  (``OUT/seed=S``, ``OUT/KEY=V,seed=S``) are below the study's ``--out`` and are not checked:
  :func:`partialfl.pipeline.study.run_study` → ``_run_one`` → ``claim_out`` / ``run_built``
  take ``st/seed=0`` as the run's own ``out``. A received (or shared /tmp) study folder with a
  link ``seed=0 -> ../victim`` gets the whole run (spec, checkpoints, θ, personalised models,
  records) written into ``victim/``, exit 0; a later ``--overwrite`` deletes the names of the
  ``run_files.json`` written there. Suspected root cause: ``run_study`` (or ``_run_one``)
  does not refuse a run folder that is a symbolic link (``refuse_linked_folders(out)`` of the
  study, or ``pio.refuse_link`` on each run folder).
* Area 4, a Flower run resumed by another configuration: the Flower engines
  (:func:`partialfl.flower.train.run_flower_train`) skip stage 1 when
  ``stage1/theta.safetensors`` exists and load it with ``pio.load_tensors`` — without its
  stage-1 identity — then run stage 2 on Flower from it and stamp the θ2 with *this*
  configuration's stage-2 identity; only :func:`~partialfl.pipeline.train.run_built` (after
  stage 2) checks θ1's identity. ``spec.json`` is written only then, so a Flower run killed
  after stage 1 leaves a folder any configuration takes: config A (flower-sim) killed at the
  commit of ``theta_stage2.safetensors``, then config B (another stage-1 client lr) into the
  same ``--out`` trains stage 2 from A's θ1 (a minute on Flower), writes
  ``theta_stage2.safetensors`` stamped as B's, and ends in "stage1/theta.safetensors was not
  written by this configuration's stage … delete it". Doing that and re-running B re-trains
  stage 1 and keeps the θ2 (its stamp matches): a finished run of B, exit 0, whose stage 2
  started from A's pre-training (seen: 18.46% test accuracy). The local engine checks θ1's
  identity before stage 2 (``stages.stage1_setup``). Suspected root cause:
  ``run_flower_train`` reads θ1 (and decides to skip stages) without
  ``read_params(..., identity=stage1_identity(...))``.
* Area 4/8, a failed ServerApp run taken for an earlier run's result:
  :meth:`partialfl.flower.deployment.LocalFederation.run` (flower-sim, ``flower local`` and
  ``--superlink``) treats ``flwr run`` exiting 0 with ``out-dir/result.json`` present as
  success — but ``flwr run --stream`` exits 0 when the ServerApp raised, and ``result.json``
  / ``theta.npz`` may be an earlier run's (a run folder re-used, or one left by a kill after
  the ServerApp wrote them). Seen: a closed-form config (5 rounds) run on flower-sim into
  ``o``, then another (3 rounds) into ``o`` with ``--flower resume=true --flower
  checkpoint-every=1``: its ServerApp refuses ("run-config key 'resume': no checkpoint at
  …", the one-line refusal seen in a fresh folder) — and the command prints the earlier run's
  "round=5 … server_steps=5", rewrites ``ls.jsonl`` / ``summary.md`` from it, exit 0. The
  same for a model run's stage (a train run into ``--out`` whose ``flower/`` holds a result:
  its θ2 taken from there). Suspected root cause: ``LocalFederation.run`` neither removes a
  stale ``result.json`` / ``theta.npz`` before submitting nor checks that the result it reads
  is this submission's (the run id, or its config).

Tried and held (not tested here): area 1 — ``ProcessBackend(2, task_timeout=5)`` with a
client that closes every inherited descriptor (``os.closerange(3, 65536)``), ignores SIGTERM
and sleeps, calls ``os.setsid``, raises an exception whose ``__str__`` raises or whose
``__reduce__`` raises, ``os.abort()``, infinite recursion, closes fds 0–2, ``sys.exit(0)``:
each a counted error or worker death, the run finishes in seconds; area 8 — a run name
``../esc``, absolute, ``a/b``, ``.``, ``..``, empty, with a newline, ``~``, ``-x`` (one line,
exit 2); ``--seeds`` 10²³ / −5, ``--set seed=`` 10²³ / −1, ``--jobs 0``, ``--threads`` 0 /
10⁵, ``personalize.rounds`` 10²⁰ (one line, exit 2); seeds 2⁶³−1 and 2³² (run fine); a sweep
value of 300 characters (ENAMETOOLONG: one line, exit 2); sweep values ``0.01,0.010``
(distinct folders); ``report --tensorboard`` and ``report`` on a run folder with planted links
(``runs.confined``: read); ``data convert --overwrite`` over a store with a user's file
(``check_replaceable``: read). Not reported: a closed-form ``partialfl run`` into a finished
train run's folder adds ``NAME.jsonl`` / ``NAME.png`` / ``summary.md`` without a word (a
closed-form spec named ``stage2`` would overwrite that run's ``stage2.jsonl``).
"""

from __future__ import annotations

import pytest
from _adv_cli import cli as _cli
from _adv_cli import femnist_toml, killed

_CFG = femnist_toml(pretrain_lr="1.0")
_TWO_STAGES = _CFG.replace('stages = ["personalize"]', 'stages = ["pretrain", "personalize"]')


def _killed(cwd, data_dir, tail: str, *args: str):
    """The command killed at the ``os.replace`` onto the path ending in ``tail``."""
    return killed(cwd, data_dir, "replace", tail, *args)


# -- area 8: a study never writes through a linked run folder below its --out ------------------
def test_a_study_never_writes_through_a_linked_run_folder(tmp_path, data_dir):
    (tmp_path / "a.toml").write_text(_CFG)
    st, victim = tmp_path / "st", tmp_path / "victim"
    st.mkdir()
    victim.mkdir()
    (victim / "notes.txt").write_text("precious\n")
    # a received (or shared /tmp) study folder with a link named like one of its runs
    (st / "seed=0").symlink_to(victim, target_is_directory=True)
    r = _cli(tmp_path, data_dir, "train", "a.toml", "--seeds", "0", "--jobs", "1", "--out",
             "st", "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    outside = sorted(p.name for p in victim.iterdir())
    assert outside == ["notes.txt"], \
        f"written outside the study folder (exit {r.returncode}): {outside}"


# -- area 4: a Flower run resumed by another configuration ------------------------------------
@pytest.mark.slow  # a Flower simulation through the CLI (tens of seconds)
def test_a_flower_run_never_trains_stage2_from_another_configurations_theta1(tmp_path,
                                                                              data_dir):
    pytest.importorskip("flwr")
    (tmp_path / "a.toml").write_text(_TWO_STAGES)
    (tmp_path / "b.toml").write_text(_TWO_STAGES.replace("lr = 0.3,", "lr = 0.02,"))
    exp = tmp_path / "exp"
    flower = ("--out", "exp", "--engine", "flower-sim", "--no-progress")
    # config A killed once its stage 2 finished on Flower, before θ2 is kept: stage1/ holds
    # A's θ1 (stamped with A's stage-1 identity), no spec.json yet
    r = _killed(tmp_path, data_dir, "/exp/theta_stage2.safetensors", "train", "a.toml", *flower)
    assert r.returncode == -9, (r.returncode, r.stderr[-400:])
    assert (exp / "stage1" / "theta.safetensors").is_file()
    assert not (exp / "spec.json").exists() and not (exp / "theta_stage2.safetensors").exists()
    # the user starts config B (another stage-1 client lr) in that folder
    r = _cli(tmp_path, data_dir, "train", "b.toml", *flower)
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    if r.returncode != 0:
        # refused: then before stage 2 trained — not after writing a θ2 stamped as B's
        # stage 2 but computed from A's θ1 (deleting stage1/theta.safetensors, as the
        # refusal says, then re-running B keeps that θ2: a finished run of B whose θ2
        # started from A's pre-training)
        assert not (exp / "theta_stage2.safetensors").exists(), \
            f"B's stage 2 trained from A's θ1, then: {r.stderr.strip()[-200:]}"


# -- area 4/8: a failed ServerApp run taken for the result an earlier run left in out-dir -----
_LS = """\
name = "ls"
seed = 0
[problem]
name = "least-squares"
num_clients = 4
n = 50
d_theta = 5
d_w = 3
seed = 0
[method]
algorithm = "ffgg"
w_init = "zero"
[personalize]
rounds = 5
clients_per_round = 4
eval_every = 5
client = { name = "cg", tau = 5 }
server = { optimizer = "sgd", lr = "1/L" }
"""


@pytest.mark.slow  # a Flower simulation through the CLI (tens of seconds)
def test_a_failed_flower_run_never_reports_an_earlier_runs_result(tmp_path):
    pytest.importorskip("flwr")
    (tmp_path / "x.toml").write_text(_LS)
    (tmp_path / "y.toml").write_text(_LS.replace("rounds = 5", "rounds = 3")
                                     .replace("eval_every = 5", "eval_every = 3"))
    flower = ("--out", "o", "--engine", "flower-sim", "--no-progress")
    r = _cli(tmp_path, None, "run", "x.toml", *flower)
    assert r.returncode == 0 and (tmp_path / "o" / "flower" / "result.json").is_file(), \
        r.stderr[-400:]
    # another configuration (3 rounds) into the same folder, asking the ServerApp to resume
    # (Flower's documented `resume` key): there is no checkpoint, so the ServerApp refuses
    r = _cli(tmp_path, None, "run", "y.toml", *flower, "--flower", "resume=true", "--flower",
             "checkpoint-every=1")
    assert "Traceback" not in r.stderr, r.stderr[-400:]
    assert r.returncode != 0, ("the ServerApp refused to resume, yet the run succeeded with "
                               f"the earlier 5-round run's result: {r.stdout.strip()[-300:]}")
    assert "checkpoint" in r.stderr.strip().splitlines()[-1], r.stderr[-400:]
