"""partialfl's side of ``benchmarks/peers.py``: one round of FedAvg (or FFGG, as the cohort file
says) on the cohort's 10 writers, from θ⁰ every time, with one backend.

The round is what a user's call runs: ``run_rounds(problem, algorithm, 1, backend=...)`` on a
problem holding only the cohort's writers (full participation), i.e. the clients' updates,
the message checks and the server update. Modes: ``sequential``, ``processes`` and
``threads`` (``--workers`` each; one torch thread per worker), ``vmap`` (clients batched);
``MODE+cl``: the same with ``memory_format="channels_last"`` (one client's passes run the
CNN channels-last: same maths, another summation order).

    python benchmarks/peers/partialfl_runner.py --mode threads+cl --workers 2 --cohort FILE
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MODES = ("sequential", "processes", "threads", "vmap", "sequential+cl", "processes+cl",
         "threads+cl")
CHUNK = 256  # examples per forward pass of FFGG's full-data gradient


def build(cohort_ids, lr: float, batch: int, algorithm: str, vectorize: bool,
          memory_format: str = "contiguous"):
    """The problem on the cohort's writers (FEMNIST from PARTIALFL_DATA_DIR), the algorithm
    and θ⁰: the EMNIST CNN seeded 0, as ``benchmarks/nn_speed.py`` builds it."""
    from partialfl.aggregation.basic import Mean
    from partialfl.algorithms.model import FedAvg, model_ffgg
    from partialfl.build import make_model
    from partialfl.data.femnist import load_femnist_npz
    from partialfl.local.sgd import SGDConfig
    from partialfl.problems.model import ModelProblem
    from partialfl.split import make_split

    data = load_femnist_npz(None).subset(cohort_ids)
    split = make_split(make_model("emnist_cnn", 62, seed=0),
                       "none" if algorithm == "fedavg" else "output", seed=0)
    problem = ModelProblem(split, data, vectorize=vectorize, chunk=CHUNK,
                           memory_format=memory_format)
    cfg = SGDConfig(lr=lr, epochs=1, batch_size=batch)
    # the example-weighted mean: weighting="examples" sets the weights, and the default
    # aggregator Mean() would ignore them (weighted=False)
    agg = Mean(weighted=True)
    alg = (FedAvg(cfg, weighting="examples", aggregator=agg) if algorithm == "fedavg"
           else model_ffgg(cfg, weighting="examples", aggregator=agg))
    return problem, alg, problem.init_theta()


def backend(mode: str, workers: int):
    from partialfl.runtime import BatchedBackend, SequentialBackend
    from partialfl.runtime.cohort_pool import ProcessBackend
    from partialfl.runtime.threads import ThreadBackend

    return {"sequential": SequentialBackend, "vmap": BatchedBackend,
            "processes": lambda: ProcessBackend(workers),
            "threads": lambda: ThreadBackend(workers)}[mode]()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cohort", required=True, help="the cohort file written by peers.py")
    ap.add_argument("--weights-out", default=None)
    args = ap.parse_args()
    common.one_thread()
    from partialfl.runtime import run_rounds

    cohort = common.Cohort(args.cohort)
    mode, _, cl = args.mode.partition("+")
    problem, alg, theta0 = build(cohort.writers, cohort.lr, cohort.batch, cohort.algorithm,
                                 mode == "vmap", "channels_last" if cl else "contiguous")
    # the same data and θ⁰ as the cohort file (θ⁰: FFGG's θ, plus its initial w)
    assert [int(n) for n in problem.num_examples(range_(cohort.k))] == cohort.sizes
    assert all(bool((cohort.theta0[n] == {**theta0, **problem.w_pretrained}[n]).all())
               for n in cohort.names), "θ⁰ differs from the cohort file"
    be = backend(mode, args.workers)
    timer = common.RoundTimer(cohort, args.weights_out)
    common.emit(ready=True)
    for _ in common.commands():
        t = common.now()
        res = run_rounds(problem, alg, 1, theta0=theta0, backend=be)
        dt = common.now() - t
        examples = int(problem.num_examples(range_(cohort.k)).sum())
        timer.report(dt, examples, {**problem.w_pretrained, **res.state.theta})
    close = getattr(be, "close", None)
    if close is not None:
        close()


def range_(k: int):
    import numpy as np

    return np.arange(k)


if __name__ == "__main__":
    main()
