"""Does joint training beat fine-tuning the same part, and from which heterogeneity on? A map
over a controlled knob of client heterogeneity (``partialfl reproduce heterogeneity``,
issue 22).

For a strength s ∈ [0, 1] every client's data get a transform that a small personal part can
absorb exactly, and three rows run through the table driver
(:mod:`partialfl.reproductions.tables`) at each s: FedAvg, FedAvg + FT (part) — FedAvg, then
the part fine-tuned per client — and FFGG (part), which trains θ jointly with that part. The
*gap* is FFGG − FedAvg + FT (same part), paired over clients × seeds with its 95% bootstrap
interval (:func:`partialfl.stats.paired_difference`); the map reports the smallest s whose
interval lies above 0 (or that none does).

* **HAR, input split** (:func:`rotate_sensors`): each subject's 3-axis accelerometer and
  gyroscope signals are rotated by the angle s·π about a random axis and scaled by the gain
  2^(s·v), v ~ U[−1, 1] (a sensor placed and calibrated differently per subject). The first
  convolution, made personal, absorbs it exactly: conv(g·R x) = conv with weights g·W R.
* **FEMNIST, output split** (:func:`permute_labels`): each writer relabels a random fraction
  s of the 62 classes by a random cycle among them (its own labelling convention); a
  personal output layer absorbs it exactly by permuting its rows.
* **Least squares** (:func:`least_squares_map`, the theory's check): Example 1's features
  (entries U[0, 1]/d) with targets y_m = A_mθ₀ + B_m w_m + ε, w_m = w̄ + s·u_m, u_m ~ N(0, I):
  s is the spread of the clients' personal coefficients. FFGG converges to θ* = argmin_θ
  Σ_m min_w f_m (Theorem 1); FedAvg's limit (gradient descent on the shared-w objective) is
  the joint least-squares fit with one w; both then fit each client's w exactly. At s = 0 a
  shared w is the true model and the two coincide up to noise; for s > 0 FedAvg's θ absorbs
  part of the personal signal (A_m and B_m are correlated), and the expected test loss of
  each, E[(aᵀΔθ + bᵀΔw)²] with the features' known second moments, predicts the gap.

The transforms draw from ``partialfl.rng.generator(0, purpose, client)``: the federation is
the same for every seed; seeds vary the training.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from partialfl import io as pio
from partialfl.pipeline.report import jsonable, markdown_table, quick_note
from partialfl.registry import register
from partialfl.reproductions.tables import Loaded, Table, TableRun
from partialfl.rng import generator
from partialfl.spec import MethodConfig

#: strengths of the full map and of the quick run
STRENGTHS = (0.0, 0.25, 0.5, 1.0)
QUICK_STRENGTHS = (0.0, 1.0)
LS_STRENGTHS = (0.0, 0.1, 0.25, 0.5, 1.0)


# ----------------------------------------------------------------------------- transforms
def _rotation(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rodrigues' rotation matrix about the unit vector ``axis`` by ``angle``."""
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k


def rotate_sensors(data, s: float):
    """HAR windows ``[n, 6, T]`` (acc x y z, gyro x y z) of client m rotated by s·π about a
    random axis and scaled by 2^(s·v), v ~ U[−1, 1] (train and test alike)."""
    import torch

    from partialfl.data.federated import FederatedDataset

    def tf(x, mat):  # the same matrix on the accelerometer's and the gyroscope's axes
        return torch.einsum("ij,nkjt->nkit", mat, x.reshape(len(x), 2, 3, -1)).reshape(x.shape)

    xs = {"train_x": [], "test_x": []}
    for m in range(data.num_clients):
        g = generator(0, "sensor-transform", m)
        axis = g.standard_normal(3)
        axis /= np.linalg.norm(axis)
        mat = 2.0 ** (s * g.uniform(-1, 1)) * _rotation(axis, s * math.pi)
        mat = torch.as_tensor(mat, dtype=data.train_x[m].dtype)
        for key in xs:
            xs[key].append(tf(getattr(data, key)[m], mat))
    return FederatedDataset(xs["train_x"], data.train_y, xs["test_x"], data.test_y,
                            data.client_ids, data.num_classes, data.description + f"; sensors "
                            f"rotated and scaled per subject, strength {s:g}", data.meta)


def permute_labels(data, s: float):
    """Each writer relabels round(s·C) random classes (C = the number of classes) by a
    random cycle among them (train and test alike)."""
    import torch

    from partialfl.data.federated import FederatedDataset

    k = int(round(s * data.num_classes))
    ys = {"train_y": [], "test_y": []}
    for m in range(data.num_clients):
        perm = np.arange(data.num_classes)
        if k >= 2:
            chosen = generator(0, "label-permutation", m).permutation(data.num_classes)[:k]
            perm[chosen] = np.roll(chosen, 1)
        p = torch.as_tensor(perm)
        for key in ys:
            ys[key].append(p[getattr(data, key)[m]])
    return FederatedDataset(data.train_x, ys["train_y"], data.test_x, ys["test_y"],
                            data.client_ids, data.num_classes, data.description + f"; labels "
                            f"permuted per writer, {k} of {data.num_classes} classes", data.meta)


# ----------------------------------------------------------------------------- the tables
_BASE: dict = {}


class Heterogeneous(Table):
    """A base table's training clients, transformed with strength ``s``; rows FedAvg, FFGG
    (``part``) and its matched baseline FedAvg + FT (``part``); no held-out clients."""

    def __init__(self, base: Table, transform, part: str, s: float, knob: str) -> None:
        self.base, self.transform, self.part, self.s, self.knob = base, transform, part, s, knob
        self.name = f"{base.name} {knob} s={s:g}"
        self.title = f"FFGG ({part}) vs FedAvg + FT ({part}), {knob} strength {s:g}"
        self.own_rows = (("FedAvg", MethodConfig(algorithm="fedavg", split="none")),
                         (f"FFGG ({part})", MethodConfig(algorithm="ffgg", split=part)))
        self.clients, self.unit = base.clients, base.unit
        self.QUICK, self.FULL = base.QUICK, base.FULL

    def load(self, size, data_dir=None) -> Loaded:
        key = (self.base.name, replace(size, seeds=(), threads=0, workers=0), str(data_dir))
        if key not in _BASE:  # one base data set for every strength
            _BASE.clear()
            _BASE[key] = self.base.load(size, data_dir)
        task = _BASE[key].task
        data = self.transform(task.data, self.s)
        return Loaded(replace(task, data=data, name=f"{task.name}-{self.knob}{self.s:g}"),
                      None, {"clients": list(data.client_ids), "strength": self.s})

    def stage_configs(self, size):
        return self.base.stage_configs(size)

    def full_sizes(self):
        return ()  # the map gives its own verdict; each s's summary is a part of it

    def _plots(self, out_dir: Path, run: TableRun) -> list[str]:
        return []


@dataclass(frozen=True)
class Knob:
    """One panel of the map: a table, a transform and the part that absorbs it."""

    key: str
    title: str
    base: str
    transform: Any
    part: str


def _knobs() -> tuple[Knob, ...]:
    return (Knob("har", "HAR by subject: sensors rotated and scaled; input split", "har",
                 rotate_sensors, "input"),
            Knob("femnist", "FEMNIST by writer: labels permuted; output split", "femnist",
                 permute_labels, "output"))


def _sizes(key: str, quick: bool, seeds):
    """The map's size of table ``key``, every client training (none held out), stage 2
    evaluated at its ends only: HAR's table size; FEMNIST's with half of its stage 1 and of
    its stage 2 (four strengths in the hour); quick: a few clients and rounds."""
    if key == "har":
        from partialfl.reproductions.har import HAR as T
        size = (replace(T.QUICK, num_subjects=6, pretrain_rounds=3) if quick
                else T.FULL)
    else:
        from partialfl.reproductions.femnist import FEMNIST as T
        size = (replace(T.QUICK, num_writers=8, pretrain_rounds=3, rounds=2) if quick
                else replace(T.FULL, pretrain_rounds=150, rounds=100))
    size = replace(size, holdout=0, eval_every=0)
    return T, replace(size, seeds=tuple(seeds)) if seeds else size


# ----------------------------------------------------------------------------- least squares
@dataclass(frozen=True)
class LSSize:
    """The least-squares analogue's sizes: clients, train and test rows per client, the
    dimensions of θ and w, the noise level, seeds (each draws its own data)."""

    num_clients: int = 32
    n: int = 200
    n_test: int = 200
    d_theta: int = 20
    d_w: int = 5
    noise: float = 0.1
    seeds: tuple[int, ...] = (0, 1, 2)


LS_FULL = LSSize()
LS_QUICK = LSSize(num_clients=8, n=40, n_test=40, d_theta=6, d_w=2, seeds=(0,))


def _ls_data(size: LSSize, s: float, seed: int):
    """Per client (A, B, y) for train and test: Example 1's features, planted targets."""
    g = generator(seed, "heterogeneity-ls")
    dt, dw = size.d_theta, size.d_w
    theta0, wbar = g.standard_normal(dt), g.standard_normal(dw)
    out = []
    for _ in range(size.num_clients):
        w = wbar + s * g.standard_normal(dw)
        rows = []
        for n in (size.n, size.n_test):
            a, b = g.random((n, dt)) / dt, g.random((n, dw)) / dw
            rows.append((a, b, a @ theta0 + b @ w + size.noise * g.standard_normal(n)))
        out.append((rows[0], rows[1], w))
    return theta0, out


def _fit_w(a, b, y, theta):
    return np.linalg.lstsq(b, y - a @ theta, rcond=None)[0]


def least_squares_map(size: LSSize, strengths=LS_STRENGTHS) -> dict[str, Any]:
    """Per s and seed: each client's test mean squared error after FFGG's limit θ* and after
    FedAvg's limit (one shared w) followed by fitting w per client, and the gap predicted
    from the features' second moments (see the module docstring)."""
    dt, dw = size.d_theta, size.d_w
    # E[c cᵀ] of a feature row c = (a, b): entries U[0, 1]/d, independent
    mu = np.r_[np.full(dt, 0.5 / dt), np.full(dw, 0.5 / dw)]
    second = np.outer(mu, mu) + np.diag(np.r_[np.full(dt, 1 / (12 * dt * dt)),
                                              np.full(dw, 1 / (12 * dw * dw))])
    out = {}
    for s in strengths:
        ffgg, ft, pred = [], [], []
        for seed in size.seeds:
            theta0, clients = _ls_data(size, s, seed)
            # FedAvg's limit: one least-squares fit of (θ, w) on every client's rows
            stack = np.vstack([np.hstack([a, b]) for (a, b, _), _, _ in clients])
            z = np.linalg.lstsq(stack, np.concatenate([y for (_, _, y), _, _ in clients]),
                                rcond=None)[0]
            theta_avg = z[:dt]
            # FFGG's limit θ*: each client's rows projected off its own B_m
            proj = []
            for (a, b, y), _, _ in clients:
                q, _ = np.linalg.qr(b)
                proj.append((a - q @ (q.T @ a), y - q @ (q.T @ y)))
            theta_star = np.linalg.lstsq(np.vstack([p for p, _ in proj]),
                                         np.concatenate([r for _, r in proj]), rcond=None)[0]
            row = {"ffgg": [], "ft": [], "pred": []}
            for (a, b, y), (at, bt, yt), w in clients:
                for key, th in (("ffgg", theta_star), ("ft", theta_avg)):
                    wm = _fit_w(a, b, y, th)
                    row[key].append(float(np.mean((at @ th + bt @ wm - yt) ** 2)))
                    e = np.r_[th - theta0, wm - w]
                    row["pred"].append((1 if key == "ft" else -1) * float(e @ second @ e))
            ffgg.append(row["ffgg"])
            ft.append(row["ft"])
            pred.append(sum(row["pred"]) / size.num_clients)
        out[s] = {"ffgg": np.asarray(ffgg), "ft": np.asarray(ft),
                  "predicted": float(np.mean(pred))}
    return out


def _loss_gap(ft: np.ndarray, ffgg: np.ndarray):
    """The paired bootstrap interval (clients × seeds) of mean test loss(FedAvg + FT) −
    mean test loss(FFGG), i.e. the gap in FFGG's favour: losses as counts over a common scale
    (the statistic is linear in them), the interval scaled back."""
    from partialfl.stats import paired_difference

    k = float(max(ft.max(), ffgg.max())) * (1 + 1e-9) or 1.0
    t = np.ones_like(ft)
    d = paired_difference(ft / k, t, ffgg / k, t)
    return {"estimate": k * d.estimate, "low": k * d.low, "high": k * d.high, "mde": k * d.mde}


# ----------------------------------------------------------------------------- the map
def _gap(results: dict, label: str, base: str) -> dict[str, float]:
    """FFGG − its matched baseline, paired over clients × seeds (accuracy points / 100)."""
    from partialfl.pipeline.report import counts_from_runs
    from partialfl.stats import paired_difference

    a, b = counts_from_runs(results[label]), counts_from_runs(results[base])
    d = paired_difference(a[0], a[1], b[0], b[1])
    acc = {k: float(np.mean([m["test_acc"] for m in results[k]]))
           for k in ("FedAvg", base, label)}
    return {"estimate": d.estimate, "low": d.low, "high": d.high, "mde": d.mde,
            "fedavg": acc["FedAvg"], "matched": acc[base], "ffgg": acc[label]}


def crossover(rows: list[dict]) -> str:
    """The smallest strength whose gap interval lies above 0, or what none does."""
    above = [r["s"] for r in rows if r["low"] > 0]
    if above:
        return f"s = {min(above):g}"
    below = [r["s"] for r in rows if r["high"] < 0]
    at = ", ".join(f"{v:g}" for v in below)
    return "none: no interval lies above 0" + (f" (below 0 at s = {at})" if below else "")


@register("reproduction", "heterogeneity",
          doc="Does joint training beat fine-tuning the same part? A heterogeneity map")
def reproduce_heterogeneity(out_dir: Path, *, quick: bool = False,
                            seeds: list[int] | None = None, data_dir: Path | None = None,
                            progress: bool = True) -> Path:
    """For every knob (HAR sensors / input split, FEMNIST labels / output split) and strength
    s: the three rows through the table driver (``out_dir/KEY/s=S/``), the gap with its
    interval; the least-squares analogue; ``summary.md`` (returned), ``map.json`` and
    ``gap.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    strengths = QUICK_STRENGTHS if quick else STRENGTHS
    record: dict[str, Any] = {"quick": quick, "panels": {}, "seconds": {}}
    for knob in _knobs():
        base, size = _sizes(knob.base, quick, seeds)
        rows, tk = [], time.perf_counter()
        for s in strengths:
            table = Heterogeneous(base, knob.transform, knob.part, s, knob.key)
            table.reproduce(out_dir / knob.key / f"s={s:g}", size=size, data_dir=data_dir,
                            progress=progress, quick=quick)
            res = pio.read_json(out_dir / knob.key / f"s={s:g}" / "results.json")["results"]
            label = f"FFGG ({knob.part})"
            rows.append({"s": s, **_gap(res, label, f"FedAvg + FT ({knob.part})")})
        record["panels"][knob.key] = {"title": knob.title, "part": knob.part, "rows": rows,
                                      "seeds": list(size.seeds), "clients": base.clients,
                                      "size": {"pretrain_rounds": size.pretrain_rounds,
                                               "rounds": size.rounds,
                                               "finetune_epochs": size.finetune_epochs}}
        record["seconds"][knob.key] = time.perf_counter() - tk
    tk = time.perf_counter()
    ls_size = LS_QUICK if quick else LS_FULL
    if seeds:
        ls_size = replace(ls_size, seeds=tuple(seeds))
    ls = least_squares_map(ls_size)
    record["panels"]["least-squares"] = {
        "title": "least squares: personal coefficients spread by s", "part": "w",
        "seeds": list(ls_size.seeds), "clients": "clients",
        "rows": [{"s": s, **_loss_gap(v["ft"], v["ffgg"]), "predicted": v["predicted"],
                  "ffgg": float(v["ffgg"].mean()), "matched": float(v["ft"].mean())}
                 for s, v in ls.items()]}
    record["seconds"]["least-squares"] = time.perf_counter() - tk
    record["total_seconds"] = time.perf_counter() - t0
    pio.write_json(out_dir / "map.json", jsonable(record))
    gap_plot(out_dir / "gap.png", record)
    path = out_dir / "summary.md"
    pio.write_text(path, map_summary(record))
    return path


def gap_plot(path: Path, record: dict) -> Path:
    """One panel per knob: the gap (FFGG − FedAvg + FT, same part) against s with its 95%
    interval as a band, and the zero line (least squares: also the predicted gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = record["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 3.6), squeeze=False)
    for ax, (key, p) in zip(axes[0], panels.items()):
        rows = p["rows"]
        scale = 1 if key == "least-squares" else 100
        s = [r["s"] for r in rows]
        ax.fill_between(s, [scale * r["low"] for r in rows], [scale * r["high"] for r in rows],
                        alpha=0.25, label="95% interval")
        ax.plot(s, [scale * r["estimate"] for r in rows], "o-", label="measured gap")
        if key == "least-squares":
            ax.plot(s, [r["predicted"] for r in rows], "k--", lw=1, label="predicted")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(p["title"], fontsize=8)
        ax.set_xlabel("heterogeneity strength s")
        ax.set_ylabel("test MSE of FedAvg + FT − FFGG" if key == "least-squares"
                      else "FFGG − FedAvg + FT (points)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("joint training vs fine-tuning the same part (above 0: joint training better)",
                 fontsize=9)
    fig.tight_layout()
    pio.savefig(fig, path, dpi=120)
    plt.close(fig)
    return Path(path)


def map_summary(record: dict) -> str:
    """``summary.md`` of the map: per knob, the three rows' accuracies, the gap with its
    interval and verdict per s, and the smallest s where joint training is ahead."""
    quick = record["quick"]
    lines = [f"# heterogeneity: does joint training beat fine-tuning the same part?"
             f"{' (quick)' if quick else ''}", ""]
    if quick:
        lines += [quick_note("two strengths, one seed, the tables' quick sizes"), ""]
    lines += ["For each strength s of a per-client transform that the personal part absorbs "
              "exactly, FFGG (θ trained jointly with the part) against FedAvg + FT (θ by "
              "FedAvg, then the same part fine-tuned per client): the gap FFGG − FedAvg + FT "
              "with its 95% bootstrap interval over clients × seeds (paired: the same draws "
              "for both), and plain FedAvg for scale. Plot: `gap.png`.", ""]
    for key, p in record["panels"].items():
        ls = key == "least-squares"
        lines += [f"## {p['title']}", ""]
        rows = []
        for r in p["rows"]:
            if ls:
                verdict = ("joint training better" if r["low"] > 0 else "fine-tuning better"
                           if r["high"] < 0 else "no detectable difference")
                rows.append([f"{r['s']:g}", f"{r['matched']:.5f}", f"{r['ffgg']:.5f}",
                             f"{r['estimate']:+.5f} [{r['low']:+.5f}, {r['high']:+.5f}]",
                             f"{r['predicted']:+.5f}", "–" if quick else verdict])
            else:
                verdict = ("joint training better" if r["low"] > 0 else "fine-tuning better"
                           if r["high"] < 0 else "no detectable difference at this size")
                rows.append([f"{r['s']:g}", f"{100 * r['fedavg']:.2f}",
                             f"{100 * r['matched']:.2f}", f"{100 * r['ffgg']:.2f}",
                             f"{100 * r['estimate']:+.2f} [{100 * r['low']:+.2f}, "
                             f"{100 * r['high']:+.2f}]", f"{100 * r['mde']:.2f}",
                             "– (quick run)" if quick else verdict])
        if ls:
            header = ["s", "test MSE, FedAvg + FT", "test MSE, FFGG",
                      "gap (FedAvg + FT − FFGG) [95% CI]", "predicted gap", "verdict"]
        else:
            header = ["s", "FedAvg %", f"FedAvg + FT ({p['part']}) %", f"FFGG ({p['part']}) %",
                      "gap, points [95% CI]", "MDE", "verdict"]
        lines += [markdown_table(header, rows), ""]
        where = crossover(p["rows"])
        lines += [f"Smallest s where joint training is ahead (interval above 0): "
                  f"{'not judged (quick run)' if quick else where}. Seeds {p['seeds']}."
                  + (f" Sizes: stage 1 {p['size']['pretrain_rounds']} rounds, stage 2 "
                     f"{p['size']['rounds']} rounds, stage 3 {p['size']['finetune_epochs']} "
                     f"epochs; every {p['clients'][:-1]} trains (none held out)."
                     if "size" in p else ""), ""]
    lines += ["Least squares: limits in closed form (FFGG's θ*, FedAvg's shared-w fit), then "
              "each client's w fitted on its training rows; test MSE on fresh rows of the "
              "same model; predicted gap = the expected test loss difference from the "
              "features' second moments. Intervals: the same paired bootstrap on per-client "
              "test losses.", "",
              "Measured time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in
                                            record["seconds"].items())
              + f"; total {record['total_seconds'] / 60:.1f} min (wall-clock of this "
              "invocation; a resumed map reloads its finished runs).", ""]
    return "\n".join(lines)
