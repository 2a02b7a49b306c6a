"""Federated datasets and their loaders (real formats, read from a configurable folder), and
the on-disk client store (:mod:`partialfl.data.store`) for federations larger than memory."""

from partialfl.data.client_state import ClientStateStore
from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.femnist import load_femnist_npz
from partialfl.data.gldv2 import load_gldv2
from partialfl.data.leaf import load_leaf_femnist
from partialfl.data.paths import DataNotFoundError, default_data_dir, resolve_data_file
from partialfl.data.store import (
    ClientStore,
    StoreDataset,
    StoreError,
    StoreWriter,
    open_store,
    write_store,
)
from partialfl.data.tff_emnist import load_tff_emnist_h5

__all__ = [
    "ClientStateStore",
    "ClientStore",
    "DataFormatError",
    "DataNotFoundError",
    "FederatedDataset",
    "default_data_dir",
    "load_femnist_npz",
    "load_gldv2",
    "load_leaf_femnist",
    "load_tff_emnist_h5",
    "open_store",
    "resolve_data_file",
    "StoreDataset",
    "StoreError",
    "StoreWriter",
    "write_store",
]
