"""Extrapolate the wall-clock time of `partialfl reproduce femnist-table` from a short sample.

For every method of the table it times a few stage-2 rounds, one learning-curve evaluation
and stage 3 (fine-tuning + metrics) on the real data, plus stage-1 FedAvg rounds, and
multiplies by the FULL round counts:

    total ≈ R1·t1 + (Σ_seeds Σ_methods [R2·t2 + E·t_eval + t3 + t_new]) / workers

It also times FedAvg rounds with 1 and 2 torch threads in the same run.

    .venv/bin/python benchmarks/femnist_table_time.py [--rounds 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from partialfl.algorithms.base import RoundContext
from partialfl.build import build_algorithm, split_of
from partialfl.pipeline.evaluation import evaluate_model, finetune_personal, round_evaluator
from partialfl.problems.model import ModelProblem
from partialfl.reproductions.femnist import FEMNIST, FULL, METHODS, femnist_task, load_data
from partialfl.runtime import SequentialBackend, run_rounds
from partialfl.spec import MethodConfig


def _problem(task, method: MethodConfig):
    model = task.model_fn(0)
    split = task.make_split(model, *split_of(method))
    return ModelProblem(split, task.data, vectorize=False)


def _time_rounds(problem, alg, rounds: int) -> tuple[float, object]:
    run_rounds(problem, alg, 1, clients_per_round=10, seed=0, backend=SequentialBackend())
    t = time.perf_counter()
    res = run_rounds(problem, alg, rounds, clients_per_round=10, seed=1,
                     backend=SequentialBackend())
    return (time.perf_counter() - t) / rounds, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    size = FULL
    train, new, _ = load_data(args.data_dir, size.num_writers, size.holdout)
    task = femnist_task(train)
    ft = FEMNIST.stage_configs(size)[2]

    thread_t = {}
    for th in (1, 2, 1, 2):
        torch.set_num_threads(th)
        fedavg = MethodConfig(algorithm="fedavg", split="none")
        p = _problem(task, fedavg)
        cfg = FEMNIST.config(size, fedavg, 0)
        t, _ = _time_rounds(p, build_algorithm(cfg, cfg.pretrain, method=fedavg,
                                               num_clients=p.num_clients), args.rounds)
        thread_t.setdefault(th, []).append(t)
    torch.set_num_threads(1)
    t1, t2 = min(thread_t[1]), min(thread_t[2])
    print(f"stage-1 FedAvg round: 1 thread {t1:.3f} s, 2 threads {t2:.3f} s "
          f"(best of 2 each; 1-thread time / 2-thread time = {t1 / t2:.2f})")

    n_evals = size.rounds // size.eval_every + 1 if size.eval_every else 2
    per_seed = 0.0
    print(f"{'method':24s} {'round s':>8s} {'eval s':>8s} {'stage3 s':>9s} {'per run s':>10s}")
    for label, method in METHODS:
        p = _problem(task, method)
        cfg = FEMNIST.config(size, method, 0)
        alg = build_algorithm(cfg, cfg.personalize, num_clients=p.num_clients)
        t2, res = _time_rounds(p, alg, args.rounds)
        t = time.perf_counter()
        round_evaluator()(alg, res.state, p, res.client_state, RoundContext(0, args.rounds))
        te = time.perf_counter() - t
        t = time.perf_counter()
        allc = np.arange(p.num_clients)
        w0 = p.init_w(allc, "pretrained", 0, -1)
        theta = res.state.theta
        if method.finetune_split is not None:  # FedAvg + FT: a split of the shared model
            p = _problem(task, MethodConfig(algorithm="ffgg", split=method.finetune_split))
            theta, _ = p.split.params()
            w0 = p.init_w(allc, "pretrained", 0, -1)
        w = finetune_personal(p, theta, w0, ft.sgd(), 0)
        evaluate_model(p, theta, w, "test")
        evaluate_model(p, theta, w, "train")
        t3 = (time.perf_counter() - t) * (1 + new.num_clients / p.num_clients)
        run = size.rounds * t2 + n_evals * te + t3
        per_seed += run
        print(f"{label:24s} {t2:8.3f} {te:8.2f} {t3:9.2f} {run:10.1f}")
    stage1 = size.pretrain_rounds * t1 * (1 + 0.05)  # + its 7 evaluations (forward only)
    total = stage1 + len(size.seeds) * per_seed / size.workers
    print(f"stage 1: {stage1:.0f} s; stages 2-3: {len(size.seeds)} seeds x {per_seed:.0f} s "
          f"/ {size.workers} workers")
    print(f"extrapolated full table: {total:.0f} s = {total / 60:.1f} min "
          "(this machine, its current load)")


if __name__ == "__main__":
    main()
