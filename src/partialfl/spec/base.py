"""What every table of the run spec shares: the names, the component field and the
mixin that reads components given in Python."""


from __future__ import annotations

import dataclasses
import re

from partialfl.registry import Component, component, component_field

#: what a device name may look like (checked against the machine when a run is built)
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?|mps|auto")
DEVICES = ("cpu", "cuda", "cuda:N", "mps", "auto")
PRECISIONS = ("fp32", "bf16", "fp16")
MEMORY_FORMATS = ("contiguous", "channels_last")
#: what a run's name (its output file name) may look like
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
STAGES = ("pretrain", "personalize", "finetune")
W_INITS = ("pretrained", "zero", "random")
WEIGHTINGS = ("uniform", "examples")


comp = component_field  # a spec field naming a component (see the registry)


class _Spec:
    """Mixin: component fields given as a name or a dict (Python) become :class:`Component` s,
    and ``ValueError`` s of ``__post_init__`` checks read as :class:`ConfigError`."""

    def _components(self, where: str) -> None:
        for f in dataclasses.fields(self):
            kind = f.metadata.get("kind")
            v = getattr(self, f.name)
            if kind and v is not None and not (isinstance(v, Component) and v.kind == kind):
                key = f"{where}.{f.name}" if where else f.name
                object.__setattr__(self, f.name, component(kind, v, key,
                                                           f.metadata.get("default_name")))


