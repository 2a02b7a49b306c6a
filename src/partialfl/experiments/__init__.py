"""Reproductions: configs → runs → JSONL metrics, PNG plots and markdown tables.

Every reproduction is a function ``reproduce(out_dir, *, quick, seeds, data_dir, progress)``,
registered by name (``partialfl reproduce NAME``) in :data:`partialfl.build.REGISTRY`
(kind ``reproduction``).
"""

from __future__ import annotations

from partialfl.build import get_reproduction

__all__ = ["get_reproduction"]
