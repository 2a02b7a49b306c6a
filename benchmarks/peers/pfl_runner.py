"""pfl-research's side of ``benchmarks/peers.py`` (runs in the pfl virtual environment).

The FedAvg round as pfl's examples write it: ``FederatedAveraging`` with a
``SimulatedBackend`` over a ``FederatedDataset`` of the cohort's 10 writers (``minimize_reuse``
sampler: every writer once per round; ``user_id_to_weight`` = examples, pfl's advice for
distributed runs),
``WeightByDatapoints`` (the example-weighted average), a ``PyTorchModel`` with local
``torch.optim.SGD`` (lr, batch 32, one epoch) and central SGD with lr 1 (θ + mean Δ).

FFGG is a ``FederatedAveraging`` whose ``train_one_user`` is FFGG's client
(``common.ffgg_client``) and sends −∇_θ, so the same central step is θ ← θ − mean g.

Started plainly it is pfl's single-process simulation; under ``torchrun --nproc-per-node N``
pfl splits each cohort over the N ranks and sums their statistics with ``torch.distributed``
(gloo). A callback times each central iteration, resets the model to θ⁰ (every round is the
same work) and waits for the next command; rank 0 reads it and broadcasts it to the others.

``--channels-last``: the module converted by hand with ``net.to(memory_format=
torch.channels_last)``, what a pfl user would add to get the layout partialfl's
``memory_format`` option gives (``benchmarks/peers.py``'s ``pfl/*+cl`` modes).

    python benchmarks/peers/pfl_runner.py --cohort FILE [--channels-last]
    torchrun --standalone --nproc-per-node 2 benchmarks/peers/pfl_runner.py --cohort FILE
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohort", required=True)
    ap.add_argument("--weights-out", default=None)
    ap.add_argument("--channels-last", action="store_true",
                    help="convert the module to channels-last by hand")
    args = ap.parse_args()
    common.one_thread()

    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module as get_ops
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.stats import MappedVectorStatistics

    cohort = common.Cohort(args.cohort)
    net = cohort.model()
    if args.channels_last:
        net = net.to(memory_format=torch.channels_last)

    def loss(x, y):  # pfl's PyTorchModel calls module.loss(*batch) and module.metrics
        return F.cross_entropy(net(x), y)

    def metrics(x, y, eval=False):  # noqa: A002 - pfl's signature
        with torch.no_grad():
            s = float(F.cross_entropy(net(x), y, reduction="sum"))
        return {"loss": Weighted(s, len(y))}

    net.loss, net.metrics = loss, metrics
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    datasets = {m: Dataset(raw_data=[cohort.xs[m], cohort.ys[m]], user_id=str(m))
                for m in range(cohort.k)}
    counted = {"examples": 0}

    def make_dataset(uid):
        counted["examples"] += len(datasets[uid])
        return datasets[uid]

    class FFGG(FederatedAveraging):
        """FFGG as a pfl algorithm: the client fine-tunes the output layer and sends −∇_θ as
        its "model difference", so FedAvg's central step (SGD, lr 1, on the weighted mean)
        is θ ← θ − mean g; pfl resets the client's layer to the central model's afterwards."""

        def train_one_user(self, initial_model_state, model, user_dataset, central_context):
            x, y = user_dataset.raw_data
            g = common.ffgg_client(net, x, y, cohort.lr, cohort.batch, cohort.chunk)
            return MappedVectorStatistics({n: -v for n, v in g.items()}), Metrics()

    federated = FederatedDataset(make_dataset, get_user_sampler("minimize_reuse",
                                                                list(range(cohort.k))),
                                 user_id_to_weight=dict(enumerate(cohort.sizes)))
    backend = SimulatedBackend(training_data=federated, val_data=None,
                               postprocessors=[WeightByDatapoints()])
    dist = get_ops().distributed
    rank0 = dist.global_rank == 0
    theta0 = MappedVectorStatistics({n: v.clone() for n, v in cohort.theta0.items()})
    timer = common.RoundTimer(cohort, args.weights_out) if rank0 else None

    def next_command() -> bool:
        """Rank 0 reads the next command and tells every rank: True = run a round."""
        go = torch.tensor([0])
        if rank0:
            go[0] = int(next(cmds, None) is not None)
        if dist.world_size > 1:
            torch.distributed.broadcast(go, 0)
        return bool(go[0])

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            self.go = next_command()
            self.t = common.now()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            dt = common.now() - self.t
            examples = torch.tensor([counted["examples"]])
            if dist.world_size > 1:
                torch.distributed.all_reduce(examples)
            counted["examples"] = 0
            if rank0:
                timer.report(dt, int(examples[0]), model.get_parameters(), ranks=dist.world_size)
            model.set_parameters(theta0)  # the next round starts from θ⁰ again
            go = next_command()
            self.t = common.now()
            return (not go), Metrics()

    cmds = common.commands()
    if rank0:
        common.emit(ready=True, ranks=dist.world_size)
    algorithm = FFGG() if cohort.algorithm == "ffgg" else FederatedAveraging()
    algorithm.run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=10**9,
                                           evaluation_frequency=10**9,
                                           train_cohort_size=cohort.k, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=cohort.lr,
                                              local_num_epochs=1,
                                              local_batch_size=cohort.batch),
        model_eval_params=NNEvalHyperParams(local_batch_size=256),
        callbacks=[Clock()], send_metrics_to_platform=False)


if __name__ == "__main__":
    main()
