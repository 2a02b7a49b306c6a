"""Load byzfl's aggregators and attacks without its package ``__init__`` (which imports
torchvision for its benchmark); ``None`` when byzfl is not installed. Reference only: byzfl is
not a dependency of partialfl."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def load_byzfl():
    """``(aggregators, preaggregators, attacks)`` modules of byzfl, or None."""
    spec = importlib.util.find_spec("byzfl")
    if spec is None or not spec.submodule_search_locations:
        return None
    if "byzfl" not in sys.modules:
        pkg = types.ModuleType("byzfl")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["byzfl"] = pkg
    try:
        agg = importlib.import_module("byzfl.aggregators.aggregators")
        pre = importlib.import_module("byzfl.aggregators.preaggregators")
        att = importlib.import_module("byzfl.attacks.attacks")
    except ImportError:
        return None
    return agg, pre, att
