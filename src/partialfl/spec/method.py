"""The method of a run: the algorithm, its options and its split."""


from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partialfl.config import ConfigError, check_choice, unknown_key_error
from partialfl.registry import Component, entry, option
from partialfl.spec.base import W_INITS, WEIGHTINGS, _Spec, comp


# ----------------------------------------------------------------------------- method
@dataclass(frozen=True)
class MethodConfig(_Spec):
    """The method and its split. ``algorithm``: a registered algorithm; its own options are
    keys of this table too (validated by the algorithm's entry; in Python:
    ``options={...}``). ``split``: which parameters are personal (model runs; default
    ``output`` for algorithms that need a personal part, ``none`` for those that train one
    shared model; closed-form problems define their own). ``finetune_split``: for an
    algorithm that trains one shared model (FedAvg, Scaffold), the part stage 3 fine-tunes
    per client ("FedAvg + fine-tuning"); None: evaluated as is."""

    __options_of__ = ("algorithm", "algorithm")

    algorithm: str = option("ffgg", "a registered algorithm")
    split: Component | None = comp("split", None, "personal parameters: none, input, output "
                                   "{layers, modules}, adapter {rank, modules}, norm, pattern "
                                   "{personal, global_}")
    w_init: str = option("pretrained", "where personal parameters start: pretrained, zero, "
                         "random")
    weighting: str = option("uniform", "aggregation weights: uniform or examples (the "
                            "clients' example counts; the default mean then weighs them, an "
                            "explicit [aggregation] must be weighted)")
    finetune_split: Component | None = comp("split", None, "the part stage 3 fine-tunes after "
                                            "a shared-model algorithm")
    label: str = option("", "the method's name in tables (default: algorithm-split)")
    options: Any = option(None, "the algorithm's options (TOML: keys of this table)")

    def __post_init__(self) -> None:
        self._components("method")
        e = entry("algorithm", self.algorithm, "method.algorithm")
        object.__setattr__(self, "algorithm", e.name)
        opts = self.options
        if opts is None or isinstance(opts, Mapping):
            own = [f.name for f in dataclasses.fields(e.options)] if e.options else []
            bad = sorted(set(opts or {}) - set(own))
            if bad:
                keys = [f.name for f in dataclasses.fields(self) if f.name != "options"]
                raise unknown_key_error(bad[0], [*keys, *own], "method")
            object.__setattr__(self, "options", e.parse(opts, "method"))
        elif e.options is None or not isinstance(opts, e.options):
            raise ConfigError(f"method.options: expected {e.options} for {e.name!r}, got "
                              f"{type(opts).__name__}")
        check_choice("method.w_init", self.w_init, W_INITS)
        check_choice("method.weighting", self.weighting, WEIGHTINGS)
        kind = e.trait("split", "personal")
        s = self.split.name if self.split is not None else None
        if kind in ("none", "full") and s not in (None, "none"):
            what = ("trains one shared model" if kind == "none"
                    else "keeps a full personal model")
            raise ConfigError(f"method.split: {e.name} {what}; use 'none' (or leave it out), "
                              f"got {s!r}")
        if kind == "personal" and s == "none":
            raise ConfigError(f"method.split: {e.name} needs personal parameters; give a split "
                              "other than 'none'")
        if kind == "preset" and self.split is not None:
            raise ConfigError(f"method.split: {e.name} defines its own split; leave it out")
        if self.finetune_split is not None:
            if kind != "none":
                raise ConfigError(f"method.finetune_split applies to algorithms that train one "
                                  f"shared model (split 'none'), not {e.name!r}")
            if self.finetune_split.name == "none":
                raise ConfigError("method.finetune_split: give the part to fine-tune, not "
                                  "'none'")

    @property
    def entry(self):
        """The algorithm's registry entry."""
        return entry("algorithm", self.algorithm)

    @property
    def split_kind(self) -> str:
        """The split's name (a model run's default when none is given)."""
        if self.split is not None:
            return self.split.name
        kind = self.entry.trait("split", "personal")
        return {"personal": "output", "preset": f"preset:{self.algorithm}"}.get(kind, "none")

    def option(self, key: str, default: Any = None) -> Any:
        """One of the algorithm's options (``default`` if it has no such option)."""
        return getattr(self.options, key, default)

    @property
    def name(self) -> str:
        """The method's label: ``label``, else ``algorithm-split`` (``-stateless``)."""
        if self.label:
            return self.label
        s = self.split_kind
        base = self.algorithm + ("" if s == "none" or s.startswith("preset:") else f"-{s}")
        return base + ("-stateless" if self.option("stateless") else "")


