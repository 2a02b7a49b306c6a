"""The ServerApp's evaluation: before the first round, every ``eval_every`` rounds of the
stage and after the last, each SuperNode evaluates its own clients at θ (w fine-tuned there,
never sent) and replies with sums and counts over at least
``eval-min-clients`` clients (:data:`partialfl.flower.codec.EVAL_KEYS`), or with nothing when
it holds fewer (counted: ``eval_withheld_nodes`` in the round's record, ``eval_withheld`` in
the summary). The server adds the sums up: least squares → means over the evaluated clients
(``eval_loss``, ``eval_loss_gap``); model problems →
:func:`partialfl.flower.models.summarize_sums` (pooled accuracy and loss). The mean and
percentiles over clients are not computed on Flower: they would need per-client values (or a
fine histogram, or a sum of per-client ratios, of them) to reach the server.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord, RecordDict

from partialfl.flower.codec import WireFormatError, decode_eval, params_to_record
from partialfl.flower.config import FlowerConfig
from partialfl.flower.federation import Federation, Link
from partialfl.flower.report import Failure, FlowerRunReport, log, short
from partialfl.stats import ratio_of_sums
from partialfl.types import Params


def eval_due(cfg: FlowerConfig, round_: int) -> bool:
    """Whether the nodes evaluate at ``round_``: before the first round, every
    ``eval_every`` rounds of the stage and after the last (as in-process)."""
    every = cfg.eval_every
    return round_ in (0, cfg.rounds) or bool(every) and round_ % every == 0


def eval_items(fed: Federation, theta: Params, round_: int, shared=None
               ) -> list[tuple[int, str, RecordDict, int]]:
    """Every node's evaluate message: θ, the round and the ``extra.<name>`` numbers of the
    server state the algorithm's clients read (``shared``, as a train message sends them)."""
    content = RecordDict({"theta": params_to_record(theta),
                          "task": ConfigRecord({"round": int(round_), **(shared or {})})})
    return [(n, "evaluate", content, round_) for n in fed.order]


def eval_reduce(cfg: FlowerConfig, fed: Federation, ids, got, round_: int,
                report: FlowerRunReport) -> dict[str, Any]:
    """Add up the nodes' evaluation sums (each checked by
    :func:`~partialfl.flower.codec.decode_eval`; a refused reply is counted as
    ``eval-invalid``, a withheld one in ``eval_withheld_nodes``) into the round's metrics."""
    pooled: dict[str, list[float]] = {}
    withheld = 0
    kind = "model" if fed.torch else "least-squares"
    for node, mid in zip(fed.order, ids):
        m = got.get(mid)
        part = fed.partition(node)
        if m is None or m.has_error():
            report.failures.append(Failure(
                int(round_), "eval-timeout" if m is None else "eval-error", part,
                [], "no reply" if m is None else short(m.error.reason)))
            continue
        try:
            sums = decode_eval(m.content, kind=kind, min_clients=cfg.eval_min_clients,
                               max_clients=fed.clients_of(node),
                               max_units=fed.nodes[node]["eval-units"])
        except WireFormatError as e:
            report.failures.append(Failure(int(round_), "eval-invalid", part, [], short(str(e))))
            log.warning("partialfl: round %d: evaluation of partition %d refused: %s", round_,
                        part, short(str(e)))
            continue
        if sums is None:
            withheld += 1
            continue
        for k, v in sums.items():
            pooled.setdefault(k, []).append(v)
    report.eval_withheld += withheld
    out: dict[str, Any] = {"eval_withheld_nodes": withheld}
    if not pooled:
        return out
    out["eval_clients"] = int(sum(pooled["clients"]))
    if kind == "model":
        from partialfl.flower.models import summarize_sums

        out.update(summarize_sums(pooled))
        return out
    for k, v in pooled.items():
        if k.endswith(".sum"):
            out["eval_" + k[: -len(".sum")].replace("-", "_")] = ratio_of_sums(
                v, pooled["clients"], floor=1.0)
    return out



def evaluate_now(link: Link, cfg: FlowerConfig, fed: Federation, state, round_: int,
                 report: FlowerRunReport, shared=None, due: bool | None = None
                 ) -> dict[str, Any]:
    """The round's evaluation metrics when due (``due``; None: :func:`eval_due`), else
    ``{}``; ``shared``: see :func:`eval_items`."""
    if not (eval_due(cfg, round_) if due is None else due):
        return {}
    ids, got = link.exchange(eval_items(fed, state.theta, round_, shared), cfg.round_timeout)
    return eval_reduce(cfg, fed, ids, got, round_, report)
