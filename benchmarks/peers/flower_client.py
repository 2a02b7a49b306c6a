"""The ClientApp of the Flower runner (``flower_runner.py``): the EMNIST CNN trained for one
epoch with ``torch.optim.SGD`` on writer ``partition-id`` of the cohort file (its examples in
the batch order of the round), sending back its weights and ``num-examples`` (FFGG: its
gradient ∇_θ, ``common.ffgg_client``).

A module of its own so that the Ray actors import it (and keep the cohort and the model
between rounds) instead of receiving a pickled copy.
"""

from __future__ import annotations

import os

import common
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()
_CACHE: dict = {}


def _cohort_and_model():
    if not _CACHE:
        common.one_thread()
        cohort = common.Cohort(os.environ["PEERS_COHORT"])
        _CACHE.update(cohort=cohort, net=cohort.model())
    return _CACHE["cohort"], _CACHE["net"]


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch of SGD on this SuperNode's writer."""
    import torch
    import torch.nn.functional as F

    cohort, net = _cohort_and_model()
    m = int(context.node_config["partition-id"])
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y, b = cohort.xs[m], cohort.ys[m], cohort.batch
    if cohort.algorithm == "ffgg":
        out = common.ffgg_client(net, x, y, cohort.lr, b, cohort.chunk)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=cohort.lr)
        for i in range(0, len(y), b):
            opt.zero_grad()
            F.cross_entropy(net(x[i:i + b]), y[i:i + b]).backward()
            opt.step()
        out = net.state_dict()
    content = RecordDict({"arrays": ArrayRecord(out),
                          "metrics": MetricRecord({"num-examples": len(y)})})
    return Message(content=content, reply_to=msg)
