"""``partialfl flower local CONFIG --nodes N``: a real federation on this machine, one command.

It builds the spec here (validating it, loading the data), then:

1. gives every SuperNode only its own clients' data: for a model run, node i gets a client
   store (:mod:`partialfl.data.store`) holding every training client of the run in order with
   only partition i's clients' examples (the others empty: client ids stay the run's, so every
   seeded draw is the in-process one), written by :func:`write_node_stores`; a closed-form
   problem is synthetic and public, so each node generates it and serves its partition;
2. starts ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1
   (:class:`~partialfl.flower.deployment.LocalFederation`) with TLS (a CA and a server
   certificate generated for 127.0.0.1/localhost) and SuperNode authentication (a key pair per
   node, registered with the SuperLink) — unless ``insecure``;
3. runs the spec with ``--engine flower`` on it (:mod:`partialfl.flower.train`): the same run
   folder, metrics, plots and summary as an in-process run, the ServerApp checkpointing every
   ``checkpoint_every`` rounds of the spec so a SuperLink that dies is restarted and the run
   resumed;
4. stops everything it started on exit, on an error and on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.flower.certs import check_num_nodes
from partialfl.flower.config import partition_clients


def node_view(run) -> Any:
    """The training clients of a built model run as the stages see them (the validation
    view when the spec carves one: :func:`partialfl.pipeline.stages.validation_tasks`)."""
    from partialfl.pipeline.stages import validation_tasks

    task, _ = validation_tasks(run.spec.effective(), run.task)
    return task.data


def write_node_stores(data, num_nodes: int, folder: str | Path) -> list[Path]:
    """One client store per node in ``folder`` (``node-i``): every client of ``data`` in
    order, with examples only for partition i's clients (see the module docstring)."""
    from partialfl.data.store import StoreWriter
    from partialfl.data.store.writer import check_replaceable

    folder = Path(folder)
    M = data.num_clients
    check_num_nodes(num_nodes)
    for i in range(num_nodes):  # every node's folder checked before the first is written
        if os.path.lexists(folder / f"node-{i}"):
            check_replaceable(folder / f"node-{i}")
    paths = []
    for i in range(num_nodes):
        own = set(partition_clients(M, num_nodes, i).tolist())
        path = folder / f"node-{i}"
        with StoreWriter(path, num_classes=data.num_classes, meta=data.meta, overwrite=True,
                         description=f"partition {i} of {num_nodes}: {data.description}"
                         ) as w:
            for m in range(M):
                arrs = [data.train_x[m], data.train_y[m], data.test_x[m], data.test_y[m]]
                if m not in own:
                    arrs = [np.zeros((0, *tuple(a.shape[1:])), dtype=_np_dtype(a))
                            for a in arrs]
                w.add(data.client_ids[m], *arrs)
        paths.append(path)
    return paths


def _np_dtype(a):
    import torch

    return torch.empty(0, dtype=a.dtype).numpy().dtype if isinstance(a, torch.Tensor) else \
        np.asarray(a).dtype


def run_local(spec, out: str | Path, num_nodes: int, *, insecure: bool = False,
              secagg: bool = False, work_dir: str | Path | None = None, progress: bool = True,
              timeout: float = 3600.0, flower: dict[str, Any] | None = None,
              config: str | Path | None = None, overwrite: bool = False) -> str:
    """Run ``spec`` on ``num_nodes`` live SuperNodes on this machine into ``out`` (see the
    module docstring); returns a summary. ``work_dir`` keeps the federation's files
    (credentials, node stores, logs; default: a temporary folder, removed after);
    ``config`` (the TOML file) and ``overwrite`` as for ``partialfl train``."""
    from partialfl.build import build
    from partialfl.flower.deployment import LocalFederation
    from partialfl.flower.env import apply_flower_env, require_flower
    from partialfl.flower.train import (
        _names_code,
        check_flower_run,
        run_flower_closed_form,
        run_flower_train,
    )

    require_flower()
    apply_flower_env()
    check_num_nodes(num_nodes)
    run = build(spec)  # validates everything, loads the data
    extra = {"checkpoint-every": spec.checkpoint_every, **({"secagg": True} if secagg else {}),
             **dict(flower or {})}
    check_flower_run(run, extra, num_nodes)
    tmp = None if work_dir else tempfile.mkdtemp(prefix="partialfl-local-")
    if work_dir is not None and Path(work_dir).is_dir():  # a kept work folder: written only
        from partialfl.pipeline.run_files import refuse_linked_folders

        refuse_linked_folders(Path(work_dir))  # inside it, never through a link below it
    work = Path(work_dir or tmp).resolve()
    try:
        stores = None if spec.closed_form else write_node_stores(
            node_view(run), num_nodes, work / "node-data")
        fed = LocalFederation(num_nodes, work_dir=work / "federation", secure=not insecure,
                              node_data=stores, allow_imports=_names_code(spec))
        with fed:
            if spec.closed_form:
                history, summary, rep = run_flower_closed_form(
                    spec, out, engine="flower", federation=fed, progress=progress,
                    timeout=timeout, flower=extra)
                last = history[-1]
                return (f"flower ({fed.description}): rel_dist2 {last['rel_dist2']:.4g}, "
                        f"loss gap {last['loss_gap']:.4g} after {last['round']} rounds; "
                        f"results written to {Path(out).resolve()}/")
            return run_flower_train(spec, out, engine="flower", federation=fed,
                                    num_supernodes=num_nodes, progress=progress,
                                    timeout=timeout, flower=extra, config=config,
                                    overwrite=overwrite)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
