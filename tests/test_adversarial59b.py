"""Adversarial round 59b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 92a5afa: round 58b's fixes — L2GD computing its
cohort in parts, repeated ``--seeds`` refused, ``compare`` cleaning its killed writes, the
attack fraction checked against δ at build, ``evaluate --json`` refusing a run's file),
entered through the new guard :func:`partialfl.pipeline.run_files.refuse_run_file` with
odd paths, L2GD / FedAvg / Scaffold under every per-client backend with every fault kind,
and the stateful model baselines (Scaffold, FedAlt, FedSim) on worker processes killed at
every checkpoint write. Each test below its control failed on that code because of the
defect it names, and passes since the fix: ``refuse_run_file`` resolves ``..``, guards the
records themselves (``run_files.json``, ``preexisting.json``, ``study.json``,
``reproduction.json``) and every entry of an unfinished run; a resumed ``train`` records its
spec only once the pipeline accepted it; an interrupted study keeps a finished run only if
it is the study's own (:func:`partialfl.pipeline.study._check_kept`); ``report``,
``compare`` and ``evaluate --json`` clean the temporary files of their own killed writes;
the closing warning of a closed-form run counts refused updates and worker deaths too.

* Area 4/8 (a run's own record replaced by another command, which then disarms the guard),
  ``partialfl evaluate RUN --json RUN/run_files.json`` prints the table, "metrics written
  to RUN/run_files.json", exit 0: the run's list of its own files is replaced by the
  evaluation's JSON. Round 58b's guard refuses every name the list holds *except*
  ``run_files.json`` itself (``set(...) - {RUN_FILES}``), and reads the list to know what to
  refuse — so once the list is gone, ``evaluate RUN --json RUN/deploy.safetensors`` is
  accepted again (exit 0) and replaces the trained model (the exact case 58b fixed), and
  ``record_added`` / ``--overwrite`` fall back to ``preexisting.json``'s complement (a file
  the user put beside the finished run is then deleted as the run's). Expected:
  ``--json`` naming ``RUN/run_files.json`` refused in one line, exit 2, the record kept.
  Suspected root cause: :func:`partialfl.pipeline.run_files.refuse_run_file` (``-
  {RUN_FILES}``).

* Area 4/8 (same guard, a relative path through a folder that does not exist yet),
  ``partialfl evaluate RUN --json RUN/nope/../deploy.safetensors`` prints "metrics written
  to RUN/nope/../deploy.safetensors", exit 0: the trained model is replaced by the JSON and
  an empty ``RUN/nope`` folder is left in the run. The guard walks ``Path.absolute()``'s
  parents without resolving ``..``: ``RUN/nope/..`` has no readable ``run_files.json`` (the
  folder does not exist yet), ``RUN/nope``'s entry is ``..``, ``RUN``'s entry is ``nope``
  (not the run's); :func:`partialfl.io.atomic_write` then creates ``RUN/nope`` and renames
  over ``RUN/deploy.safetensors``. (``RUN/stage1/../metrics.json``, through an existing
  folder, is refused.) Expected: one line, exit 2, the model kept. Suspected root cause:
  :func:`partialfl.pipeline.run_files.refuse_run_file` (no ``os.path.normpath`` /
  ``resolve`` of the path before the walk).

* Area 4/8 (a refused command rewrites an interrupted run's record), a ``train`` killed
  (SIGKILL) mid-run (at a ``stage2.gN.server.ckpt`` commit, or at its ``report.md``), then
  ``partialfl train OTHER.toml --out RUN`` with another configuration (``personalize.server
  lr`` 0.1 → 0.7): refused as it should be ("RUN already holds a pipeline run with a
  different configuration (personalize.server.lr: 0.1 there, 0.7 now); use a new folder
  ...", exit 2) — but by then it has replaced the run's ``spec.json`` (now lr 0.7, a
  configuration the run never trained) and ``source.json`` (now naming OTHER.toml, where
  ``evaluate --allow-code`` looks for the model's module). A finished run is refused before
  any write (``claim_out``); an interrupted one is not. Only a resume with the original
  configuration writes them back. Expected: the refusal leaves the run's files as they were.
  Suspected root cause: :func:`partialfl.pipeline.train.run_built` (``write_json(out /
  "spec.json", ...)`` and ``source.json`` before :func:`partialfl.pipeline.stages.
  run_pipeline` compares the configuration with the run's).

* Area 4/8 (an interrupted study resumed by another configuration mixes the two), ``train
  a.toml --seeds 0 1 --jobs 1 --out ST`` killed (SIGKILL) as ``seed=1`` starts (its first
  write, ``preexisting.json``), then ``train OTHER.toml --seeds 0 1 --jobs 1 --out ST``
  (``personalize.server.lr`` 0.1 → 0.7): "ST: 1 of 2 runs finished already; running the
  other 1", ``seed=1`` trains with lr 0.7, "study written to ST/", exit 0 — ``seed=0``
  (lr 0.1) is kept as a run of the new study, ``study.json`` now names OTHER.toml, and
  the two seeds are of different configurations (``compare ST`` then: "cannot pair
  'personalize.server.lr=0.7' (seeds [1]) with 'personalize.server.lr=0.1' (seeds [0])").
  A single run refuses the same resume ("already holds a pipeline run with a different
  configuration"); a finished study is refused as a whole. Expected: refused in one line
  (exit 2) before anything trains, or the mismatched finished run not kept. Suspected root
  cause: :func:`partialfl.pipeline.study.run_study` (``kept`` = every *finished* run folder,
  its configuration never compared with the run the study would make there; ``write_index``
  before any check).

* Area 4/8 (same guard, an interrupted run: no longer resumable), a ``train`` killed
  (SIGKILL) at the commit of its ``report.md`` (its model deployed, ``spec.json`` and
  ``preexisting.json`` there, no ``run_files.json`` yet): ``partialfl evaluate RUN --json
  RUN/deploy.safetensors`` evaluates the run and replaces its model ("metrics written to
  RUN/deploy.safetensors", exit 0); the resume (``train CONFIG --out RUN``) then ends
  "partialfl: error: RUN/deploy.safetensors is truncated or not a safetensors file", exit 2,
  and so does every later ``evaluate RUN``: a kill at that instant plus one refused-elsewhere
  command leaves a run that neither resumes nor evaluates. The guard reads only a finished
  run's ``run_files.json``; an interrupted run's files (``spec.json`` beside
  ``preexisting.json``: the names not in it) are not guarded. Expected: one line, exit 2,
  the model kept (and the run resumable). Suspected root cause:
  :func:`partialfl.pipeline.run_files.refuse_run_file` (no case for a run folder without
  ``run_files.json``).

* Area 4/8 (same guard, the records of a study and of a reproduction), ``partialfl
  evaluate RUN --json STUDY/study.json`` (a finished ``train --seeds 0 1`` study) prints
  "metrics written to STUDY/study.json", exit 0: the study's index is replaced, after which
  ``compare STUDY`` fails ("STUDY/study.json: not a study index"); ``--json
  REPRO/reproduction.json`` (a finished ``reproduce ls-tau --quick``) replaces the
  reproduction's marker, after which the same ``reproduce`` into its own folder is refused
  ("REPRO holds files that are not its"), so a killed or extended reproduction can no longer
  resume there. The guard knows only ``run_files.json``. Expected: ``--json`` naming a
  study's ``study.json`` or a reproduction's ``reproduction.json`` refused in one line,
  exit 2, the file kept. Suspected root cause:
  :func:`partialfl.pipeline.run_files.refuse_run_file` (checks ``run_files.json`` lists only).

* Area 4 (a killed write's temporary file kept), ``partialfl report RUN`` (rebuilding a
  finished run's report and plots) killed (SIGKILL) at the commit of ``report.md`` (or
  ``learning_curves.png``, ``per_client_accuracy.png``) leaves
  ``RUN/.report.md.XXXXXXXX.tmp``; ``report RUN`` run again finishes (exit 0) and keeps it,
  and so does ``compare RUN`` (which since 58b cleans only its own ``compare.*`` writes);
  only a new ``train`` into the run's folder would remove it. Round 58b fixed exactly this
  for ``compare``. Expected: the rerun of ``report`` removes the temporary files of its own
  killed writes. Suspected root cause: :func:`partialfl.cli.runs._cmd_report` /
  :func:`partialfl.pipeline.train_report.write_report` (no
  :func:`partialfl.io.clean_stale_writes` of the run folder before rebuilding).

* Area 4 (round 58b's fix, incomplete), ``partialfl compare RUN`` (into the finished run,
  its default ``--out``) killed at the commit of ``RUN/run_files.json`` — the record of
  ``compare.md`` / ``compare.png`` that :func:`partialfl.pipeline.run_files.record_added`
  writes — leaves ``RUN/.run_files.json.XXXXXXXX.tmp``; ``compare RUN`` again exits 0 and
  keeps it: 58b's clean-up removes only the temporary files of ``compare.md`` and
  ``compare.png`` (``targets=names``), not of the other file the same command writes there
  (``report RUN --tensorboard`` killed at the same write: likewise). Expected: the rerun
  removes it. Suspected root cause: :func:`partialfl.pipeline.compare.compare`
  (``clean_stale_writes(out, ..., targets=("compare.md", "compare.png"))`` without
  ``run_files.json``).

* Area 4 (same, ``evaluate --json``), ``partialfl evaluate RUN --json OUT/ev.json`` (a
  folder of the user's, or ``RUN/ev.json`` inside the run) killed at the commit of
  ``ev.json`` leaves ``.ev.json.XXXXXXXX.tmp`` beside it; the same command again exits 0,
  writes ``ev.json`` and keeps the temporary file. Expected: as ``compare`` since 58b
  (:func:`partialfl.io.clean_stale_writes` with ``targets``), the rerun removes the
  temporary file of its own killed write. Suspected root cause:
  :func:`partialfl.cli.runs._cmd_evaluate` (writes ``--json`` with no clean-up of an earlier
  start's temporary file).

* Area 1/8 (a lossy run that does not say so), a closed-form ``partialfl run`` with
  ``backend = { name = "processes" }`` and ``[faults] kinds = ["die"]`` (FedAvg, Scaffold,
  L2GD on least squares) loses 13 client updates to dead workers (``worker_deaths=13`` in
  its last line) and ends exit 0 with no warning, while the same run with ``kinds =
  ["raise"]`` (or ``"nan"``) ends with "partialfl: warning: client updates were lost
  ({'clients_failed': 13}); see the JSONL" (minor: both log a "skipping client m in round
  r" line per lost client on the way; only the closing summary forgets the deaths). Both
  are the same loss (:attr:`partialfl.runtime.faults.FaultStats.lost` counts failed +
  nonfinite + refused + worker_deaths). Expected: the warning names the worker deaths (and
  refused updates) too.
  Suspected root cause: :func:`partialfl.cli.run._run_closed_form` (``lost`` built from
  ``("clients_failed", "updates_nonfinite")`` only).

Tried and held (run): ``evaluate RUN --json`` through a symbolic link to a run's file (the
link is replaced, the run's file kept), ``RUN/personalized/x.json`` and
``RUN/stage1/../metrics.json`` (refused, one line); ``l2gd`` with ``[faults] kinds =
["raise"]`` / ``["die"]`` on ``sequential``, ``threads``, ``processes`` (trains, counts the
faults only); ``OnDiskClientState(Scaffold)`` against in-memory Scaffold on the batched,
thread and process backends with raise / nan / die faults (θ and every client's control
variate identical); ``train --seeds 0 0`` (refused, one line); Scaffold, FedAlt and FedSim
model runs on ``backend = processes`` with ``checkpoint_every = 1`` killed (SIGKILL) at the
commit of ``stage2.gN.server.ckpt``, ``stage2.gN.client-side.ckpt``, ``stage2.ckpt``,
``client_state_stage2.client-side.safetensors`` and at the removal of an older generation:
each resumed run's θ, deployed model, client state and accuracy equal the uninterrupted
run's; L2GD, Scaffold, FedAlt and FedSim on ``processes`` against ``vmap`` (θ and client
state equal to rounding); ``[attack] fraction = 0.3`` against ``tm`` with ``bucketing = 2``,
``krum`` with ``nnm``, ``meamed``, ``cm`` with ``arc`` (dry run and run give the same one
line), ``tm`` δ 0.25 at ``clients_per_round = 4`` (a cohort over δ warned and counted);
``checkpoint_every`` / ``seed`` / ``threads`` / ``backend.workers = true``, ``task_timeout``
−1 / nan, unknown backend keys (one line, exit 2); ``compare RUN --out`` a run's
sub-folder (written beside the run's files, the run still evaluates) or a run's file (one
line); ``evaluate --json`` ``""`` / ``RUN/..`` / ``/proc/self/x.json`` (one line, no
temporary file left); ``flower node-data`` killed at a node's header or rename (the rerun
replaces the partial store); ``train --seeds 0 1`` killed at ``study.json``, a seed's
``report.md`` / ``run_files.json`` / a checkpoint removal (the rerun finishes or says
finished; ``compare`` reads it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _adv_cli import copy_run, env, evaluate_json, trained_user_run


def _cli(cwd, *args, timeout: float = 170):
    return subprocess.run([sys.executable, "-m", "partialfl", *args], cwd=cwd, env=env(None),
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- area 4/8
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_user_run(tmp_path_factory.mktemp("ev59b"))




def test_control_evaluate_json_refuses_the_model(trained):
    run = copy_run(trained, "c0")
    model = (run / "deploy.safetensors").read_bytes()
    p = evaluate_json(trained, run, f"runs/{run.name}/deploy.safetensors")
    assert p.returncode == 2 and (run / "deploy.safetensors").read_bytes() == model


def test_evaluate_json_never_replaces_the_runs_record(trained):
    """Found: exit 0, "metrics written to runs/c1/run_files.json"; then ``--json
    runs/c1/deploy.safetensors`` exit 0, the model replaced. Expected: one line, exit 2, the
    record kept."""
    run = copy_run(trained, "c1")
    record = (run / "run_files.json").read_bytes()
    model = (run / "deploy.safetensors").read_bytes()
    p = evaluate_json(trained, run, f"runs/{run.name}/run_files.json")
    kept = (run / "run_files.json").read_bytes() == record
    then = evaluate_json(trained, run, f"runs/{run.name}/deploy.safetensors")
    model_kept = (run / "deploy.safetensors").read_bytes() == model
    assert p.returncode == 2 and kept and model_kept, \
        (p.returncode, kept, then.returncode, model_kept, p.stdout.strip()[-100:])


def test_control_a_path_through_an_existing_sub_folder_is_refused(trained):
    run = copy_run(trained, "c2")
    metrics = (run / "metrics.json").read_bytes()
    p = evaluate_json(trained, run, f"runs/{run.name}/stage1/../metrics.json")
    assert p.returncode == 2 and (run / "metrics.json").read_bytes() == metrics


def test_evaluate_json_through_a_new_folder_and_dotdot_keeps_the_model(trained):
    """Found: exit 0, "metrics written to runs/c3/nope/../deploy.safetensors", the model
    replaced by the JSON, ``runs/c3/nope`` created. Expected: one line, exit 2, model kept."""
    run = copy_run(trained, "c3")
    model = (run / "deploy.safetensors").read_bytes()
    p = evaluate_json(trained, run, f"runs/{run.name}/nope/../deploy.safetensors")
    kept = (run / "deploy.safetensors").read_bytes() == model
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-100:])


def test_a_refused_train_leaves_an_interrupted_runs_record(trained):
    """Found: exit 2 ("... with a different configuration ...") but ``spec.json`` now says
    lr 0.7 and ``source.json`` names the other config. Expected: both unchanged."""
    import shutil

    from _adv_cli import killed

    other = trained / "other.toml"
    text = (trained / "a.toml").read_text()
    assert "server = { lr = 0.1 }" in text
    other.write_text(text.replace("server = { lr = 0.1 }", "server = { lr = 0.7 }"))
    out = trained / "runs" / "killed2"
    shutil.rmtree(out, ignore_errors=True)
    r = killed(trained, None, "replace", "/killed2/report.md", "train", "a.toml",
               "--allow-code", "--out", str(out))
    assert r.returncode == -9, r.stderr[-300:]
    before = {f: (out / f).read_bytes() for f in ("spec.json", "source.json")}
    p = _cli(trained, "train", str(other), "--allow-code", "--out", str(out))
    assert p.returncode == 2 and "different configuration" in p.stderr, p.stderr[-300:]
    changed = [f for f, b in before.items() if (out / f).read_bytes() != b]
    assert not changed, f"a refused train rewrote {changed}"


def test_an_interrupted_study_is_not_completed_by_another_config(trained):
    """Found: exit 0, seed=0 trained with lr 0.1 and seed=1 with lr 0.7 in one study.
    Expected: one line, exit 2 (or every run of the study with the configuration given)."""
    import json
    import shutil

    from _adv_cli import killed

    other = trained / "other_study.toml"
    text = (trained / "a.toml").read_text()
    other.write_text(text.replace("server = { lr = 0.1 }", "server = { lr = 0.7 }"))
    out = trained / "st-mixed"
    shutil.rmtree(out, ignore_errors=True)
    seeds = ("--seeds", "0", "1", "--jobs", "1", "--out", str(out))
    r = killed(trained, None, "replace", "/st-mixed/seed=1/preexisting.json", "train",
               "a.toml", "--allow-code", *seeds)
    assert r.returncode == -9 and (out / "seed=0" / "report.md").is_file(), r.stderr[-300:]
    p = _cli(trained, "train", str(other), "--allow-code", *seeds)
    if p.returncode == 2 and "Traceback" not in p.stderr:
        return
    lrs = {s: json.loads((out / s / "spec.json").read_text())["personalize"]["server"]["lr"]
           for s in ("seed=0", "seed=1") if (out / s / "spec.json").is_file()}
    assert set(lrs.values()) == {0.7}, (p.returncode, lrs, p.stderr.strip()[-150:])


def test_evaluate_json_keeps_an_interrupted_runs_model(trained):
    """Found: exit 0, the model replaced; the resume: "... deploy.safetensors is truncated
    or not a safetensors file", exit 2. Expected: one line, exit 2, the model kept."""
    import shutil

    from _adv_cli import killed

    out = trained / "runs" / "killed"
    shutil.rmtree(out, ignore_errors=True)
    args = ("train", "a.toml", "--allow-code", "--out", str(out))
    r = killed(trained, None, "replace", "/killed/report.md", *args)
    assert r.returncode == -9 and not (out / "run_files.json").exists(), r.stderr[-300:]
    model = (out / "deploy.safetensors").read_bytes()
    p = _cli(trained, "evaluate", "runs/killed", "--allow-code", "--no-progress", "--json",
             "runs/killed/deploy.safetensors")
    kept = (out / "deploy.safetensors").read_bytes() == model
    resume = _cli(trained, *args)
    assert p.returncode == 2 and kept, \
        (p.returncode, kept, resume.returncode, resume.stderr.strip()[-120:])


@pytest.mark.parametrize("what", ["study", "reproduction"])
def test_evaluate_json_never_replaces_a_study_or_reproduction_record(trained, what):
    """Found: exit 0, "metrics written to st/study.json" (``compare st`` then fails) /
    "metrics written to rp/reproduction.json" (the reproduction then refuses its own
    folder). Expected: one line, exit 2, the record kept."""
    if what == "study":
        out, name = trained / "st", "study.json"
        args = ("train", "a.toml", "--allow-code", "--seeds", "0", "1", "--jobs", "1",
                "--out", str(out))
    else:
        out, name = trained / "rp", "reproduction.json"
        args = ("reproduce", "ls-tau", "--quick", "--no-progress", "--out", str(out))
    if not (out / name).exists():
        p = _cli(trained, *args)
        assert p.returncode == 0, p.stderr[-400:]
    record = (out / name).read_bytes()
    p = _cli(trained, "evaluate", "runs/a", "--allow-code", "--no-progress", "--json",
             str(out / name))
    kept = (out / name).read_bytes() == record
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-80:])


# ----------------------------------------------------------------------------- area 4
@pytest.mark.parametrize("name", ["report.md", "learning_curves.png"])
def test_a_rerun_report_cleans_its_killed_writes_temporary_file(trained, name):
    """Found: after the kill ``RUN/.report.md.XXXXXXXX.tmp``; ``report RUN`` again exits 0
    and keeps it. Expected: the rerun removes it."""
    from _adv_cli import killed

    run = copy_run(trained, f"r-{name.split('.')[0]}")
    r = killed(trained, None, "replace", f"/{run.name}/{name}", "report", f"runs/{run.name}")
    assert r.returncode == -9, (r.returncode, r.stderr[-300:])
    assert list(run.glob(f".{name}.*.tmp"))  # the killed write's
    r = _cli(trained, "report", f"runs/{run.name}")
    assert r.returncode == 0 and (run / "report.md").is_file(), r.stderr[-300:]
    left = sorted(p.name for p in run.rglob(".*.tmp"))
    assert not left, f"stale temporary files kept: {left}"


def test_a_rerun_compare_cleans_its_killed_record_write(trained):
    """Found: ``RUN/.run_files.json.XXXXXXXX.tmp`` kept after the rerun (exit 0).
    Expected: removed."""
    from _adv_cli import killed

    run = copy_run(trained, "cmp-rec")
    r = killed(trained, None, "replace", f"/{run.name}/run_files.json", "compare",
               f"runs/{run.name}")
    assert r.returncode == -9, (r.returncode, r.stderr[-300:])
    assert list(run.glob(".run_files.json.*.tmp"))  # the killed write's
    r = _cli(trained, "compare", f"runs/{run.name}")
    assert r.returncode == 0 and (run / "compare.md").is_file(), r.stderr[-300:]
    left = sorted(p.name for p in run.glob(".*.tmp"))
    assert not left, f"stale temporary files kept: {left}"


@pytest.mark.parametrize("inside", [False, True])
def test_a_rerun_evaluate_json_cleans_its_killed_writes_temporary_file(trained, inside):
    """Found: ``.ev.json.XXXXXXXX.tmp`` kept after the rerun (exit 0). Expected: removed."""
    from _adv_cli import killed

    run = copy_run(trained, f"e-{inside}")
    target = f"runs/{run.name}/ev.json" if inside else f"evout-{inside}/ev.json"
    (trained / target).parent.mkdir(exist_ok=True)
    args = ("evaluate", f"runs/{run.name}", "--allow-code", "--no-progress", "--json", target)
    r = killed(trained, None, "replace", "/" + target, *args)
    assert r.returncode == -9, (r.returncode, r.stderr[-300:])
    folder = (trained / target).parent
    assert list(folder.glob(".ev.json.*.tmp"))  # the killed write's
    r = _cli(trained, *args)
    assert r.returncode == 0 and (trained / target).is_file(), r.stderr[-300:]
    left = sorted(p.name for p in folder.glob(".*.tmp"))
    assert not left, f"stale temporary files kept: {left}"


# ----------------------------------------------------------------------------- area 1/8
def _faults_toml(path, algorithm: str, kind: str):
    path.write_text(f"""backend = {{ name = "processes" }}
name = "x"
[problem]
name = "least-squares"
num_clients = 8
n = 200
d_theta = 5
d_w = 3
[method]
algorithm = "{algorithm}"
[faults]
rate = 0.3
kinds = ["{kind}"]
[personalize]
rounds = 5
clients_per_round = 0
client = {{ name = "gd", tau = 3 }}
""")
    return path


def _run(tmp_path, algorithm, kind):
    cfg = _faults_toml(tmp_path / f"{algorithm}-{kind}.toml", algorithm, kind)
    return _cli(tmp_path, "run", str(cfg), "--out", str(tmp_path / f"o-{kind}"),
                "--no-progress")


def test_control_raised_faults_are_warned(tmp_path):
    p = _run(tmp_path, "fedavg", "raise")
    assert p.returncode == 0 and "client updates were lost" in p.stderr, p.stderr[-300:]


@pytest.mark.parametrize("algorithm", ["fedavg", "l2gd"])
def test_updates_lost_to_dead_workers_are_warned(tmp_path, algorithm):
    """Found: ``worker_deaths=13`` in the last line, exit 0, nothing on stderr. Expected:
    "partialfl: warning: client updates were lost (... worker_deaths ...)"."""
    p = _run(tmp_path, algorithm, "die")
    assert p.returncode == 0, p.stderr[-300:]
    assert "worker_deaths=0" not in p.stdout, p.stdout[-300:]  # the faults did act
    assert "client updates were lost" in p.stderr and "worker_deaths" in p.stderr, \
        (p.stdout.strip().splitlines()[-2][:200], p.stderr[-300:])
