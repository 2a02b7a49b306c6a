"""``partialfl train|run CONFIG --engine flower-sim|flower``: the same spec on Flower.

Each federated stage of the spec is one ``flwr run`` of the partialfl Flower app whose run
config carries the spec itself (key ``spec``) and the stage (:func:`stage_run_config`); the
ServerApp and every SuperNode build the stage from the spec exactly as the in-process run does
(:mod:`partialfl.flower.stage`), so the same seeds give the same θ.

* A closed-form spec (``partialfl run``): its one stage on Flower, then the in-process run's
  files: ``<name>.jsonl`` (the evaluated rounds; the loss gap is the SuperNodes' mean over
  their clients), ``<name>.png`` and ``summary.md``.
* A model spec (``partialfl train``): stage 1 (pre-training) and stage 2 (the method, from
  stage 1's θ through ``init-from``) on Flower; their θ are written where the pipeline keeps
  them (``stage1/theta.safetensors``, ``theta_stage2.safetensors``, with the per-round
  records ``stage1/stage1.jsonl`` and ``stage2.jsonl``), and then the in-process pipeline
  (:func:`partialfl.pipeline.train.run_built`) finds both stages done and runs stage 3 —
  the clients' fine-tuning and evaluation, here where the data is — and writes the same run
  folder as an in-process run (``metrics.json``, ``new_clients.json``, ``report.md``, plots).
  The ServerApp's own files are in ``stage1/flower/`` and ``flower/``.

Engines (both through ``flwr run``, :class:`partialfl.flower.deployment.LocalFederation`):
``flower-sim`` — a simulation SuperLink with ``num_supernodes`` virtual SuperNodes;
``flower`` — a SuperLink and ``num_supernodes`` SuperNode processes started here (or, with
``superlink = "HOST:PORT"``, a deployment already running; or ``federation``, one the caller
started, e.g. ``partialfl flower local``'s, with TLS and per-node data).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.flower.config import encode_spec
from partialfl.flower.env import FlowerRunError, apply_flower_env, require_flower
from partialfl.pipeline.run_files import (
    record_start,
    refuse_linked_folders,
    refuse_users_entries,
)

ENGINES = ("flower-sim", "flower")


def _absolute(spec):
    """The spec with ``data.path`` absolute (SuperNodes run in other folders)."""
    if spec.data is not None and spec.data.path:
        data = dataclasses.replace(spec.data, path=str(Path(spec.data.path).expanduser()
                                                       .resolve()))
        spec = dataclasses.replace(spec, data=data)
    return spec


def stage_run_config(spec, stage: str = "personalize", init_from: str | Path | None = None,
                     **flower: Any) -> dict[str, Any]:
    """The Flower run config of one stage of ``spec`` (with ``data.path`` absolute) plus
    Flower's own keys ``flower`` (``out_dir=…``)."""
    cfg = {"spec": encode_spec(_absolute(spec)), "stage": stage}
    if init_from:
        cfg["init-from"] = str(init_from)
    cfg.update({k.replace("_", "-"): v for k, v in flower.items()})
    return cfg


def _names_code(spec) -> bool:
    """Whether ``spec`` names code (a ``module:callable`` model, plugins)."""
    from partialfl.flower.node import code_refs

    return bool(code_refs(spec.to_dict()))


def _check_engine(engine: str, superlink, root_certificates) -> None:
    from partialfl.flower.config import ConfigError
    from partialfl.flower.deployment import parse_address

    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r} is not allowed; allowed: {', '.join(ENGINES)}")
    if (superlink or root_certificates) and engine != "flower":
        raise ConfigError(f"--superlink / --root-certificates apply to engine 'flower' (a "
                          f"deployment), not {engine!r}")
    if root_certificates and not superlink:
        raise ConfigError("--root-certificates needs --superlink HOST:PORT")
    if superlink:
        try:
            parse_address(superlink)  # a bad address fails before anything is built
        except ValueError as e:
            raise ConfigError(str(e)) from None
    require_flower(simulation=engine == "flower-sim")
    apply_flower_env()


def _federation(spec, engine: str, num_supernodes: int, superlink, root_certificates):
    from partialfl.flower.deployment import LocalFederation, SuperLinkConnection

    if superlink:
        return SuperLinkConnection(superlink, num_supernodes,
                                   root_certificates=root_certificates)
    # the user's own spec names the code: their own SuperNodes may import it
    return LocalFederation(num_supernodes, simulation=engine == "flower-sim",
                           allow_imports=_names_code(spec))


def check_flower_run(run, flower: dict[str, Any], num_supernodes: int | None = None
                     ) -> None:
    """Before Flower starts (a dry run too), refuse what the apps would: Flower's own keys
    (``flower``) that do not validate, more SuperNodes than clients (one would hold none),
    an algorithm that keeps client state between rounds
    (:data:`STATEFUL`), and with ``secagg`` one whose server step needs more than the mean
    (:func:`partialfl.flower.secagg.check_algorithm`)."""
    from partialfl.build import stage_algorithm
    from partialfl.config import ConfigError
    from partialfl.flower.config import STATEFUL, parse_run_config
    from partialfl.flower.secagg import check_algorithm

    # Flower's own keys (--flower), with the out-dir every engine's run gives the ServerApp
    # (LocalFederation.run sets it), so checkpoint-every / resume validate as they will run
    parse_run_config(stage_run_config(run.spec, **{**flower, "out-dir": "out"}))
    n = run.problem.num_clients if run.problem is not None else run.task.data.num_clients
    if flower.get("secagg") and num_supernodes is not None and num_supernodes < 2:
        raise ConfigError("secagg: SecAgg+ needs at least 2 SuperNodes (the sum of one node's "
                          "updates is that node's)")
    if num_supernodes is not None and num_supernodes > n:
        raise ConfigError(f"{num_supernodes} SuperNodes for {n} clients: each SuperNode "
                          f"holds at least one client; use at most {n}")
    for stage in ("pretrain", "personalize") if run.task is not None else ("personalize",):
        alg = stage_algorithm(run.spec.effective(), stage, problem=run.problem, num_clients=n)
        if getattr(alg, "stateful_clients", False):
            raise ConfigError(f"method.algorithm: {run.spec.method.algorithm} {STATEFUL}")
        if flower.get("secagg"):
            check_algorithm(alg)


def _records(path: Path, static: dict[str, Any], history: list[dict]) -> None:
    from partialfl.runtime.logging import JsonlLogger

    with JsonlLogger(path, **static) as log:
        for rec in history:
            log.log(rec)


# ----------------------------------------------------------------------------- model runs
def run_flower_train(spec, out: str | Path, *, engine: str = "flower-sim",
                     num_supernodes: int = 2, dry_run: bool = False, progress: bool = True,
                     timeout: float = 900.0, superlink: str | None = None,
                     root_certificates: str | Path | None = None, federation=None,
                     flower: dict[str, Any] | None = None,
                     config: str | Path | None = None, overwrite: bool = False) -> str:
    """Run a model spec's stages on Flower into ``out`` (see the module docstring); returns
    a one-paragraph summary (``config``: the TOML file, recorded as an in-process run does).
    ``federation``: a started :class:`~partialfl.flower.deployment.LocalFederation` to run on
    (instead of ``engine``'s);
    ``flower``: more of Flower's own run-config keys (e.g. ``{"secagg": True}``);
    ``overwrite``: a finished run in ``out`` is replaced (the files it wrote), else refused —
    once the spec and the Flower options were checked and the federation answered."""
    from partialfl.build import build
    from partialfl.pipeline.files import (
        THETA1,
        THETA2,
        read_params,
        stage1_identity,
        stage2_identity,
    )
    from partialfl.pipeline.train import claim_out, format_plan, run_built

    if federation is None:
        _check_engine(engine, superlink, root_certificates)
    spec = absolute_data_path(spec)  # the SuperNodes run in folders of their own
    run = build(spec)  # validates everything and loads the data before Flower starts
    extra = _server_keys(flower)
    check_flower_run(run, extra, num_supernodes)
    eff = spec.effective()
    if dry_run:
        shown = json.dumps({k: v for k, v in stage_run_config(
            spec, "personalize", "STAGE1.npz", **extra).items() if k != "spec"})
        where = f", SuperLink {superlink}" if superlink else ""
        return (format_plan(run.plan) + f"\nengine     {engine} ({num_supernodes} "
                f"SuperNodes{where})\nstage-2 run config (+ spec): {shown}"
                "\ndry run: nothing trained, nothing written")
    out = Path(out).expanduser().resolve()  # the ServerApp runs in another folder
    if not overwrite:
        claim_out(out, False, spec)  # a finished run is refused before Flower starts
    s1 = out / "stage1"
    fed = federation if federation is not None else _federation(
        spec, engine, num_supernodes, superlink, root_certificates)
    t0 = time.perf_counter()
    with _entered(fed):  # nothing is written (or replaced) before the federation answers
        claim_out(out, overwrite, spec)
        out.mkdir(parents=True, exist_ok=True)
        refuse_linked_folders(out)  # no write may leave the run folder through a link
        record_start(out, spec.name)  # the user's own files (--overwrite keeps them)
        # a stage file is resumed from only if this configuration wrote it (as in process)
        id1 = stage1_identity(eff, run.task.name)
        id2 = stage2_identity({**eff.identity(), "task": run.task.name})
        if eff.pretrain.rounds > 0 and read_params(s1, THETA1, identity=id1) is None:
            rep = fed.run(stage_run_config(spec, "pretrain", **_audit(extra, "stage1")),
                          timeout=timeout,
                          out_dir=s1 / "flower", progress="pretrain" if progress else None)
            _stage_files(s1, "stage1", THETA1, rep, id1)
        theta1 = s1 / "theta.npz"
        if eff.pretrain.rounds > 0:
            _npz(theta1, read_params(s1, THETA1, identity=id1))
        if eff.personalize.rounds > 0 and read_params(out, THETA2, identity=id2) is None:
            init = theta1 if eff.pretrain.rounds > 0 else None
            rep = fed.run(stage_run_config(spec, "personalize", init,
                                           **_audit(extra, "stage2")),
                          timeout=timeout, out_dir=out / "flower",
                          progress="personalize" if progress else None)
            _stage_files(out, "stage2", THETA2, rep, id2)
    metrics = run_built(run, out, progress=False, config=config)  # stage 3: 1 and 2 are done
    where = (f" of the SuperLink at {superlink}" if superlink else
             f" ({getattr(fed, 'description', '')})" if federation is not None else "")
    return (f"{engine}: test accuracy {100 * metrics['test_acc']:.2f}% after "
            f"{eff.pretrain.rounds} + {eff.personalize.rounds} rounds on "
            f"{num_supernodes} SuperNodes{where} in {time.perf_counter() - t0:.1f} s; "
            f"results written to {out}/")


def absolute_data_path(spec):
    """``spec`` with a relative ``data.path`` made absolute against the working folder."""
    d = getattr(spec, "data", None)
    if d is None or not d.path or Path(d.path).expanduser().is_absolute():
        return spec
    path = str(Path(d.path).expanduser().absolute())
    return dataclasses.replace(spec, data=dataclasses.replace(d, path=path))


def _server_keys(flower: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's Flower keys, a relative ``audit-dir`` made absolute against the working
    folder (the ServerApp runs in a folder of its own, which a local federation deletes)."""
    extra = {str(k).replace("_", "-"): v for k, v in (flower or {}).items()}  # both spellings
    if extra.get("audit-dir"):
        extra["audit-dir"] = str(Path(extra["audit-dir"]).expanduser().absolute())
    return extra


def _audit(flower: dict[str, Any], stage: str) -> dict[str, Any]:
    """Flower's keys for one stage: an ``audit-dir`` gets one subfolder per stage."""
    if flower.get("audit-dir"):
        return {**flower, "audit-dir": str(Path(flower["audit-dir"]) / stage)}
    return flower


class _entered:
    """``with`` a federation the caller started (left running) or one started here."""

    def __init__(self, fed) -> None:
        self.fed, self.mine = fed, not getattr(fed, "started", False)

    def __enter__(self):
        return self.fed.__enter__() if self.mine else self.fed

    def __exit__(self, *exc) -> None:
        if self.mine:
            self.fed.__exit__(*exc)


def _npz(path: Path, params) -> None:
    from partialfl.arrays import to_numpy

    pio.write_npz(path, {n: to_numpy(v) for n, v in params.items()})


def _stage_files(folder: Path, tag: str, theta_name: str, rep: dict, identity: dict) -> None:
    """Where the pipeline keeps a finished stage: θ (stamped with the stage's ``identity``,
    as the in-process stage writes it), its records and its budget. A diverged stage is
    warned about (as in process); a stage 1 whose θ is not finite ends the run
    (:class:`FlowerRunError`) without θ, which would mark it done."""
    import torch

    from partialfl.pipeline.files import save_stage
    from partialfl.pipeline.stages import warn_diverged

    theta = {n: torch.from_numpy(v.copy()) for n, v in rep["theta"].items()}
    _records(folder / f"{tag}.jsonl", {"stage": tag}, rep["history"])
    s = rep["summary"]
    timing = {"seconds": s["seconds"], "rounds": s["server_steps"], "cap": s["server_steps"],
              "stopped": False, "engine": "flower"}
    for name in (f"{tag}_timing.json", "timing.json") if tag == "stage1" else (
            f"{tag}_timing.json",):
        pio.write_json(folder / name, timing, indent=1)
    why = warn_diverged(theta, "stage 1" if tag == "stage1" else "stage 2", rep["history"])
    if why and tag == "stage1":  # not kept as done: the nodes refuse a θ⁰ that is not finite
        raise FlowerRunError(f"{why}; stage 2 cannot start from it")
    save_stage(folder / theta_name, theta, identity)


# ----------------------------------------------------------------------------- closed forms
def run_flower_closed_form(spec, out: str | Path, *, engine: str = "flower-sim",
                           num_supernodes: int = 2, progress: bool = True,
                           timeout: float = 900.0, superlink: str | None = None,
                           root_certificates: str | Path | None = None, federation=None,
                           flower: dict[str, Any] | None = None
                           ) -> tuple[list[dict], Path, dict]:
    """A closed-form spec's stage on Flower into ``out``: ``<name>.jsonl`` (the evaluated
    rounds, ``loss_gap`` = the SuperNodes' mean), ``<name>.png``, ``summary.md``; returns
    ``(records, summary path, the ServerApp's report)``."""
    from partialfl.build import build
    from partialfl.pipeline.closed_form import write_report

    if federation is None:
        _check_engine(engine, superlink, root_certificates)
    run = build(spec)
    flower = _server_keys(flower)
    check_flower_run(run, flower, num_supernodes)
    out = Path(out).expanduser().resolve()
    if out.is_dir():  # checked before the federation starts (as for a model run)
        refuse_linked_folders(out)  # the ServerApp writes (and deletes) in out/flower
        refuse_users_entries(out, (f"{spec.name}.png", "summary.md", "flower"),
                             f"{spec.name}.jsonl")
    fed = federation if federation is not None else _federation(
        spec, engine, num_supernodes, superlink, root_certificates)
    t0 = time.perf_counter()
    with _entered(fed):
        out.mkdir(parents=True, exist_ok=True)
        refuse_linked_folders(out)
        log = out / f"{spec.name}.jsonl"  # first, as in process: the mark that the folder's
        if not log.exists():  # flower/ is this run's (a killed run is run again there)
            pio.write_text(log, "")
        rep = fed.run(stage_run_config(spec, **flower), timeout=timeout,
                      out_dir=out / "flower", progress=spec.name if progress else None)
    history = [{**{k: v for k, v in h.items() if not k.startswith("eval_")},
                "loss_gap": h["eval_loss_gap"]} for h in rep["history"] if "eval_loss_gap" in h]
    if not history or history[-1]["round"] != rep["summary"]["server_steps"]:
        raise RuntimeError("the SuperNodes' evaluation of the last round is missing (a node "
                           f"failed or withheld it; see {out / 'flower' / 'result.json'})")
    _records(out / f"{spec.name}.jsonl", {"method": spec.name}, history)
    return history, write_report(spec, history, time.perf_counter() - t0, out), rep
