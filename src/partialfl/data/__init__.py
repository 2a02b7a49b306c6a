"""Federated datasets and their loaders (real formats, read from a configurable folder)."""

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.femnist import load_femnist_npz
from partialfl.data.paths import DataNotFoundError, default_data_dir, resolve_data_file

__all__ = [
    "DataFormatError",
    "DataNotFoundError",
    "FederatedDataset",
    "default_data_dir",
    "load_femnist_npz",
    "resolve_data_file",
]
