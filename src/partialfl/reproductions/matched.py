"""Matched baselines: for a row that trains a personal part jointly with θ (FFGG, Local FFGG,
FedAlt, FedSim — algorithms whose ``split`` trait is ``personal``), "FedAvg + FT (part)":
FedAvg's θ, then the *same* part fine-tuned per client in stage 3 (its split, options
included; adapters are inserted zero-initialised into FedAvg's model, then fine-tuned). Both
rows end with the same architecture and the same personal parameters; only how θ was trained
differs, so their difference measures joint training against fine-tuning the same part.
"""

from __future__ import annotations

from collections.abc import Sequence

from partialfl.spec import MethodConfig


def matched_method(method: MethodConfig) -> MethodConfig | None:
    """The matched baseline of a row that trains a personal part jointly with θ (its
    algorithm's ``split`` trait is ``personal``): FedAvg, then fine-tuning of that same part
    (its split, options included) in stage 3; None for any other row."""
    if method.entry.trait("split", "personal") != "personal" or method.split is None:
        return None
    part = part_name(method).replace(", ", "-").replace("=", "")
    return MethodConfig(algorithm="fedavg", split="none", finetune_split=method.split,
                        label=f"fedavg-ft-{part}")


def matched_label(method: MethodConfig) -> str:
    """The row label of :func:`matched_method`: "FedAvg + FT (part)"."""
    return f"FedAvg + FT ({part_name(method)})"


def part_name(method: MethodConfig) -> str:
    """The personal part of a row: its split's name, with the options that differ from the
    split's defaults (``adapter, rank=4``)."""
    from partialfl.registry import component

    c = method.split
    default = component("split", c.name).to_dict()
    extra = [f"{k}={v}" for k, v in c.to_dict().items() if k != "name" and default.get(k) != v]
    return ", ".join([c.name, *extra])


def with_matched(rows: Sequence[tuple[str, MethodConfig]]
                 ) -> tuple[tuple[str, MethodConfig], ...]:
    """``rows`` with a "FedAvg + FT (part)" row (:func:`matched_method`) per distinct part
    of its jointly personalized rows, inserted after the "FedAvg" row (else first)."""
    extra: dict[str, MethodConfig] = {}
    for _, method in rows:
        m = matched_method(method)
        if m is not None:
            extra.setdefault(matched_label(method), m)
    own = [r for r in rows if r[0] not in extra]
    at = next((i + 1 for i, (label, _) in enumerate(own) if label == "FedAvg"), 0)
    return tuple(own[:at]) + tuple(extra.items()) + tuple(own[at:])


__all__ = ["matched_label", "matched_method", "part_name", "with_matched"]
