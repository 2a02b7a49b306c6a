"""``partialfl data convert``: any supported loader's federation → an on-disk client store.

Each format (a registry entry of kind ``data-format``; here the ``from_*`` functions)
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partialfl.data.federated import FederatedDataset
from partialfl.data.store import write_store
from partialfl.registry import register


@dataclass(frozen=True)
class ConvertContext:
    """What a format's loader reads: the input path, the client cap, the image folder
    (GLDv2) and the loader's keyword options."""

    inp: Path
    max_clients: int | None = None
    images: Path | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


def _text(fed) -> FederatedDataset:
    ds = fed.dataset
    meta = {**ds.meta, "vocab": list(fed.vocab.words), "seq_len": int(fed.seq_len)}
    return FederatedDataset(ds.train_x, ds.train_y, ds.test_x, ds.test_y, ds.client_ids,
                            ds.num_classes, ds.description, meta)


@register("data-format", "femnist-npz")
def from_femnist_npz(_: None, ctx: ConvertContext) -> FederatedDataset:
    """The ``femnist_leaf_subset.npz`` file (FEMNIST by writer)."""
    inp, max_clients, opts = ctx.inp, ctx.max_clients, dict(ctx.options)
    from partialfl.data.femnist import load_femnist_npz

    ds = load_femnist_npz(inp.parent, file_name=inp.name, **opts)
    return ds if max_clients is None else ds.subset(range(min(max_clients, ds.num_clients)))


@register("data-format", "leaf-json")
def from_leaf_json(_: None, ctx: ConvertContext) -> FederatedDataset:
    """A LEAF FEMNIST json folder."""
    inp, max_clients, opts = ctx.inp, ctx.max_clients, dict(ctx.options)
    from partialfl.data.leaf import load_leaf_femnist

    ds = load_leaf_femnist(inp, **opts)
    return ds if max_clients is None else ds.subset(range(min(max_clients, ds.num_clients)))


@register("data-format", "tff-emnist")
def from_tff_emnist(_: None, ctx: ConvertContext) -> FederatedDataset:
    """A folder with TFF's ``fed_emnist_{train,test}.h5``."""
    inp, max_clients, opts = ctx.inp, ctx.max_clients, dict(ctx.options)
    from partialfl.data.tff_emnist import load_tff_emnist_h5

    return load_tff_emnist_h5(inp, max_clients=max_clients, **opts)


@register("data-format", "shakespeare")
def from_shakespeare(_: None, ctx: ConvertContext) -> FederatedDataset:
    """The ``tinyshakespeare_federation.txt`` file (by speaking role)."""
    inp, max_clients, opts = ctx.inp, ctx.max_clients, dict(ctx.options)
    from partialfl.data.shakespeare import load_shakespeare

    return _text(load_shakespeare(path=inp, max_clients=max_clients, **opts))


@register("data-format", "stackoverflow")
def from_stackoverflow(_: None, ctx: ConvertContext) -> FederatedDataset:
    """A folder with TFF's ``stackoverflow_{train,test}.h5``."""
    inp, max_clients, opts = ctx.inp, ctx.max_clients, dict(ctx.options)
    from partialfl.data.stackoverflow import PAPER_NUM_CLIENTS, load_stackoverflow

    return _text(load_stackoverflow(inp, num_clients=max_clients or PAPER_NUM_CLIENTS,
                                    **opts))


@register("data-format", "gldv2")
def from_gldv2(_: None, ctx: ConvertContext) -> FederatedDataset:
    """A GLDv2 split CSV (with ``images`` = the image folder)."""
    inp, max_clients, images, opts = ctx.inp, ctx.max_clients, ctx.images, dict(ctx.options)
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


def convert(fmt: str, inp: str | Path, out: str | Path, *,
            images: str | Path | None = None, max_clients: int | None = None,
            options: dict | None = None, overwrite: bool = False,
            progress: bool = False) -> Path:
    """Load ``inp`` in format ``fmt`` (a registered ``data-format``: one of the ``from_*``
    loaders above) and write a store at ``out``; ``options`` are passed to the loader as
    keyword arguments (e.g. ``seq_len``)."""
    from partialfl.registry import entry

    load = entry("data-format", fmt, "format")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    images = None if images is None else Path(images)
    try:
        ds = load.create(None, ConvertContext(Path(inp), max_clients, images,
                                              dict(options or {})))
    except KeyError as e:  # an explicit client id the input does not hold
        raise ValueError(f"format {fmt!r}: {e.args[0] if e.args else e}") from None
    except (TypeError, OverflowError) as e:
        if "unexpected keyword" in str(e) or "multiple values" in str(e):
            raise ValueError(f"format {fmt!r}: bad loader option ({e})") from None
        if options:  # e.g. --option min_train=abc
            raise ValueError(f"format {fmt!r}: a loader option has a value of the wrong type "
                             f"({e}); options given: {options}") from None
        raise
    with _exit_on_sigterm():
        return write_store(out, ds, overwrite=overwrite, progress=progress)
