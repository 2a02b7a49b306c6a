"""``partialfl data convert``: any supported loader's federation → an on-disk client store.

Each format (by name: :func:`partialfl.build.convert_data`; here the ``from_*`` functions)
reads its real files with the library's loader (same preprocessing as in memory:
FEMNIST normalisation, text vocabularies and sequence encoding, GLDv2 resizing) and writes the
result with :func:`partialfl.data.store.write_store` (atomic). Text formats also record the
vocabulary (``meta["vocab"]``, the regular words in id order) and ``meta["seq_len"]``.

A failed conversion leaves nothing behind: an exception (or ``SIGTERM``, turned into an exit
while converting) removes the temporary folder, and a conversion killed outright
(``kill -9``, power loss) leaves one that the next conversion into the same destination
removes (:func:`partialfl.data.store.clean_stale`).

=================  ==================================================  ===================
format             INPUT                                               loader
=================  ==================================================  ===================
femnist-npz        the ``femnist_leaf_subset.npz`` file                load_femnist_npz
leaf-json          a LEAF FEMNIST json folder                          load_leaf_femnist
tff-emnist         folder with ``fed_emnist_{train,test}.h5``          load_tff_emnist_h5
shakespeare        the ``tinyshakespeare_federation.txt`` file         load_shakespeare
stackoverflow      folder with ``stackoverflow_{train,test}.h5``       load_stackoverflow
gldv2              the split CSV (with ``images`` = the image folder)  load_gldv2
=================  ==================================================  ===================
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from partialfl.data.federated import FederatedDataset
from partialfl.data.store import write_store


def _text(fed) -> FederatedDataset:
    ds = fed.dataset
    meta = {**ds.meta, "vocab": list(fed.vocab.words), "seq_len": int(fed.seq_len)}
    return FederatedDataset(ds.train_x, ds.train_y, ds.test_x, ds.test_y, ds.client_ids,
                            ds.num_classes, ds.description, meta)


def from_femnist_npz(inp: Path, max_clients, images, opts):
    from partialfl.data.femnist import load_femnist_npz

    ds = load_femnist_npz(inp.parent, file_name=inp.name, **opts)
    return ds if max_clients is None else ds.subset(range(min(max_clients, ds.num_clients)))


def from_leaf_json(inp: Path, max_clients, images, opts):
    from partialfl.data.leaf import load_leaf_femnist

    ds = load_leaf_femnist(inp, **opts)
    return ds if max_clients is None else ds.subset(range(min(max_clients, ds.num_clients)))


def from_tff_emnist(inp: Path, max_clients, images, opts):
    from partialfl.data.tff_emnist import load_tff_emnist_h5

    return load_tff_emnist_h5(inp, max_clients=max_clients, **opts)


def from_shakespeare(inp: Path, max_clients, images, opts):
    from partialfl.data.shakespeare import load_shakespeare

    return _text(load_shakespeare(path=inp, max_clients=max_clients, **opts))


def from_stackoverflow(inp: Path, max_clients, images, opts):
    from partialfl.data.stackoverflow import PAPER_NUM_CLIENTS, load_stackoverflow

    return _text(load_stackoverflow(inp, num_clients=max_clients or PAPER_NUM_CLIENTS,
                                    **opts))


def from_gldv2(inp: Path, max_clients, images, opts):
    from partialfl.data.gldv2 import load_gldv2

    if images is None:
        raise ValueError("format 'gldv2' needs the image folder (--images DIR)")
    return load_gldv2(inp, images, max_clients=max_clients, **opts)


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """While converting (main thread only), SIGTERM raises ``SystemExit(143)`` so the writer's
    cleanup runs; the previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def convert(load: Callable[..., FederatedDataset], inp: str | Path, out: str | Path, *,
            fmt: str = "", images: str | Path | None = None, max_clients: int | None = None,
            options: dict | None = None, overwrite: bool = False,
            progress: bool = False) -> Path:
    """Load ``inp`` with ``load`` (one of the ``from_*`` loaders above; by format name:
    :func:`partialfl.build.convert_data`) and write a store at ``out``; ``options`` are passed
    to the loader as keyword arguments (e.g. ``seq_len``)."""
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    images = None if images is None else Path(images)
    try:
        ds = load(Path(inp), max_clients, images, dict(options or {}))
    except (TypeError, OverflowError) as e:
        if "unexpected keyword" in str(e) or "multiple values" in str(e):
            raise ValueError(f"format {fmt!r}: bad loader option ({e})") from None
        if options:  # e.g. --option min_train=abc
            raise ValueError(f"format {fmt!r}: a loader option has a value of the wrong type "
                             f"({e}); options given: {options}") from None
        raise
    with _exit_on_sigterm():
        return write_store(out, ds, overwrite=overwrite, progress=progress)
