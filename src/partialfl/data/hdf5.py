"""Reading TFF's ``HDF5ClientData`` files safely: the shared part of the h5 loaders.

HDF5 can make a member point outside its file: an *external link* (a group or dataset of another
HDF5 file), a *virtual dataset* (mapped from other files) or a dataset with *external storage*
(raw bytes of any file, e.g. ``/etc/passwd`` read as numbers). A data file received from
someone else must not read the reader's other files, so :func:`member` refuses all three and
returns only objects stored inside the file itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partialfl.data.federated import DataFormatError


def h5py_module(what: str) -> Any:
    """The ``h5py`` module, or an ImportError saying how to install it for ``what``."""
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a declared optional dependency
        raise ImportError(f"reading {what} needs h5py: pip install 'partialfl[data]'") from e
    return h5py


def member(group: Any, name: str, path: Path, where: str) -> Any:
    """``group[name]`` if it is stored in this file (a hard or soft link whose target is in
    this file, not virtual, no external storage); :class:`DataFormatError` naming ``where``
    (e.g. ``examples/u1``) otherwise."""
    import h5py

    link = group.get(name, getlink=True)
    if link is None:
        raise KeyError(name)
    obj = group[name] if isinstance(link, h5py.HardLink | h5py.SoftLink) else None
    if obj is None or obj.file.filename != group.file.filename:  # a soft link can lead
        raise DataFormatError(f"{path}: {where} is a link to another file; only data stored "
                              "in the file is read")  # to an external one: check the target
    if isinstance(obj, h5py.Dataset) and (obj.is_virtual or obj.external):
        raise DataFormatError(f"{path}: {where} takes its data from other files (a virtual "
                              "dataset or external storage); only data stored in the file is read")
    return obj
