"""An on-disk client store: a federated data set as flat arrays on disk.

Layout of a store folder (all integers little-endian)::

    header.json          format, version, num_classes, description, meta, per-field dtype,
                         per-example shape, rows (and, for the labels and integer inputs
                         wider than a byte, the min / max written), for every file its size
                         in bytes and CRC-32, and the header's own CRC-32 (``header_crc32``)
    train_x.bin ...      one flat C-order array per field (train_x, train_y, test_x, test_y):
                         the examples of client 0, then client 1, ...
    train_offsets.bin    int64 [M + 1]: client m's rows are offsets[m]:offsets[m+1]
    test_offsets.bin
    client_ids.bin       fixed-width UTF-8 bytes [M] (dtype ``S<width>`` in the header)
    meta_<i>.bin         array-valued ``meta`` entries (e.g. the FEMNIST pixel mean / std)
    .verified.json       (optional) remembered CRC checks: :mod:`.verify`

A round reads only its cohort's rows (positional reads of just those rows: :mod:`.reader`), so
memory is O(cohort + model), not O(clients × data).

Integrity: opening validates the header (every file name a plain name inside the folder — no
absolute path, ``..`` or symlink out), each file's size, and each file's CRC-32 — computed once
per file version and remembered (:mod:`.verify`), so re-opening costs a ``stat`` per file. Each
read re-checks labels, integer ranges and finiteness on the rows it reads (:mod:`.reader`).
Every failure is a :class:`StoreError` naming the file.

Writing is atomic and vectorised (:mod:`.writer`): a hidden temporary folder renamed into place
after ``header.json`` is written and fsynced; a failed write removes it, and a killed writer's
leftovers are removed by the next writer into the same destination.

Modules: :mod:`.layout` (format, header validation, confined paths), :mod:`.verify`,
:mod:`.writer` (:class:`StoreWriter`, :func:`write_store`), :mod:`.reader`
(:class:`ClientStore`), :mod:`.view` (:class:`StoreDataset`, :class:`StoreSplit`,
:func:`open_store`). :class:`~partialfl.data.client_state.ClientStateStore` keeps the
per-client state of stateful baselines on disk.
"""

from partialfl.data.store.layout import (
    FIELDS,
    STORE_FORMAT,
    STORE_VERSION,
    StoreError,
    as_numpy,
)
from partialfl.data.store.reader import ClientStore
from partialfl.data.store.view import StoreDataset, StoreSplit, open_store
from partialfl.data.store.writer import StoreWriter, clean_stale, write_store

__all__ = [
    "FIELDS",
    "STORE_FORMAT",
    "STORE_VERSION",
    "ClientStore",
    "StoreDataset",
    "StoreError",
    "StoreSplit",
    "StoreWriter",
    "as_numpy",
    "clean_stale",
    "open_store",
    "write_store",
]
