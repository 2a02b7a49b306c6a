"""The trained personalized models as a product: every client's deployed model (θ, w_m).

After training, client m deploys the model with the global parameters θ and its own personal
values w_m (personal parameters plus, for BatchNorm models, its running statistics). Which
w_m that is depends on the algorithm (``Algorithm.deployed``): FedAlt / FedSim and the presets
use the w_m each client kept; FFGG and Local FFGG fine-tune w_m from θ on the client's data.

::

    run = run_rounds(problem, algorithm, rounds=50, seed=1)
    models = personalize(problem, algorithm, run, seed=1)   # every client's (θ, w_m)
    table = models.evaluate()              # per-client test metrics, by client id
    models.save("out/personalized")        # safetensors + index.json, no pickle
    net = load_personalized("out/personalized", MyNet(), client_id="f0001_23")
    again = PersonalizedModels.load("out/personalized", MyNet()).evaluate(data=new_data)

Files written by :meth:`PersonalizedModels.save` (each written atomically with
:mod:`partialfl.io`; ``index.json`` last, so a folder with an index is complete):

* ``theta.safetensors`` — θ (the global parameters, by name);
* ``clients/NNNNNN.safetensors`` — w_m of client position NNNNNN (personal parameters and
  running statistics, by name);
* ``index.json`` — format tag, split kind, the global / personal / running-statistic names,
  ``clients``: ``[{"id": ..., "file": ...}]`` in client order, inserted adapters (module
  names and rank) if any, and free-form ``metadata``.

Loading never unpickles anything: safetensors holds only tensors, JSON only data.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from partialfl import io as pio
from partialfl.algorithms.base import Algorithm, RoundContext, ServerState
from partialfl.problems.model import ModelProblem, accuracy, cross_entropy
from partialfl.split import ADAPTER_CHILD, Split, insert_adapters
from partialfl.tree import fitted
from partialfl.types import Params

#: format tag written to (and required in) ``index.json``
FORMAT = "partialfl.personalized/1"


# ----------------------------------------------------------------------------- metrics table
@dataclass(frozen=True)
class ClientMetrics:
    """Per-client metrics of the deployed models on one data split, by client id.

    ``accuracy[i] = correct[i] / total[i]`` (nan for a client with no example) and
    ``loss[i]`` its mean loss, for client ``client_ids[i]``."""

    client_ids: tuple[str, ...]
    correct: np.ndarray
    total: np.ndarray
    accuracy: np.ndarray
    loss: np.ndarray
    split: str

    def __getitem__(self, client_id: str) -> dict[str, float]:
        return self.as_dict()[_client_position(self.client_ids, client_id)[1]]

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{client_id: {"accuracy", "loss", "correct", "total"}}``."""
        return {c: {"accuracy": float(self.accuracy[i]), "loss": float(self.loss[i]),
                    "correct": float(self.correct[i]), "total": float(self.total[i])}
                for i, c in enumerate(self.client_ids)}

    @property
    def pooled_accuracy(self) -> float:
        """Σ correct / Σ total over all clients."""
        return float(self.correct.sum() / max(self.total.sum(), 1e-12))

    def to_markdown(self) -> str:
        rows = [f"| client | {self.split} accuracy | {self.split} loss | examples |",
                "| --- | ---: | ---: | ---: |"]
        rows += [f"| {c} | {self.accuracy[i]:.4f} | {self.loss[i]:.4f} | {self.total[i]:g} |"
                 for i, c in enumerate(self.client_ids)]
        return "\n".join(rows)


# ----------------------------------------------------------------------------- the models
class PersonalizedModels:
    """Every client's deployed model: shared θ and stacked w (``[M, ...]`` per name).

    Args:
        split: the split the models were trained with (its ``model`` is the architecture).
        theta: the global parameters (shapes of the model's parameters).
        w: personal values stacked over the M clients (parameters and running statistics).
        client_ids: the M client ids, in the order of w's rows.
        problem: the :class:`~partialfl.problems.model.ModelProblem` whose data
            :meth:`evaluate` uses (None: evaluation unavailable).
        metadata: JSON-able facts saved with the models (algorithm, rounds, seed, …).
    """

    def __init__(self, split: Split, theta: Params, w: Params, client_ids: Sequence[str],
                 problem=None, metadata: Mapping[str, Any] | None = None) -> None:
        self.split, self.problem = split, problem
        self.client_ids = tuple(str(c) for c in client_ids)
        if len(set(self.client_ids)) != len(self.client_ids):
            raise ValueError("client_ids must be unique")
        missing = sorted(set(split.global_names) - set(theta))
        if missing:
            raise KeyError(f"theta lacks the global parameters {missing[:5]}")
        self.theta = {n: torch.as_tensor(theta[n]).detach() for n in split.global_names}
        self.w = {n: torch.as_tensor(v).detach() for n, v in w.items()}
        m = len(self.client_ids)
        bad = [n for n, v in self.w.items() if v.dim() == 0 or v.shape[0] != m]
        if bad:
            raise ValueError(f"personal values {bad[:5]} are not stacked over the {m} clients")
        self.metadata = dict(metadata or {})

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def params(self, client: str | int) -> dict[str, Tensor]:
        """θ and w_m of one client (by id, or by position if an int), by name."""
        i, _ = _client_position(self.client_ids, client)
        return {**self.theta, **{n: v[i] for n, v in self.w.items()}}

    def module(self, client: str | int) -> nn.Module:
        """A copy of the architecture with client ``client``'s θ and w_m loaded, in eval
        mode — a plain ``nn.Module`` to deploy."""
        return _load_into(copy.deepcopy(self.split.model), self.params(client))

    def evaluate(self, split: str = "test", data=None, *, loss_fn=cross_entropy,
                 metric=accuracy) -> ClientMetrics:
        """Each client's metrics on its own ``split`` data: the problem's data, loss and metric,
        or those of ``data`` (a FederatedDataset whose clients are some of these, matched by
        client id) with ``loss_fn`` / ``metric``."""
        if data is None:
            if self.problem is None:
                raise ValueError("these models carry no data: pass data=FederatedDataset")
            problem, rows = self.problem, np.arange(self.num_clients)
        else:
            rows = np.array([_client_position(self.client_ids, c)[0] for c in data.client_ids])
            device = self.problem.device if self.problem is not None else "cpu"
            problem = ModelProblem(self.split, data, loss_fn=loss_fn, metric=metric,
                                   vectorize=False, device=device)
        w = {n: v[torch.from_numpy(rows)] for n, v in self.w.items()}
        ids = tuple(self.client_ids[i] for i in rows)
        counts = problem.metric_counts(np.arange(len(rows)), self.theta, w, split)
        c, t = np.asarray(counts["correct"], float), np.asarray(counts["total"], float)
        lw = np.asarray(counts["loss_weight"], float)
        with np.errstate(invalid="ignore", divide="ignore"):
            acc = np.where(t > 0, c / np.where(t > 0, t, 1), np.nan)
            loss = np.where(lw > 0, np.asarray(counts["loss_sum"], float) / np.where(
                lw > 0, lw, 1), np.nan)
        return ClientMetrics(ids, c, t, acc, loss, split)

    @classmethod
    def load(cls, directory: str | Path, module: nn.Module) -> PersonalizedModels:
        """Every client's model saved by :meth:`save`, on the architecture ``module`` (an
        instance of the trained model; adapters are inserted again if needed). Evaluate with
        ``.evaluate(data=...)``."""
        d = models_folder(directory)
        index = read_index(d)
        rows = [_load(d, e["file"]) for e in index["clients"]]
        theta = _load(d, index["theta_file"])
        module = _with_adapters(module, index, {**theta, **(rows[0] if rows else {})})
        try:
            if any(r.keys() != rows[0].keys() for r in rows):
                raise ValueError("the client files hold other names")
            w = {n: torch.stack([r[n] for r in rows]) for n in rows[0]} if rows else {}
        except (ValueError, RuntimeError) as e:  # RuntimeError: shapes or dtypes differ
            raise pio.FileFormatError(f"{d}: the clients' files do not fit together "
                                      f"({str(e)[:120]})") from None
        where = index["theta_file"]
        try:  # θ and every w_m of the module's names and shapes, finite (as load_personalized)
            own = _own(module, {**theta, **(rows[0] if rows else {})})
            fitted(own, theta)
            for e, r in zip(index["clients"], rows):
                where = e["file"]
                fitted(own, r)
        except (KeyError, ValueError) as e:
            raise pio.FileFormatError(f"{d / where}: {str(e).strip(chr(34))[:200]}") from None
        split = Split(module, index["split"], tuple(index["global_names"]),
                      tuple(index["personal_names"]))
        return cls(split, theta, w,
                   [e["id"] for e in index["clients"]], None, index.get("metadata"))

    def save(self, directory: str | Path) -> Path:
        """Write θ, every w_m and ``index.json`` to ``directory`` (see the module docstring);
        returns the directory."""
        d = Path(directory)
        try:
            json.dumps(self.metadata)
        except TypeError as e:
            raise TypeError(f"metadata must be JSON-able: {e}") from None
        pio.save_tensors(d / "theta.safetensors", self.theta)
        entries = []
        for i, cid in enumerate(self.client_ids):
            rel = f"clients/{i:06d}.safetensors"
            pio.save_tensors(d / rel, {n: v[i] for n, v in self.w.items()})
            entries.append({"id": cid, "file": rel})
        state = getattr(self.problem, "state_names", None)
        if state is None:
            state = [n for n in self.w if n not in self.split.personal_names]
        index = {
            "format": FORMAT, "split": self.split.kind,
            "global_names": list(self.split.global_names),
            "personal_names": list(self.split.personal_names),
            "state_names": list(state), "theta_file": "theta.safetensors",
            "clients": entries, "adapters": _adapters(self.split), "metadata": self.metadata,
        }
        pio.write_json(d / "index.json", index, indent=1)
        return d


def personalize(problem, algorithm: Algorithm, run, *, seed: int = 0,
                client_state: Params | None = None,
                metadata: Mapping[str, Any] | None = None) -> PersonalizedModels:
    """Every client's deployed model after a run.

    Args:
        problem: the :class:`~partialfl.problems.model.ModelProblem` the run trained.
        algorithm: the run's algorithm (its ``deployed`` says what each client uses).
        run: a :class:`~partialfl.runtime.RunResult` (θ and the clients' state), a
            :class:`~partialfl.algorithms.base.ServerState`, or θ itself (a dict).
        seed: the run's seed — algorithms that fine-tune w_m from θ (FFGG, Local FFGG,
            stateless FedAlt/FedSim) draw their minibatches from it, as the run's
            evaluation did.
        client_state: the clients' state when ``run`` is not a RunResult (FedAlt / FedSim /
            presets keep w_m there).
        metadata: JSON-able facts to save with the models.
    """
    if not hasattr(problem, "split") or not hasattr(problem, "metric_counts"):
        raise TypeError("personalize needs a ModelProblem (a torch model with a split), got "
                        f"{type(problem).__name__}")
    if hasattr(run, "state") and hasattr(run, "client_state"):
        state, cs = run.state, run.client_state if client_state is None else client_state
    elif isinstance(run, ServerState):
        state, cs = run, client_state
    elif isinstance(run, Mapping):
        state, cs = ServerState(theta=dict(run)), client_state
    else:
        raise TypeError("run must be a RunResult, a ServerState or θ (a dict name → tensor), "
                        f"got {type(run).__name__}")
    if getattr(algorithm, "stateful_clients", False) and cs is None:
        raise ValueError(f"{algorithm.name} keeps w_m on the clients: pass the run's "
                         "RunResult (or its client_state)")
    dep = algorithm.deployed(state, problem, cs, RoundContext(int(seed), state.round))
    if dep.personalized_theta:
        raise ValueError(f"{algorithm.name} deploys a different θ per client; personalize "
                         "supports a shared θ")
    meta = {"algorithm": algorithm.name, "rounds": int(state.round), "seed": int(seed),
            **dict(metadata or {})}
    return PersonalizedModels(problem.split, dep.theta, dep.w, problem.data.client_ids,
                              problem, meta)


# ----------------------------------------------------------------------------- loading
def models_folder(directory: str | Path) -> Path:
    """The folder of saved models: ``directory`` itself, or for a run folder of
    ``partialfl train`` (or of a pipeline run with ``save_personalized``) its
    ``personalized/``."""
    d = Path(directory)
    if not (d / "index.json").exists() and (d / "personalized" / "index.json").exists():
        return d / "personalized"
    return d


def read_index(directory: str | Path) -> dict[str, Any]:
    """The ``index.json`` of a saved folder (checked to be this format)."""
    f = Path(directory) / "index.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: not a folder written by "
                                "PersonalizedModels.save (or the save did not finish)")
    index = pio.read_json(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{f} has format {repr(index.get('format'))[:40]}, expected {FORMAT!r}")
    _check_index(f, index)
    return index


def _check_index(f: Path, index: Mapping[str, Any]) -> None:
    """The entries the loaders use have their types (a crafted ``index.json`` once gave a
    TypeError or KeyError traceback); else :class:`~partialfl.io.FileFormatError`."""
    def names(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    clients, ad = index.get("clients"), index.get("adapters")
    checks = {
        "split": isinstance(index.get("split"), str),
        "theta_file": isinstance(index.get("theta_file"), str),
        "global_names": names(index.get("global_names")),
        "personal_names": names(index.get("personal_names")),
        "clients": isinstance(clients, list) and all(
            isinstance(e, dict) and isinstance(e.get("id"), str | int)
            and not isinstance(e.get("id"), bool) and isinstance(e.get("file"), str)
            for e in clients),
        "adapters": ad is None or (isinstance(ad, dict) and names(ad.get("modules"))
                                   and type(ad.get("rank")) is int and ad["rank"] >= 1),
        "metadata": isinstance(index.get("metadata", {}), dict | None),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise pio.FileFormatError(f"{f}: corrupt or not written by PersonalizedModels.save "
                                  f"(bad or missing {', '.join(bad)})")


def load_personalized(directory: str | Path, module: nn.Module, client_id: str | int
                      ) -> nn.Module:
    """Load θ and client ``client_id``'s w_m (by id, or by position if an int) saved by
    :meth:`PersonalizedModels.save` (``directory``: that folder, or a ``partialfl train`` run
    folder, which holds it as ``personalized/``) into ``module`` — an instance of the trained
    architecture — and put it in eval mode.

    Returns the module to use: ``module`` itself, or for an adapter split whose adapters
    ``module`` lacks, a copy with the same adapters inserted. Every parameter and running
    statistic of the module must be in the file and vice versa, with equal shapes."""
    d = models_folder(directory)
    index = read_index(d)
    ids = tuple(str(e["id"]) for e in index["clients"])
    i, _ = _client_position(ids, client_id)
    values = {**_load(d, index["theta_file"]), **_load(d, index["clients"][i]["file"])}
    return _load_into(_with_adapters(module, index, values), values)


def _with_adapters(module: nn.Module, index: Mapping[str, Any],
                   values: Mapping[str, Tensor]) -> nn.Module:
    """``module``, or for an adapter split a copy with the saved adapters inserted, of the
    rank the saved adapter weights ``values`` have (an index's rank alone, e.g. 10^9 in a
    received folder, would allocate before any shape check)."""
    ad = index.get("adapters")
    if ad:
        ranks = {int(v.shape[0]) for n, v in values.items()
                 if n.endswith(f"{ADAPTER_CHILD}.down.weight") and v.dim() == 2}
        if not ranks or ad["rank"] != max(ranks):
            raise pio.FileFormatError(f"adapter rank {ad['rank']} of the index does not match "
                                      f"the saved adapter weights (ranks {sorted(ranks)[:5]})")
    if ad and not any(ADAPTER_CHILD in n.split(".") for n, _ in module.named_parameters()):
        module, _ = insert_adapters(module, [re.escape(m) for m in ad["modules"]], ad["rank"])
    return module


def _load_into(module: nn.Module, values: Mapping[str, Tensor]) -> nn.Module:
    """Copy ``values`` into the module's parameters and buffers of the same names (all its
    parameters and normalization running statistics must be given, nothing else; each of
    the module's shape and finite: :func:`partialfl.tree.fitted`)."""
    own = _own(module, values)
    cast = fitted(own, values)
    with torch.no_grad():
        for n, c in cast.items():
            own[n].copy_(c)
    return module.eval()


def _own(module: nn.Module, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The module's tensors ``values`` must name exactly: its parameters and normalization
    running statistics (and buffers ``values`` names); a KeyError naming the difference."""
    own = {**dict(module.named_parameters()), **{
        n: b for n, b in module.named_buffers() if n in values or _is_running_stat(n, module)}}
    unknown = sorted(set(values) - set(own))
    missing = sorted(set(own) - set(values))
    if unknown or missing:
        raise KeyError(f"the saved model does not fit this module: names the module lacks "
                       f"{unknown[:5]}, module names not saved {missing[:5]}")
    return own


def _is_running_stat(name: str, module: nn.Module) -> bool:
    owner, _, leaf = name.rpartition(".")
    m = module.get_submodule(owner) if owner else module
    return isinstance(m, nn.modules.batchnorm._NormBase) and leaf in (
        "running_mean", "running_var", "num_batches_tracked")


# ----------------------------------------------------------------------------- helpers
def _load(directory: Path, rel: str) -> dict[str, Tensor]:
    """The tensors of ``directory / rel`` (a path from the index that leads outside the folder
    is refused; a pickle is refused by :func:`partialfl.io.load_tensors`)."""
    path = (directory / rel).resolve()
    if not path.is_relative_to(directory.resolve()):
        raise ValueError(f"index.json names a file outside {directory}: {rel!r}")
    return pio.load_tensors(path, "personalized-model file")[0]


def _client_position(ids: Sequence[str], client: str | int) -> tuple[int, str]:
    if isinstance(client, int | np.integer) and not isinstance(client, bool):
        if not 0 <= int(client) < len(ids):
            raise IndexError(f"client position {client} out of range 0..{len(ids) - 1}")
        return int(client), ids[int(client)]
    try:
        return ids.index(str(client)), str(client)
    except ValueError:
        raise KeyError(f"unknown client id {client!r}; ids are e.g. {list(ids[:5])}") from None


def _adapters(split: Split) -> dict[str, Any] | None:
    """Module names and rank of inserted adapters (to insert them again when loading)."""
    if split.kind != "adapter":
        return None
    mods, rank = [], 1
    for n, m in split.model.named_modules():
        child = getattr(m, ADAPTER_CHILD, None)
        if isinstance(child, nn.Module) and n.split(".")[-1] != ADAPTER_CHILD:
            mods.append(n)
            down = getattr(child, "down", None)
            if down is not None:
                rank = max(rank, down.out_features)
    return {"modules": mods, "rank": rank}
