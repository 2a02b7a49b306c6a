"""Federated datasets and their loaders (real formats, read from a configurable folder)."""

from partialfl.data.paths import DataNotFoundError, default_data_dir, resolve_data_file

__all__ = ["DataNotFoundError", "default_data_dir", "resolve_data_file"]
