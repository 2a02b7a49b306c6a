"""What keeping a part personal buys under client-level differential privacy of θ
(``partialfl reproduce dp``, issue 24).

On HAR (by subject) and FEMNIST (by writer), for ε ∈ {1, 3, 8, ∞}, the rows FedAvg, FFGG
(input / output / adapter) and their matched baselines FedAvg + FT (same part) run through
the table driver (:mod:`partialfl.reproductions.tables`), with θ's updates made
differentially private by :class:`partialfl.algorithms.dp.DifferentiallyPrivate`.

Design, and why (also written into the summary):

* **Public pre-training, private personalization.** The clients are split once (rng seed 0)
  into *public* clients (HAR: 6 of the 26 subjects, FEMNIST: 14 of the 84 writers) and the
  *private* population (the other 20 subjects / 70 writers). Stage 1 (FedAvg on every
  parameter) trains on the public clients only, without noise, and is shared by every ε,
  row and seed; the inputs are standardised with the public clients' statistics. Only
  stage 2 touches private data, so the guarantee covers stage 2's rounds alone (no budget
  split between stages, no composition across them).
* **What gets noise.** In stage 2 every sampled private client clips its θ message
  (FedAvg: Δθ, FFGG: ∇_θ f_m) to norm C and the server adds N(0, z²C² I) to the sum
  (central DP, fixed denominator k; DP-FedAvg, McMahan et al. 2018). Personal parameters
  (FFGG's input / output / adapter part) and stage 3 (every client fine-tunes its part, θ
  fixed) never leave the client and get no noise: they are not released.
* **Accounting.** Poisson sampling with rate q = k/M (k = 10 clients per round); ε for
  δ = 0.1/M over stage 2's R rounds from ``dp-accounting``'s RDP accountant
  (:mod:`partialfl.dp_accounting`); z is solved for the target ε (the smallest z with
  ε(z) ≤ target). The guarantee is client-level: add or remove one private client.
  ε = ∞ is the same run with the same clipping and z = 0 (no noise), so the ε = ∞ column
  isolates the noise. ε = 0 releases nothing: stage 2 runs 0 rounds, so every row is the
  public θ with its part fine-tuned in stage 3 (FFGG (part) and FedAvg + FT (part) are then
  the same computation): what private training adds at all.
* **Clip norms.** C_Δ per data set for a model change (FedAvg, FedAvg + FT: HAR 0.1,
  FEMNIST 0.15, about the median norm of the private clients' first FedAvg update from the
  public θ, 0.117 and 0.160, measured once without noise: a hyper-parameter chosen outside
  the privacy budget, as is usual in DP studies), and
  C_∇ = C_Δ / η_s for FFGG's gradient (η_s: FFGG's server lr), so that the bound on one
  client's θ step and the noise on θ per round are the same for every row.
* Otherwise the tables' settings (the HAR and FEMNIST tables' learning rates, batch 32,
  1 local epoch, 5 fine-tuning epochs); every private client trains and is evaluated
  (none held out); the test split is each private client's own.
* Intervals: paired over clients × seeds (:mod:`partialfl.stats`): every row's pooled
  accuracy; joint training minus fine-tuning the same part at each ε and that gap's change
  from ε = ∞ (a difference of differences); each row's accuracy drop from ε = ∞ minus
  FedAvg's (does a personal, noise-free part change the trade-off?).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.pipeline.report import (
    counts_from_runs,
    docstring_bullets,
    jsonable,
)
from partialfl.registry import component, register
from partialfl.reproductions.tables import Loaded, Table, TableRun, TableSize
from partialfl.spec import MethodConfig, RunSpec

#: ε = 0: no private training at all (stage 2 runs 0 rounds: the public θ, then stage 3)
EPSILONS = (0.0, 1.0, 3.0, 8.0, math.inf)
QUICK_EPSILONS = (0.0, 1.0, math.inf)
#: δ = DELTA_FACTOR / M (M: the private clients)
DELTA_FACTOR = 0.1
#: a run folder's record of a row group that failed (see :meth:`Private.run_group`)
FAILED = "failed.json"
PARTS = ("input", "output", "adapter")
ROWS: tuple[tuple[str, MethodConfig], ...] = (
    ("FedAvg", MethodConfig(algorithm="fedavg", split="none")),
    *((f"FFGG ({p})", MethodConfig(algorithm="ffgg", split=p)) for p in PARTS))


def eps_name(eps: float) -> str:
    """``1``, ``3``, ``8``, ``inf`` (folder names and keys)."""
    return "inf" if math.isinf(eps) else f"{eps:g}"


def eps_label(eps: float) -> str:
    return "∞" if math.isinf(eps) else f"{eps:g}"


@dataclass(frozen=True)
class Setting:
    """One data set of the study: its base table, how many clients are public, the clip
    norm C_Δ of a model change and FFGG's server lr η_s (C_∇ = C_Δ / η_s)."""

    key: str
    title: str
    public: int
    quick_public: int
    clip: float
    ffgg_server_lr: float

    @property
    def base(self) -> Table:
        if self.key == "har":
            from partialfl.reproductions.har import HAR
            return HAR
        from partialfl.reproductions.femnist import FEMNIST
        return FEMNIST

    def size(self, quick: bool, seeds=None) -> TableSize:
        """HAR: the table's rounds (stage 1 100 on the public subjects, stage 2 25); FEMNIST:
        stage 1 200, stage 2 100; every private client trains (none held out)."""
        b = self.base
        if self.key == "har":
            size = (replace(b.QUICK, num_subjects=10, pretrain_rounds=3) if quick
                    else replace(b.FULL, seeds=(0, 1)))
        else:
            size = (replace(b.QUICK, num_writers=16, pretrain_rounds=3, rounds=2) if quick
                    else replace(b.FULL, pretrain_rounds=200, rounds=100, seeds=(0, 1)))
        size = replace(size, holdout=0, eval_every=0)
        return replace(size, seeds=tuple(seeds)) if seeds else size


def settings() -> tuple[Setting, ...]:
    from partialfl.reproductions import femnist, har

    return (Setting("har", "HAR by subject", 6, 4, 0.1, har.FFGG_SERVER_LR),
            Setting("femnist", "FEMNIST by writer", 14, 4, 0.15, femnist.FFGG_SERVER_LR))


def public_private(key: str, size, data_dir=None, public: int = 6):
    """``(public_task, private_task, info)``: the clients split at random (seed 0) into
    ``public`` public clients and the private rest, inputs standardised with the public
    clients' statistics."""
    if key == "har":
        from partialfl.data.har import channel_mean_std, load_hapt, standardize
        from partialfl.reproductions.har import har_task

        raw = load_hapt(data_dir)
        if size.num_subjects is not None and size.num_subjects < raw.num_clients:
            keep = np.random.default_rng(0).permutation(raw.num_clients)[:size.num_subjects]
            raw = raw.subset(np.sort(keep))
        priv, pub = raw.split_clients(num_new=public, seed=0)
        mean, std = channel_mean_std(pub)
        pub, priv = standardize(pub, mean, std), standardize(priv, mean, std)
        return har_task(pub), har_task(priv), {"public": list(pub.client_ids),
                                                "private": list(priv.client_ids)}
    from partialfl.data.femnist import normalised_split, raw_writers
    from partialfl.reproductions.femnist import femnist_task

    raw = raw_writers(data_dir, size.num_writers, 0)
    priv_ids = raw.split_clients(num_new=public, seed=0)[0].client_ids
    pub, priv, _ = normalised_split(data_dir, raw, priv_ids)  # stats of the public writers
    return femnist_task(pub), femnist_task(priv), {"public": list(pub.client_ids),
                                                    "private": list(priv.client_ids)}


class Private(Table):
    """A base table's private clients at one ε: rows FedAvg, FFGG (input / output /
    adapter) and their matched baselines; stage 1 on the public clients, shared by every ε
    (``out_dir/../stage1``)."""

    def __init__(self, setting: Setting, eps: float, quick: bool, data_dir=None) -> None:
        self.setting, self.eps, self.quick, self.data_dir = setting, eps, quick, data_dir
        base = setting.base
        self.name = f"dp-{setting.key}"
        self.title = f"{setting.title} at ε = {eps_label(eps)}"
        self.own_rows = ROWS
        self.clients, self.unit = base.clients, base.unit
        self.QUICK, self.FULL = base.QUICK, base.FULL

    def load(self, size, data_dir=None) -> Loaded:
        s = self.setting
        pub, priv, info = public_private(s.key, size, data_dir,
                                         s.quick_public if self.quick else s.public)
        return Loaded(priv, None, info, pretrain_task=pub)

    def stage_configs(self, size):
        pre, stage2, ft = self.setting.base.stage_configs(size)
        if self.eps == 0:  # nothing private is trained: the public θ, then stage 3
            return pre, lambda method: replace(stage2(method), rounds=0), ft
        return pre, stage2, ft

    def privacy(self, method: MethodConfig, num_clients: int) -> dict[str, Any]:
        """The ``[privacy]`` block of a row (see the module docstring)."""
        c = self.setting.clip
        if method.entry.trait("sends") == "gradient":
            c = c / self.setting.ffgg_server_lr
        noise = ({"noise_multiplier": 0.0} if math.isinf(self.eps)
                 else {"target_epsilon": float(self.eps)})
        return {"name": "dp", "clip_norm": c, "delta": DELTA_FACTOR / num_clients,
                "sampling": "poisson", "accountant": "rdp", **noise}

    def config(self, size, method: MethodConfig, seed: int,
               backend: str = "sequential", device: str = "cpu") -> RunSpec:
        spec = super().config(size, method, seed, backend, device)
        if self.eps == 0:
            return spec
        m = len(self.loaded(size, self.data_dir).task.data.client_ids)  # M: private clients
        return replace(spec, privacy=component("wrapper", self.privacy(method, m), "privacy"))

    def stage1_config(self, size, backend: str = "sequential", device: str = "cpu") -> RunSpec:
        """Stage 1 on the public clients: no privacy block."""
        return super().config(size, self.rows[0][1], size.seeds[0], backend, device)

    def stage1_dir(self, out_dir: Path) -> Path:
        return Path(out_dir).parent / "stage1"

    def run_group(self, out_dir: Path, data_dir, size, backend: str, device: str,
                  options: dict, seed: int, labels, progress: bool):
        """The table's rows of one seed; a row group whose stage 2 loses too many client
        computations (e.g. FFGG's fine-tuning turning non-finite on a θ drowned in noise at
        small ε) is a *result*, not a crash: every row of the group is recorded as failed
        (``failed.json`` in the group's first run folder, so a resumed study does not rerun
        it), shown as such in the summary, and the study goes on."""
        from partialfl.runtime.faults import ClientFaultError

        rows = dict(self.methods(size))
        marker = out_dir / f"seed{seed}" / rows[labels[0]].name / FAILED
        if not marker.exists():
            try:
                return super().run_group(out_dir, data_dir, size, backend, device, options,
                                         seed, labels, progress)
            except ClientFaultError as e:
                pio.write_json(marker, {"stage": "stage2", "error": str(e)})
        why = pio.read_json(marker)["error"]
        return [(label, seed, {"method": rows[label].name, "seed": seed, "failed": why}, 0.0)
                for label in labels]

    def summary(self, run: TableRun, plots=()) -> str:
        """The base table's summary without the failed rows (see :meth:`run_group`), which
        a closing section lists with their errors."""
        failed = {k: sorted({m["failed"] for m in v if "failed" in m})
                  for k, v in run.results.items() if any("failed" in m for m in v)}
        text = super().summary(replace(run, results={k: [] if k in failed else v
                                                     for k, v in run.results.items()}), plots)
        return text + "".join(f"\n- failed: {k}: {why}" for k, v in failed.items()
                              for why in v) + ("\n" if failed else "")

    def full_sizes(self):
        return ()  # the study gives its own verdicts

    def _plots(self, out_dir: Path, run: TableRun) -> list[str]:
        return []


def _privacy_of(out: Path, size, rows) -> dict[str, dict]:
    """Per stage-2-owning row: what its runs' last stage-2 record says (ε spent, z, δ, C)."""
    from partialfl.runtime import read_jsonl

    got = {}
    for label, method in rows:
        recs = [read_jsonl(out / f"seed{s}" / method.name / "stage2.jsonl")[-1]
                for s in size.seeds]
        got[label] = {k: [r[k] for r in recs] for k in
                      ("round", "dp_epsilon", "dp_noise_multiplier", "dp_delta",
                       "dp_clip_norm")}
    return got


def _panel(st: Setting, size) -> dict[str, Any]:
    return {"title": st.title, "seeds": list(size.seeds), "by_eps": {},
            "size": {"pretrain_rounds": size.pretrain_rounds, "rounds": size.rounds,
                     "finetune_epochs": size.finetune_epochs,
                     "clients_per_round": getattr(size, "clients_per_round", 10)},
            "clip": st.clip, "ffgg_server_lr": st.ffgg_server_lr}


def _add_eps(panel: dict, table: Private, sub: Path, size, eps: float) -> None:
    """A finished table at ``eps`` (folder ``sub``) into ``panel``: every row's per-client
    counts (rows that failed in any seed: their errors instead), the runs' privacy records,
    the clients and the matched pairs."""
    res = pio.read_json(sub / "results.json")["results"]
    info = pio.read_json(sub / "data.json")
    panel["public"], panel["private"] = info["public"], info["private"]
    failed = {k: sorted({m["failed"] for m in v if "failed" in m})
              for k, v in res.items() if any("failed" in m for m in v)}
    panel["by_eps"][eps_name(eps)] = {
        "counts": {k: [c[0].tolist(), c[1].tolist()] for k, v in res.items()
                   if (c := counts_from_runs(v)) is not None},
        "failed": failed,
        "privacy": _privacy_of(sub, size, [r for r in ROWS if r[0] not in failed])
        if eps > 0 else {}}
    panel["matched"] = table.matched(list(res))


@register("reproduction", "dp",
          doc="Accuracy against ε under client-level DP of θ: FedAvg(+FT) vs FFGG parts")
def reproduce_dp(out_dir: Path, *, quick: bool = False, seeds: list[int] | None = None,
                 data_dir: Path | None = None, progress: bool = True) -> Path:
    """For HAR and FEMNIST and every ε: the rows through the table driver
    (``out_dir/KEY/eps=E/``, stage 1 in ``out_dir/KEY/stage1``); ``dp.json`` (every row's
    per-client counts per ε, the runs' ε, z, δ, C), ``accuracy_vs_epsilon.png`` and
    ``summary.md`` (returned; all three rewritten after every ε, so a stopped study keeps
    what finished)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    epsilons = QUICK_EPSILONS if quick else EPSILONS
    record: dict[str, Any] = {"quick": quick, "epsilons": [eps_name(e) for e in epsilons],
                              "panels": {}, "seconds": {}}
    for st in settings():
        size, tk = st.size(quick, seeds), time.perf_counter()
        record["panels"][st.key] = panel = _panel(st, size)
        # ε = 0 and ∞ first: every contrast needs them, so a study stopped early has them
        for eps in sorted(epsilons, key=lambda e: (0 < e < math.inf, e)):
            table = Private(st, eps, quick, data_dir)
            sub = out_dir / st.key / f"eps={eps_name(eps)}"
            table.reproduce(sub, size=size, data_dir=data_dir, progress=progress, quick=quick)
            _add_eps(panel, table, sub, size, eps)
            record["seconds"][st.key] = time.perf_counter() - tk
            record["total_seconds"] = time.perf_counter() - t0
            path = _write(out_dir, record)
    return path


def collect(out_dir: Path, *, quick: bool = False, seeds: list[int] | None = None) -> Path:
    """Rewrite ``dp.json``, the plot and ``summary.md`` from the finished tables under
    ``out_dir`` alone (those with a ``results.json``; e.g. of a study stopped early), without
    running anything; the measured time is then not known."""
    out_dir = Path(out_dir)
    record: dict[str, Any] = {"quick": quick, "epsilons": [], "panels": {}, "seconds": {},
                              "total_seconds": None}
    for st in settings():
        size = st.size(quick, seeds)
        panel = _panel(st, size)
        for eps in QUICK_EPSILONS if quick else EPSILONS:
            sub = out_dir / st.key / f"eps={eps_name(eps)}"
            if (sub / "results.json").exists():
                _add_eps(panel, Private(st, eps, quick), sub, size, eps)
        if panel["by_eps"]:
            record["panels"][st.key] = panel
    record["epsilons"] = [eps_name(e) for e in (QUICK_EPSILONS if quick else EPSILONS)
                          if any(eps_name(e) in p["by_eps"] for p in record["panels"].values())]
    return _write(out_dir, record)


def _write(out_dir: Path, record: dict) -> Path:
    """``dp.json``, ``accuracy_vs_epsilon.png`` and ``summary.md`` (returned) of ``record``."""
    from partialfl.reproductions.dp_report import epsilon_plot, summary

    pio.write_json(out_dir / "dp.json", jsonable(record))
    epsilon_plot(out_dir / "accuracy_vs_epsilon.png", record)
    path = out_dir / "summary.md"
    pio.write_text(path, summary(record, docstring_bullets(__doc__, "Design, and why (also "
                                                           "written into the summary):")))
    return path


__all__ = ["EPSILONS", "Private", "QUICK_EPSILONS", "Setting", "collect", "public_private",
           "reproduce_dp", "settings"]
