"""Processes seen from /proc (Linux), for the tests that kill workers and their parents."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (state, ppid, …), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat_fields(int(d))
            if f is not None and int(f[1]) == pid:
                out.append(int(d))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    f = _stat_fields(pid)
    return f is not None and f[0] != "Z"
