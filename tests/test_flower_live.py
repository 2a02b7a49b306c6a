"""Live Flower (issue 27): ONE federation of real processes for the whole module — a SuperLink
and 3 SuperNodes on 127.0.0.1 with TLS (generated certificates) and SuperNode authentication
(registered keys), each SuperNode holding only its own clients' data (a client store written
as ``partialfl flower local`` writes them) — and on it:

* the quickstart config (tiny) with FFGG via ``--engine flower``: θ after both stages equals
  the in-process run's (1e-6), the run folder has the in-process layout (``--engine
  flower-sim`` gives the in-process run too: tests/test_flower_baselines.py, the same
  pipeline on the simulation engine; tests/test_flower.py, FFGG there), and no personal
  tensor name or value is in any message the ServerApp received (``audit-dir``: every
  received message as Flower serialised it);
* the same with SecAgg+: θ within the stated quantisation error of the plain run, and no
  individual client update (nor a node's partial sum) in any received message;
* a SuperLink killed mid-run: restarted, the run resumes from its checkpoint to the
  uninterrupted θ; a SuperNode killed mid-run: counted, the run completes.

Slow (real processes; a few minutes on 2 cores): ``pytest -m slow tests/test_flower_live.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _flower_sims import in_process, ls_run

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "train" / "quickstart.toml"
TINY = ["data.num_clients=5", "data.holdout=1", "pretrain.rounds=2", "personalize.rounds=2",
        "pretrain.clients_per_round=3", "personalize.clients_per_round=3", "finetune.epochs=1",
        "logging.progress=false"]
NODES = 3


def _missing_binaries() -> list[str]:
    bindir = Path(sys.executable).parent
    return [b for b in ("flwr", "flower-superlink", "flower-supernode")
            if not (bindir / b).exists() and shutil.which(b) is None]


@pytest.fixture(scope="module")
def live(tmp_path_factory, data_dir):
    """``(federation, spec, in-process run folder, its metrics)``: the federation is shared by
    every test of this module."""
    pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")
    missing = _missing_binaries()
    if missing:
        pytest.skip(f"Flower's command-line tools are not installed: {', '.join(missing)}")
    from partialfl.build import build
    from partialfl.flower.deployment import LocalFederation
    from partialfl.flower.env import apply_flower_env
    from partialfl.flower.local import node_view, write_node_stores
    from partialfl.pipeline.train import load_run_spec, run_train

    apply_flower_env()
    base = tmp_path_factory.mktemp("live")
    spec = load_run_spec(QUICKSTART, [*TINY, f"data.path={data_dir}"])
    _, local = run_train(spec, base / "local", progress=False)
    stores = write_node_stores(node_view(build(spec)), NODES, base / "node-data")
    fed = LocalFederation(NODES, work_dir=base / "federation", secure=True, node_data=stores)
    with fed:
        yield fed, spec, base, local
    assert fed.alive_groups() == []


def _chunks(tree, n: int = 16) -> list[bytes]:
    """Runs of ``n`` float32 values of every row of a stacked tree (what a message would
    carry if it held the tree's values)."""
    out = []
    for v in tree.values():
        a = np.asarray(v.detach() if hasattr(v, "detach") else v, dtype=np.float32)
        for row in a.reshape(a.shape[0], -1):
            for i in range(0, row.size - n + 1, max(n, row.size // 4)):
                if np.abs(row[i:i + n]).sum() > 0:
                    out.append(row[i:i + n].tobytes())
    return out


def _audit(folder: Path, kind: str = "") -> list[bytes]:
    """The messages the ServerApp received (of one message type)."""
    return [p.read_bytes() for p in sorted(folder.glob(f"*-{kind}-*.bin" if kind else
                                                        "*.bin"))]


def _round0(spec, stage1_dir: Path | None = None):
    """The personalize stage's first round in process: the problem, θ⁰, the sampled cohort,
    each sampled client's update and fine-tuned personal values."""
    from partialfl import io as pio
    from partialfl.algorithms.base import RoundContext, ServerState
    from partialfl.build import build
    from partialfl.pipeline.stages import stage2_setup
    from partialfl.runtime.sync import sample_cohort

    run = build(spec)
    eff = spec.effective()
    theta1 = (pio.load_tensors(stage1_dir / "theta.safetensors", "θ1")[0] if stage1_dir else
              {n: p.detach().clone() for n, p in
               run.task.model_fn(eff.stage1_seed).named_parameters()})
    _, problem, alg, theta0 = stage2_setup(eff, run.task, theta1)
    cohort = sample_cohort(eff.seed, 0, problem.num_clients, eff.personalize.clients_per_round)
    ctx = RoundContext(eff.seed, 0)
    up = alg.client_update(alg.init(problem, theta0), problem, cohort, ctx).updates
    w = alg.solver(problem, cohort, theta0, eff.seed, 0).w
    return problem, theta0, cohort, up, w, ServerState


def test_quickstart_on_live_nodes_with_tls_is_the_in_process_run(live):
    """`partialfl train --engine flower --superlink 127.0.0.1:PORT --root-certificates
    ca.crt` against the live federation (TLS): the same θ as in process after both stages,
    the in-process run folder."""
    from test_flower_train import assert_same_run

    from partialfl.cli import main

    fed, spec, base, local = live
    sets = [a for o in [*TINY, f"data.path={spec.data.path}"] for a in ("--set", o)]
    t0 = time.perf_counter()
    assert main(["train", str(QUICKSTART), "--engine", "flower", "--superlink",
                 f"127.0.0.1:{fed.port}", "--root-certificates", str(fed.credentials.ca),
                 "--supernodes", str(NODES), "--out", str(base / "live"), "--no-progress",
                 "--flower", f"audit-dir={json.dumps(str(base / 'audit'))}", *sets]) == 0
    live_s = time.perf_counter() - t0
    assert_same_run(base / "live", base / "local", local)
    assert "Uvicorn running on https://" in (fed.logs / "superlink.log").read_text()
    # the nodes served their own stores: each holds examples of its partition only
    res = json.loads((base / "live" / "flower" / "result.json").read_text())
    assert sorted(n["partition-id"] for n in res["nodes"]) == [0, 1, 2]
    # no personal tensor name or value in any message the ServerApp received
    problem, theta0, cohort, up, w, _ = _round0(spec, base / "live" / "stage1")
    blobs = _audit(base / "audit" / "stage2")  # stage 1 trains every parameter
    assert len(_audit(base / "audit" / "stage2", "train")) >= 2 * 2
    assert len(blobs) > 2 * NODES and len(_audit(base / "audit" / "stage1")) > 2 * NODES
    names = [n.encode() for n in problem.w_names]
    assert names and not any(n in b for n in names for b in blobs)
    personal = _chunks(w)
    assert len(personal) > 10 and not any(c in b for c in personal for b in blobs)
    # the tap has teeth: the sampled clients' θ updates (plain aggregation) are in there
    sent = _chunks(up.vectors)
    assert any(c in b for c in sent for b in blobs)
    print(f"\nwall clock: live {live_s:.0f} s (2 + 2 rounds, 3 nodes)")


def test_secagg_on_live_nodes_is_the_plain_run_within_the_quantisation_error(live):
    """SecAgg+ over the 3 live SuperNodes, one round of FFGG: θ is the in-process (= plain
    Flower) θ within γ · N·2c/2^bits per coordinate, not equal to it (it was quantised), and
    no client's update is in any message the ServerApp received."""
    from partialfl import io as pio
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.secagg import quantisation_bound
    from partialfl.flower.train import run_flower_train
    from partialfl.pipeline.train import load_run_spec, run_train

    fed, _, base, _ = live
    spec = load_run_spec(QUICKSTART, [*TINY, "stages=['personalize', 'finetune']",
                                      "personalize.rounds=1", f"data.path={live[1].data.path}"])
    run_train(spec, base / "plain", progress=False)
    t0 = time.perf_counter()
    run_flower_train(spec, base / "secagg", engine="flower", federation=fed, progress=False,
                     flower={"secagg": True, "audit-dir": str(base / "audit-secagg")})
    secagg_s = time.perf_counter() - t0
    cfg = parse_run_config({"spec": spec, "secagg": True})
    eff = spec.effective()
    lr = float(eff.personalize.server.lr)
    # one round: θ¹ − θ¹_plain = −γ (aggregate − mean) (+ float32 rounding of θ)
    bound = lr * quantisation_bound(cfg, NODES) + 1e-7
    a = pio.load_tensors(base / "secagg" / "theta_stage2.safetensors", "θ2")[0]
    b = pio.load_tensors(base / "plain" / "theta_stage2.safetensors", "θ2")[0]
    diff = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert 0 < diff <= bound, (diff, bound)
    # the server never held an individual update: no client's vector (nor a node's partial
    # sum over its sampled clients) is in any message it received
    problem, theta0, cohort, up, w, _ = _round0(spec)
    blobs = _audit(base / "audit-secagg" / "stage2")
    assert any(b"secaggplus" in b for b in blobs)
    sent = _chunks(up.vectors)
    assert len(sent) > 10 and not any(c in b for c in sent for b in blobs)
    print(f"\nSecAgg+ personalization: {secagg_s:.0f} s for 1 round (3 nodes, loaded machine); "
          f"max |θ − θ_plain| = {diff:.2e} <= bound {bound:.2e}")


def test_an_unregistered_supernode_is_refused(live):
    """SuperNode authentication: a SuperNode with a key the SuperLink does not know never
    joins (the registered ones are online)."""
    import subprocess

    from partialfl.flower.certs import generate
    from partialfl.flower.deployment import free_port

    fed, _, base, _ = live
    stranger = generate(base / "stranger", 1)
    p = fed._start("stranger", ["flower-supernode", "--superlink", f"127.0.0.1:{fed.port}",
                                "--port", str(free_port()),
                                "--root-certificates", str(fed.credentials.ca),
                                "--auth-supernode-private-key", str(stranger.node_key(0)),
                                "--node-config", "partition-id=0 num-partitions=3",
                                "--max-retries", "3"])
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    gave_up = p.poll() not in (None, 0)
    fed.kill("stranger")
    log = (fed.logs / "stranger.log").read_text()
    assert gave_up and "SuperNode ID" not in log, log[-2000:]
    assert "Failed to activate SuperNode" in log or "Connection attempt failed" in log
    out = subprocess.run(["flwr", "supernode", "ls", "local", "--format", "json"],
                         env=fed.env, cwd=fed.work_dir, capture_output=True, text=True,
                         timeout=60).stdout
    nodes = json.loads(out[out.index("{"):])["nodes"]
    assert sum(n.get("status") == "online" for n in nodes) == NODES, nodes


def _kill_when(fed, out: Path, name: str, after_round: int, killed: list) -> threading.Thread:
    """Kill process ``name`` once the ServerApp's checkpoint in ``out`` is past
    ``after_round`` (or after 240 s)."""
    from partialfl import io as pio
    from partialfl.flower.checkpoint import SYNC_CHECKPOINT

    def watch() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:  # the committed round, read from the pointer (never cleaning: read only)
                nxt = pio.load_tensors(out / SYNC_CHECKPOINT)[1]["progress"]["round"]
            except (OSError, ValueError, KeyError):
                nxt = -1
            if nxt > after_round:
                fed.kill(name)
                killed.append(nxt)
                return
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_superlink_killed_mid_run_is_restarted_and_the_run_resumes(live):
    """Least squares, 3 rounds, a checkpoint every round: the SuperLink (and with it the
    ServerApp) is killed after round 1; the federation restarts it, resubmits the run with
    resume, and the final θ is the uninterrupted (in-process) one."""
    fed, _, base, _ = live
    run = ls_run(3, 4, eval_every=3, checkpoint_every=1)
    out = base / "ls-restart"
    killed: list = []
    watcher = _kill_when(fed, out, "superlink", 0, killed)
    restarts = fed.restarts
    rep = fed.run(run, out_dir=out, timeout=600)
    watcher.join(5)
    assert killed and fed.restarts == restarts + 1
    assert rep["summary"]["resumed_from"] >= 1 and rep["summary"]["server_steps"] == 3
    _, res = in_process(run)
    np.testing.assert_allclose(rep["theta"]["theta"], res.state.theta["theta"], rtol=0,
                               atol=1e-6)


def test_a_supernode_killed_mid_run_is_counted_and_the_run_completes(live):
    fed, _, base, _ = live
    run = ls_run(3, eval_every=3, checkpoint_every=1, round_timeout=15.0,
                 spec={"max_failure_fraction": 0.9})
    out = base / "ls-node-kill"
    killed: list = []
    watcher = _kill_when(fed, out, "supernode-2", 0, killed)
    rep = fed.run(run, out_dir=out, timeout=600)
    watcher.join(5)
    s = rep["summary"]
    assert killed and s["server_steps"] == 3 and not s["aborted"]
    assert s["failed_client_updates"] > 0
    assert {f["partition"] for f in rep["failures"] if f["kind"] in ("timeout", "error")} == {2}
    assert np.isfinite(rep["theta"]["theta"]).all()
