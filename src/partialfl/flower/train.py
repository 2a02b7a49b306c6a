"""``partialfl train CONFIG --engine flower-sim|flower``: the same train spec on Flower.

Each federated stage of the spec (pre-training, personalization) is one ``flwr run`` of the
partialfl Flower app with ``problem = 'train'``: the run config carries the spec itself
(:func:`spec_run_config`: key ``train-spec`` = the spec as JSON, plus the stage's rounds,
clients per round, seed and evaluation period, all derived from the spec), and every
SuperNode builds the stage's problem and algorithm exactly as the in-process pipeline does
(:func:`partialfl.flower.models._spec_stage`), so any model and data a train config names run
on Flower and give the in-process θ. Stage 1's θ reaches stage 2 through ``init-from``.
Fine-tuning (stage 3) is client-local and runs here, as in-process, from Flower's θ.

Engines (both through Flower's current entry point, ``flwr run``, see
:class:`partialfl.flower.project.LocalFederation`; ``flwr.simulation.run_simulation`` is
deprecated in flwr 1.42): ``flower-sim`` — a simulation SuperLink (``flower-superlink
--simulation``, Ray) with ``num_supernodes`` virtual SuperNodes; ``flower`` — a real
SuperLink and ``num_supernodes`` SuperNode processes started on this machine, or, with
``superlink = "HOST:PORT"``, a deployment already running (a SuperLink and ``num_supernodes``
SuperNodes started with ``--node-config 'partition-id=i num-partitions=N'``, see
``examples/flower/README.md``; :class:`partialfl.flower.project.SuperLinkConnection`). Every
SuperNode needs the spec's data at the same path, and the ServerApp writes under ``out``,
which this process then reads (same machine or a shared file system).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.config import to_dict
from partialfl.flower.env import apply_flower_env, require_flower

ENGINES = ("flower-sim", "flower")


def _absolute(spec):
    """The spec with ``data.path`` absolute (SuperNodes run in other folders)."""
    if spec.data.path:
        data = dataclasses.replace(spec.data, path=str(Path(spec.data.path).expanduser()
                                                       .resolve()))
        spec = dataclasses.replace(spec, data=data)
    return spec


def encode_spec(spec) -> str:
    """The spec as one run-config string: ``b64:`` + base64 of its compact JSON (``flwr run
    -c`` splits its argument at spaces and quotes, which JSON is full of)."""
    import base64

    text = json.dumps(to_dict(_absolute(spec)), separators=(",", ":"))
    return "b64:" + base64.urlsafe_b64encode(text.encode()).decode()


def spec_run_config(spec, stage: str, init_from: str | Path | None = None
                    ) -> dict[str, Any]:
    """The Flower run config of one stage of ``spec`` (``pretrain`` or ``personalize``)."""
    pipe = spec.pipeline_config()
    st = pipe.pretrain if stage == "pretrain" else pipe.personalize
    return {
        "problem": "train", "train-spec": encode_spec(spec),
        "train-stage": stage, "num-rounds": st.rounds,
        "clients-per-round": st.clients_per_round or 0,
        "seed": pipe.stage1_seed if stage == "pretrain" else pipe.seed,
        "eval-every": st.eval_every or max(st.rounds, 1),
        "init-from": str(init_from or ""),
    }


def _names_code(spec) -> bool:
    """Whether ``spec`` names a ``package.module:callable`` (see
    :func:`partialfl.flower.node.code_refs`)."""
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.node import code_refs

    return bool(code_refs(parse_run_config(spec_run_config(spec, "pretrain"))))


def _write_history(path: Path, stage: str, history: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pio.write_text(path, "".join(json.dumps({"stage": stage, **r}, default=float) + "\n"
                                 for r in history))


def run_flower_train(spec, out: str | Path, *, engine: str = "flower-sim",
                     num_supernodes: int = 2, dry_run: bool = False, progress: bool = True,
                     timeout: float = 900.0, superlink: str | None = None,
                     root_certificates: str | Path | None = None) -> str:
    """Run ``spec``'s stages on Flower into ``out``; returns a one-paragraph summary.

    ``superlink`` (engine ``flower`` only): ``HOST:PORT`` of a running SuperLink with
    ``num_supernodes`` SuperNodes (nothing is started; insecure unless ``root_certificates``
    names the PEM file of its CA)."""
    if engine in ENGINES:
        require_flower(simulation=engine == "flower-sim")
    apply_flower_env()
    import torch

    from partialfl.build import build
    from partialfl.experiments.pipeline import _Stage2, finetune_and_evaluate, stage2_setup
    from partialfl.experiments.train import _write_json, format_plan
    from partialfl.experiments.train_report import write_report
    from partialfl.flower.project import LocalFederation, SuperLinkConnection, parse_address

    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not allowed; allowed: {', '.join(ENGINES)}")
    if (superlink or root_certificates) and engine != "flower":
        raise ValueError(f"--superlink / --root-certificates apply to engine 'flower' (a "
                         f"deployment), not {engine!r}")
    if root_certificates and not superlink:
        raise ValueError("--root-certificates needs --superlink HOST:PORT")
    if superlink:
        parse_address(superlink)  # a bad address fails before anything is built
    run = build(spec)  # validates everything and loads the data before Flower starts
    pipe = run.pipeline
    if pipe.method.algorithm in ("fedalt", "fedsim") and not pipe.method.stateless:
        raise ValueError("the Flower app runs stateless algorithms only; use "
                         "method.stateless = true for fedalt/fedsim")
    if dry_run:
        cfg = spec_run_config(spec, "personalize", "STAGE1.npz")
        shown = json.dumps({k: v for k, v in cfg.items() if k != "train-spec"})
        where = f", SuperLink {superlink}" if superlink else ""
        return (format_plan(run.plan) + f"\nengine     {engine} ({num_supernodes} "
                f"SuperNodes{where})\nstage-2 run config (+ train-spec): {shown}"
                "\ndry run: nothing trained, nothing written")
    out = Path(out).expanduser().resolve()  # the ServerApp runs in another folder
    theta1_file = out / "stage1" / "theta.npz"
    if superlink:
        fed = SuperLinkConnection(superlink, num_supernodes,
                                  root_certificates=root_certificates)
    else:
        # the user's own spec names the code: their own SuperNodes may import it
        fed = LocalFederation(num_supernodes, simulation=engine == "flower-sim",
                              allow_imports=_names_code(spec))
    with fed:  # nothing is written before the federation answers
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "spec.json", to_dict(spec))
        if pipe.pretrain.rounds > 0:
            rep = fed.run(spec_run_config(spec, "pretrain"), timeout=timeout,
                          out_dir=out / "stage1" / "flower",
                          progress="pretrain" if progress else None)
            theta1 = {n: np.asarray(v) for n, v in rep["theta"].items()}
            _write_history(out / "stage1" / "stage1.jsonl", "stage1", rep["history"])
        else:
            theta1 = {n: v.detach().numpy() for n, v in
                      run.task.model_fn(pipe.stage1_seed).named_parameters()}
        with pio.atomic_write(theta1_file, "wb") as f:
            np.savez(f, **theta1)
        if pipe.personalize.rounds > 0:
            rep = fed.run(spec_run_config(spec, "personalize", theta1_file), timeout=timeout,
                          out_dir=out / "flower", progress="personalize" if progress else None)
            theta2 = {n: torch.from_numpy(np.asarray(v)) for n, v in rep["theta"].items()}
            _write_history(out / "stage2.jsonl", "stage2", rep["history"])
        else:
            theta2 = None
    t1 = {n: torch.from_numpy(v) for n, v in theta1.items()}
    split, problem, alg, theta_start = stage2_setup(pipe, run.task, t1)
    s2 = _Stage2(split, problem, alg, theta2 if theta2 is not None else theta_start, None,
                 float("nan"))
    metrics, _, _ = finetune_and_evaluate(pipe, run.task, s2, out)
    _write_json(out / "metrics.json", metrics)
    write_report(out, tensorboard=spec.logging.tensorboard)
    where = f" of the SuperLink at {superlink}" if superlink else ""
    return (f"{engine}: test accuracy {100 * metrics['test_acc']:.2f}% after "
            f"{pipe.pretrain.rounds} + {pipe.personalize.rounds} rounds on "
            f"{num_supernodes} SuperNodes{where}; results written to {out}/")
