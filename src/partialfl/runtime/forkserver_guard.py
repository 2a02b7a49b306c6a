"""Imported by multiprocessing's forkserver process only (a preload module, see
:func:`partialfl.runtime.worker.guard_forkserver`): the forkserver asks the kernel for
SIGKILL when the process that started it dies (``PR_SET_PDEATHSIG``). Its children — pool
workers, which ask the same of the forkserver — then die with it at once, even inside a C
call that holds the GIL, where a Python thread watching the parent cannot run (round 28)."""

from __future__ import annotations

import contextlib
import signal
import sys

if sys.platform.startswith("linux"):
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
