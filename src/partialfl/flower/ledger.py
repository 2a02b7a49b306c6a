"""A SuperNode's own record of what it released (node config ``dp-ledger``), on its disk.

A real deployment runs each ClientApp message in a fresh process (Flower's SuperExec starts
one per task), so what a node remembers in memory is gone by the next message: a server could
replay round r at another θ and, under an operator's fixed ``dp-noise-key``, get the same
local-DP noise twice and subtract it; and nothing bounds how many noisy releases of a
client's update a hostile server collects and averages (the run config's round budget is the
server's to set). The ledger is the node's answer, kept in one JSON file its operator names:

* ``releases``: per client id, how many updates of that client this node has sent (each
  train reply, SecAgg+ contributions included, counts once per client in its cohort). With
  ``dp-max-releases`` = R the node refuses a request that would take any client past R —
  so with noise multiplier z (the node's ``dp-min-noise`` floor) a client's update is
  released at most R times through the Gaussian mechanism, whatever the server asks: its ε
  is that of R compositions of a Gaussian mechanism of multiplier z (no subsampling
  amplification: the node cannot check the server's sampling), at any δ the operator picks.
* ``answered``: per (noise key digest, round), how many times that round was asked (a round
  asked again draws fresh noise, :meth:`partialfl.flower.client.NodeRuntime.context`).

Every update is a read-modify-write under an exclusive lock of ``<ledger>.lock``, written
atomically; a release is counted before the update is computed (a failure after it costs
budget, never leaks an uncounted release). This module does not import ``flwr``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from partialfl import io as pio
from partialfl.flower.config import ConfigError

FORMAT = "partialfl-node-ledger-1"
#: the keys of the ledger's tables: client ids; a noise key digest and a round
_KEY = {"releases": re.compile(r"[0-9]{1,19}"),
        "answered": re.compile(r"[0-9a-f]{16}:-?[0-9]{1,19}")}


class ReleaseLedger:
    """The ledger at ``path`` (see the module docstring); ``max_releases``: the most updates
    of one client this node sends (None: counted, not capped)."""

    def __init__(self, path: str | Path, max_releases: int | None = None) -> None:
        self.path, self.max_releases = Path(path), max_releases

    @contextlib.contextmanager
    def _open(self) -> Iterator[dict[str, Any]]:
        """The ledger's contents under an exclusive lock; written back atomically on exit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            book = self._read()
            yield book
            pio.write_json(self.path, book)
        finally:
            os.close(fd)

    def _read(self) -> dict[str, Any]:
        if not self.path.exists() and not self.path.is_symlink():
            return {"format": FORMAT, "releases": {}, "answered": {}}
        try:
            book = json.loads(pio.read_regular(self.path))
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"node-config 'dp-ledger': {self.path} is not readable "
                              f"({type(e).__name__}); the node refuses to release updates "
                              "it cannot count") from None
        ok = (isinstance(book, dict) and book.get("format") == FORMAT
              and all(isinstance(book.get(k), dict) and all(
                  _KEY[k].fullmatch(n) and type(v) is int and v >= 0
                  for n, v in book[k].items()) for k in ("releases", "answered")))
        if not ok:
            raise ConfigError(f"node-config 'dp-ledger': {self.path} is not a partialfl node "
                              "ledger (damaged?); the node refuses to release updates it "
                              "cannot count")
        return book

    def request(self, noise_key: int | None, round_: int, clients: Sequence[int]) -> int:
        """Count a train request of round ``round_`` for ``clients``: refuse (ConfigError,
        nothing counted) if a client would pass ``max_releases``; else count one release per
        client and return how many times this (key, round) was asked before."""
        with self._open() as book:
            rel = book["releases"]
            cap = self.max_releases
            over = [int(c) for c in clients if cap is not None and rel.get(str(int(c)), 0) >= cap]
            if over:
                raise ConfigError(
                    f"SuperNode refuses the request: client(s) {over[:10]} already had "
                    f"{cap} update(s) released, this node's dp-max-releases (its own node "
                    "config: the server cannot raise it)")
            for c in clients:
                rel[str(int(c))] = rel.get(str(int(c)), 0) + 1
            tag = hashlib.sha256(f"{noise_key}".encode()).hexdigest()[:16] + f":{round_}"
            asked = book["answered"].get(tag, 0)
            book["answered"][tag] = asked + 1
        return asked

    def releases(self) -> dict[int, int]:
        """Updates released so far per client id."""
        return {int(c): n for c, n in self._read()["releases"].items()}
