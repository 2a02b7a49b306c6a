"""Arrays between the worker processes and their parent through reused shared-memory slots.

Why: torch's own multiprocessing reductions move every tensor in a message through a shared
memory segment of its own — created, its file descriptor handed over by a helper thread,
mapped and unmapped on the other side, per tensor and per message. For a client's result (a
few θ-shaped tensors) that costs about 2 ms per client, twenty times the cost of handing the
client out; pickling numpy arrays through the pipe costs a copy into and out of the kernel.

Here each direction of each worker has :data:`SLOTS` slots: byte buffers in shared memory
allocated once (and grown when a message needs more), handed over once. A message is packed
by :class:`SlotWriter`: its array leaves — torch CPU tensors, and numpy arrays of at least
:data:`MIN_NUMPY_BYTES` — are copied into the next slot (64-byte aligned, each in its own
layout: contiguous, or the dense strides a ``clone`` would keep), the rest is pickled with a
placeholder per array (``persistent_id``). :class:`SlotReader` unpickles it, copying each
array out of the slot, so the receiver owns what it gets and the slot can be reused. Values,
dtypes, shapes and strides are unchanged, so results are bit for bit those sent.

Reuse is safe when the sender never has more than :data:`SLOTS` messages in flight that the
receiver has not unpacked yet: message j goes to slot ``j mod SLOTS``, and a sender that
holds at most SLOTS unfinished tasks per worker (the pool enforces it) only writes message
j + SLOTS after message j was unpacked (see :class:`partialfl.runtime.pool.WorkerPool`).
Without torch loaded (numpy-only problems) everything is pickled as is.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import numpy as np

#: slots per direction and worker: the most messages one side may have in flight
SLOTS = 2
#: numpy arrays below this size are pickled inline (cheaper than a slot for tiny arrays)
MIN_NUMPY_BYTES = 1024
_ALIGN = 64


def _torch():
    return sys.modules.get("torch")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _slot_tensor(t, torch) -> bool:
    """Whether tensor ``t`` travels in a slot: a plain strided CPU tensor without autograd
    history (anything else is pickled as torch pickles it)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and not t.requires_grad and not t.is_quantized)


def _clone_strides(t) -> tuple[int, ...]:
    """The strides ``t.clone()`` would have: ``t``'s if its elements fill a block without gaps
    or overlap, else dense ones (what ``torch.empty_like`` keeps)."""
    return tuple(t.stride()) if t.is_contiguous() else tuple(_torch().empty_like(t).stride())


class _Packer(pickle.Pickler):
    def __init__(self, buf, torch) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.torch, self.leaves, self.size = torch, [], 0

    def persistent_id(self, obj) -> tuple | None:
        torch = self.torch
        if type(obj) is np.ndarray:
            if obj.dtype.hasobject or obj.nbytes < MIN_NUMPY_BYTES:
                return None
            order = "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
            pid = ("np", self.size, obj.dtype, obj.shape, order)
            nbytes = obj.nbytes
        elif torch is not None and isinstance(obj, torch.Tensor) and _slot_tensor(obj, torch):
            stride = _clone_strides(obj)
            pid = ("pt", self.size, obj.dtype, tuple(obj.shape), stride)
            nbytes = obj.numel() * obj.element_size()
        else:
            return None
        self.leaves.append((pid, obj))
        self.size = _aligned(self.size + nbytes)
        return pid


def _view(slot, pid):
    """The array ``pid`` describes, as a view of ``slot`` (a uint8 tensor)."""
    kind, off, dtype, shape, layout = pid
    if kind == "np":
        return np.ndarray(shape, dtype=dtype, buffer=slot.numpy(), offset=off, order=layout)
    # the slot's size and every offset are multiples of 64 bytes, hence of any item size
    return slot.view(dtype).as_strided(shape, layout, off // dtype.itemsize)


class SlotWriter:
    """One side's sending half (see the module docstring): :meth:`pack` a message."""

    def __init__(self) -> None:
        self.slots: list = [None] * SLOTS
        self.count = 0

    def pack(self, obj) -> tuple[bytes, int, Any]:
        """``(pickle, slot, new slot buffer or None)``: the message to hand to a
        :class:`SlotReader` (the new buffer travels with torch's reductions, once)."""
        torch = _torch()
        buf = io.BytesIO()
        p = _Packer(buf, torch)
        p.dump(obj)
        s = self.count % SLOTS
        self.count += 1
        new = None
        if p.leaves:
            slot = self.slots[s]
            if slot is None or slot.numel() < p.size:
                size = max(p.size, 0 if slot is None else 2 * slot.numel())
                slot = self.slots[s] = new = torch.empty(size, dtype=torch.uint8).share_memory_()
            for pid, obj_ in p.leaves:
                dst = _view(slot, pid)
                if pid[0] == "np":
                    np.copyto(dst, obj_)
                else:
                    dst.copy_(obj_)
        return buf.getvalue(), s, new


class _Unpacker(pickle.Unpickler):
    def __init__(self, buf, slot) -> None:
        super().__init__(buf)
        self.slot = slot

    def persistent_load(self, pid):
        src = _view(self.slot, pid)
        if pid[0] == "np":
            return src.copy(order="K")
        torch = _torch()
        out = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype)
        return out.copy_(src)


class SlotReader:
    """One side's receiving half: :meth:`unpack` what the matching :class:`SlotWriter`
    packed, in the order it packed it."""

    def __init__(self) -> None:
        self.slots: list = [None] * SLOTS

    def unpack(self, msg: tuple[bytes, int, Any]):
        """The object packed into ``msg``; its arrays copied out of the slot."""
        payload, s, new = msg
        if new is not None:
            self.slots[s] = new
        return _Unpacker(io.BytesIO(payload), self.slots[s]).load()
