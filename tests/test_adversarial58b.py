"""Adversarial round 58b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 69b55dd: round 57b's L2GD aggregation /
weighting / ``[asynchronous]`` fixes), entered through every closed-form algorithm with
``[aggregation]``, ``weighting = "examples"``, ``[asynchronous]``, ``[attack]``, ``[faults]``
and ``[privacy]``, the ``backend`` of a closed-form run, ``advise`` and the reproductions'
``--quick`` paths with odd options. Each test below its controls failed on that code because
of the defect it names, and passes since the fix: L2GD computes any part of its cohort (each
client's steps depend on the round's coin only; full participation stays a build check), so
per-client backends and fault isolation work; ``--seeds`` refuses a repeated seed;
``compare`` cleans the temporary files of its own killed writes; the attack fraction is
checked against the rule's δ at build; ``evaluate --json`` refuses a file a run wrote
(:func:`partialfl.pipeline.run_files.refuse_run_file`).

* Area 1/8 (a valid configuration whose every client is counted as failed),
  ``algorithm = "l2gd"`` (least squares, ``clients_per_round = 0``: all) with ``backend =
  { name = "sequential" }`` (or ``"threads"``, ``"processes"``) is accepted by the build and
  by ``partialfl run --dry-run`` ("dry run: nothing trained, nothing written", exit 0); the
  run then hands the cohort to the executor one client per job, L2GD's ``client_update``
  refuses each single-client cohort, and all eight clients are logged as failures
  ("skipping client 3 in round 0: it failed (ValueError: L2GD needs full participation
  (clients_per_round = all))") before the run ends "partialfl: error: L2GD needs full
  participation (clients_per_round = all)", exit 2 — although the configuration *is* full
  participation, and the default ``vmap`` backend trains it (exit 0). Round 57b's fix made
  the build refuse ``[asynchronous]`` for an algorithm whose entry declares
  ``full_participation``; the executor that splits the cohort is the same misfit, unchecked.
  Expected: the run trains (the executor gives a full-participation algorithm the whole
  cohort in one call) or the build refuses the backend in one line (so ``--dry-run`` says
  it), no healthy client counted as failed. Suspected root cause:
  :func:`partialfl.build.run._build_closed_form` (its ``full_participation`` checks look at
  ``clients_per_round`` and ``spec.asynchronous`` only, never ``spec.backend``) /
  the executors' per-client jobs (:mod:`partialfl.runtime`).

* Area 1/8 (same misfit, fault isolation), ``algorithm = "l2gd"`` with ``[faults] rate =
  0.3, kinds = ["raise"]`` is accepted by ``--dry-run`` (exit 0); when the first injected
  fault raises, the runtime isolates the failing client by calling the algorithm again one
  client at a time, so every healthy client fails with "L2GD needs full participation"
  (counted as client failures) and the run ends "partialfl: error: injected raise fault in
  client 0, round 0", exit 1. ``kinds = ["nan"]`` on the same run trains (the non-finite
  updates are skipped). Expected: the build refuses raise / die faults for a
  full-participation algorithm (one line, ``--dry-run`` too), or no healthy client is
  reported as failed. Suspected root cause: as above (``_build_closed_form``; the fault
  isolation of :mod:`partialfl.runtime.faults` re-running single clients).

* Area 8 (a bad CLI input accepted, a false statistical claim), ``partialfl reproduce async
  --quick --seeds 0 0`` runs seed 0 twice and reports its paired comparison as "95% t
  interval over the 2 seeds" with zero-width intervals (``-24.45 [-24.45, -24.45]``) and an
  MDE of ``0.00`` orders — one draw of the problem presented as two independent seeds, i.e.
  a certainty the data do not support (a full-size run would print a verdict from it).
  ``reproduce ls-tau --seeds 0 0 0`` de-duplicates (its summary: "seeds [0]", "one seed: no
  interval"); the byzantine and faults reproductions take ``sorted({seed})`` for their
  comparisons. Expected: repeated ``--seeds`` refused in one line (exit 2) or
  de-duplicated. Suspected root cause: :func:`partialfl.reproductions.asynchronous.
  reproduce_async` (``results = [run_seed(...) for s in seeds]``) / the CLI's ``--seeds``
  check in :mod:`partialfl.cli.catalog` (range only).

* Area 4 (a killed write's temporary file kept for good), ``partialfl compare A B --out C``
  killed (SIGKILL) at the commit of ``compare.png`` (or ``compare.md``) leaves
  ``C/.compare.png.XXXXXXXX.tmp``; the same command run again finishes (exit 0) and writes
  ``compare.md`` / ``compare.png`` but keeps the temporary file, and no later command
  cleans a ``compare --out`` folder (it is no run's, study's or reproduction's). Killed in a
  run folder (``compare RUN``, its default ``--out``), the rerun keeps it too (only the
  run's next ``train`` removes it). Round 46b's fix made ``advise --out`` clean the
  temporary file of its own killed write on the next start (``claim_folder``); ``compare``
  calls :func:`partialfl.io.clean_stale_writes` nowhere. Suspected root cause:
  :func:`partialfl.pipeline.compare.compare` (``out.mkdir(...)`` then the writes, with no
  clean-up of an earlier start's temporary files).

* Area 3/8 (a refusal the build could give, given only after the run started), ``[attack]
  fraction = 0.3`` (⌊0.3·8⌋ = 2 of 8 clients: 0.25) under ``[aggregation] name = "tm", delta
  = 0.2`` on a least-squares FFGG run: ``partialfl run --dry-run`` accepts it ("dry run:
  nothing trained, nothing written", exit 0); the run itself ends "partialfl: error: tm: the
  Byzantine fraction of the run (0.25) exceeds the aggregator's delta = 0.2, the fraction it
  tolerates; ..." (exit 2) and leaves an empty ``tmat.jsonl`` in ``--out``. Both numbers are
  the spec's (and the number of clients is known at build), and
  :func:`partialfl.build.algorithm.check_protected` exists to refuse an unprotected rule
  "when the spec is built (so ``--dry-run`` says it)"; round 57b made the build refuse its
  ``[asynchronous]`` misfit for the same reason. Suspected root cause:
  :meth:`partialfl.algorithms.byzantine.ByzantineRobust.init` (``check_fraction`` only at
  the run's start) / :func:`partialfl.algorithms.byzantine._byzantine` (no check when the
  wrapper is built).

* Area 4/8 (a run's own file replaced by another command; minor: the user names the path),
  ``partialfl evaluate RUN --json RUN/deploy.safetensors`` (or ``RUN/metrics.json``,
  ``RUN/stage2.ckpt``: any file the run lists in ``run_files.json``) prints the table,
  "metrics written to RUN/deploy.safetensors", exit 0 — the trained model is replaced by
  the evaluation's JSON, after which the run is unusable (``evaluate RUN``: "... is truncated
  or not a safetensors file"); with ``RUN/metrics.json`` instead, ``compare`` silently drops
  the run's training-client section and relabels its group. The run's files are otherwise
  guarded: a later command's file is refused when it is one of the user's names
  (:func:`partialfl.pipeline.run_files.record_added`), a run refuses to start beside a file
  named like one of its own (``RUN_NAMES``). Expected: ``--json`` naming a file a run owns
  (listed in a ``run_files.json`` beside it) refused in one line, exit 2, the file kept.
  Suspected root cause: :mod:`partialfl.cli.runs` (``pio.write_text(Path(args.json), ...)``
  with no check of whose file it replaces).

Tried and held (run): ``[aggregation] name = "cm"`` on every closed-form algorithm
(``fedavg``, ``scaffold``, ``ffgg``, ``local-ffgg``, ``fedalt``, ``fedsim``, ``l2gd``: θ moves);
``weighting = "examples"`` on each (accepted; equal example counts, so θ equal to rounding;
``l2gd`` refused); ``[asynchronous] fedasync`` on each (acts; ``l2gd`` refused at build);
``[attack] sign-flip`` with and without ``cm`` on ``l2gd``, ``scaffold``, ``fedavg`` (acts);
``[privacy]`` on ``scaffold`` (refused, one line), on ``l2gd`` / ``fedavg`` (trains); ``krum``
at k = 4 (refused: ⌊δk⌋ = 0); ``[faults] rate = 0`` and ``kinds = ["nan"]`` on ``l2gd``
(train); ``advise har`` with ``--clients 0 / -3 / 1 / 100000``, ``--pretrain-rounds -1``,
``--threads 0``, ``--theta`` missing or a TOML, ``--table`` /etc/passwd or a TOML (one line,
exit 2, or a result); ``reproduce ls-compare --backend sequential|processes`` (one line);
``reproduce faults --seeds -1``, ``byzantine --seeds 1e20``, ``async --folds 3`` (one line);
``reproduce faults --quick --seeds 1 1`` (runs twice; its checks and comparisons take the
set of seeds); ``evaluate RUN`` with ``--finetune-epochs 0``, ``--lr 1e-320`` (run), ``--lr
inf`` / ``--json RUN`` (a folder: one line, no temporary file left); ``compare A A B``,
``compare A LINK_TO_A B`` (counted once), ``compare A COPY_OF_A B`` (one line); an
``[attack]`` with ``cm`` under ``fedasync``, with ``tm`` δ 0.25 under ``fedbuff`` K 8 (run),
``krum`` δ 0.25 under ``fedbuff`` K 4 (refused at build); kill -9 of ``compare --out`` at
``run_files.json`` / ``compare.json`` (no such write: finishes); ``data convert
leaf-json`` with ``--max-clients 0 / -1``, ``--option`` ``seq_len=abc`` / ``=3`` / ``foo`` /
``__class__=1`` (one line, nothing left), into a user folder or a link with and without
``--overwrite`` (refused, kept).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _adv_cli import env


def _cli(cwd, *args, timeout: float = 170):
    return subprocess.run([sys.executable, "-m", "partialfl", *args], cwd=cwd, env=env(None),
                          capture_output=True, text=True, timeout=timeout)


def _l2gd_toml(path, *, backend: str | None = None, faults: str | None = None):
    head = "" if backend is None else f'backend = {{ name = "{backend}" }}\n'
    fl = "" if faults is None else f"[faults]\nrate = 0.3\nkinds = [\"{faults}\"]\n"
    path.write_text(f"""{head}name = "l2"
[problem]
name = "least-squares"
num_clients = 8
n = 200
d_theta = 5
d_w = 3
[method]
algorithm = "l2gd"
{fl}[personalize]
rounds = 5
clients_per_round = 0
client = {{ name = "gd", tau = 3 }}
""")
    return path


def _trains_or_is_refused_at_build(tmp_path, cfg):
    """The run trains (exit 0), or ``--dry-run`` refuses it in one line and the run counts
    no healthy client as failed."""
    p = _cli(tmp_path, "run", str(cfg), "--out", str(tmp_path / "out"), "--no-progress")
    if p.returncode == 0:
        return
    dry = _cli(tmp_path, "run", str(cfg), "--dry-run")
    assert dry.returncode == 2 and "Traceback" not in dry.stderr, \
        (dry.returncode, p.returncode, p.stderr.strip().splitlines()[-1])
    assert "needs full participation (clients_per_round = all)" not in p.stderr, \
        p.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- area 1/8
def test_control_l2gd_on_the_default_backend_trains(tmp_path):
    p = _cli(tmp_path, "run", str(_l2gd_toml(tmp_path / "c.toml")), "--out",
             str(tmp_path / "out"), "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]


@pytest.mark.parametrize("backend", ["sequential", "threads", "processes"])
def test_l2gd_on_a_per_client_backend_trains_or_is_refused(tmp_path, backend):
    """Found: dry run exit 0; the run logs all 8 clients as failed and ends "L2GD needs full
    participation (clients_per_round = all)", exit 2. Expected: it trains, or the build
    refuses the backend (one line, also under ``--dry-run``)."""
    _trains_or_is_refused_at_build(tmp_path, _l2gd_toml(tmp_path / "b.toml", backend=backend))


@pytest.mark.parametrize("backend", ["sequential", "threads"])
def test_l2gd_per_client_is_the_batched_run(backend):
    """The fix's claim: each client's L2GD steps depend on the round's shared coin only, so
    one client per call gives the batched (vmap) run's θ and personal models."""
    import numpy as np
    from _flower_sims import in_process, ls_run

    spec = {"method": {"algorithm": "l2gd"}, "personalize": {"client": {"name": "gd",
                                                                        "tau": 3}}}
    runs = {b: in_process(ls_run(6, spec={**spec, "backend": b}))[1]
            for b in ("vmap", backend)}
    for n, v in runs["vmap"].state.theta.items():
        np.testing.assert_allclose(np.asarray(runs[backend].state.theta[n]), np.asarray(v),
                                   rtol=1e-10, atol=1e-12)


def test_control_l2gd_with_nan_faults_trains(tmp_path):
    p = _cli(tmp_path, "run", str(_l2gd_toml(tmp_path / "n.toml", faults="nan")), "--out",
             str(tmp_path / "out"), "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]


def test_l2gd_with_raise_faults_is_refused_or_counts_only_the_faults(tmp_path):
    """Found: dry run exit 0; healthy clients logged "it failed (ValueError: L2GD needs full
    participation ...)", the run ends "injected raise fault in client 0, round 0", exit 1.
    Expected: the build refuses raise faults for a full-participation algorithm (one line),
    or no healthy client is reported failed."""
    _trains_or_is_refused_at_build(tmp_path, _l2gd_toml(tmp_path / "f.toml", faults="raise"))


# ----------------------------------------------------------------------------- area 8
def _async_summary(tmp_path, *seeds):
    out = tmp_path / "async"
    p = _cli(tmp_path, "reproduce", "async", "--quick", "--seeds", *seeds, "--out", str(out),
             "--no-progress")
    return p, ((out / "summary.md").read_text() if p.returncode == 0 else None)


def test_control_two_distinct_seeds_give_an_interval(tmp_path):
    p, summary = _async_summary(tmp_path, "0", "1")
    assert summary is not None and "over the 2 seeds" in summary, p.stderr[-400:]


def test_repeated_seeds_are_refused_or_counted_once(tmp_path):
    """Found: exit 0, "95% t interval over the 2 seeds", intervals like [-24.45, -24.45],
    MDE 0.00. Expected: one line, exit 2, or the seed counted once (no interval)."""
    p, summary = _async_summary(tmp_path, "0", "0")
    if summary is None:
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-400:]
        return
    assert "over the 2 seeds" not in summary, \
        [ln for ln in summary.splitlines() if ln.startswith("| sync FFGG")]


# ----------------------------------------------------------------------------- area 4
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from _user_project import TINY_MODEL, client_folder, tiny_toml

    root = tmp_path_factory.mktemp("cmp")
    (root / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(root / "data", clients=6)
    a = tiny_toml(root / "a.toml", "usermodels:tiny", data, name="a")
    b = tiny_toml(root / "b.toml", "usermodels:tiny", data, name="b")
    b.write_text(b.read_text().replace('algorithm = "ffgg"\nsplit = "output"\n',
                                       'algorithm = "fedavg"\n'))
    for cfg, name in ((a, "a"), (b, "b")):
        p = _cli(root, "train", str(cfg), "--allow-code", "--out", str(root / "runs" / name))
        assert p.returncode == 0, p.stderr[-600:]
    return root


@pytest.mark.parametrize("name", ["compare.png", "compare.md"])
def test_a_rerun_compare_cleans_its_killed_writes_temporary_file(two_runs, name):
    """Found: after the kill, ``C/.compare.png.XXXXXXXX.tmp``; the same command again exits 0
    and keeps it. Expected: the rerun removes it (as ``advise``, ``train``, ``reproduce``)."""
    from _adv_cli import killed

    out = two_runs / f"c-{name}"
    args = ("compare", "runs/a", "runs/b", "--out", str(out))
    r = killed(two_runs, None, "replace", f"/{out.name}/{name}", *args)
    assert r.returncode == -9, (r.returncode, r.stderr[-400:])
    assert list(out.glob(f".{name}.*.tmp"))  # the killed write's
    r = _cli(two_runs, *args)
    assert r.returncode == 0 and (out / "compare.md").is_file(), r.stderr[-400:]
    left = sorted(p.name for p in out.rglob(".*.tmp"))
    assert not left, f"stale temporary files kept for good: {left}"


# ----------------------------------------------------------------------------- area 3/8
def _tm_toml(path, delta: float):
    path.write_text(f"""name = "tmat"
[problem]
name = "least-squares"
num_clients = 8
n = 200
d_theta = 5
d_w = 3
[method]
algorithm = "ffgg"
[aggregation]
name = "tm"
delta = {delta}
[attack]
fraction = 0.3
attack = "sign-flip"
[personalize]
rounds = 5
clients_per_round = 0
client = {{ name = "gd", tau = 3 }}
""")
    return path


def test_control_a_fraction_within_delta_runs(tmp_path):
    cfg = _tm_toml(tmp_path / "ok.toml", 0.25)
    assert _cli(tmp_path, "run", str(cfg), "--dry-run").returncode == 0
    p = _cli(tmp_path, "run", str(cfg), "--out", str(tmp_path / "o"), "--no-progress")
    assert p.returncode == 0, p.stderr[-400:]


def test_a_fraction_above_delta_is_refused_by_the_dry_run(tmp_path):
    """Found: ``--dry-run`` exit 0; the run: "tm: the Byzantine fraction of the run (0.25)
    exceeds the aggregator's delta = 0.2 ...", exit 2, ``tmat.jsonl`` left. Expected: the
    build refuses it (one line, exit 2, also under ``--dry-run``)."""
    cfg = _tm_toml(tmp_path / "bad.toml", 0.2)
    p = _cli(tmp_path, "run", str(cfg), "--out", str(tmp_path / "o"), "--no-progress")
    assert p.returncode == 2 and "exceeds the aggregator's delta" in p.stderr, p.stderr[-300:]
    dry = _cli(tmp_path, "run", str(cfg), "--dry-run")
    assert dry.returncode == 2 and "Traceback" not in dry.stderr, dry.stdout[-200:]


# ----------------------------------------------------------------------------- area 4/8
def test_control_evaluate_json_to_a_new_file(two_runs):
    p = _cli(two_runs, "evaluate", "runs/a", "--allow-code", "--no-progress", "--json",
             "ev.json")
    assert p.returncode == 0 and (two_runs / "ev.json").is_file(), p.stderr[-400:]


def test_evaluate_json_never_replaces_a_file_of_the_run(two_runs):
    """Found: exit 0, "metrics written to runs/c/deploy.safetensors"; ``evaluate runs/c``
    then fails ("not a safetensors file"). Expected: one line, exit 2, the model kept."""
    import shutil

    run = two_runs / "runs" / "c"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(two_runs / "runs" / "a", run)
    model = (run / "deploy.safetensors").read_bytes()
    p = _cli(two_runs, "evaluate", "runs/c", "--allow-code", "--no-progress", "--json",
             "runs/c/deploy.safetensors")
    kept = (run / "deploy.safetensors").read_bytes() == model
    assert p.returncode == 2 and kept, (p.returncode, kept, p.stdout.strip()[-120:])
