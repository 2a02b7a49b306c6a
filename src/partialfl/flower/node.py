"""What a SuperNode's operator decides on the node itself — never a message.

A SuperNode takes its run configuration — the run's spec — from the server's messages (and
``flwr run``'s config, which the server's user chose too), so nothing in it may make the node
run code, lower its privacy floor or read another site's data. What only the node's own
configuration — its ``--node-config`` or the environment its operator started it in —
decides:

* ``partition-id`` / ``num-partitions``: which clients it serves;
* ``allow-imports`` (node config ``allow-imports=true``, or the environment variable
  ``PARTIALFL_NODE_ALLOW_IMPORTS=1``): whether code the spec names — a
  ``package.module:callable`` model (``model.name``) or ``plugins`` — may be imported and run
  here. Off by default: a node builds components by registered name only, and refuses
  (:class:`~partialfl.flower.config.ConfigError`, one line) a spec that names code
  (:func:`check_code`) before anything is built. ``partialfl train --engine
  flower-sim|flower`` turns it on for the SuperNodes it starts itself when the user's own
  spec names code;
* ``eval-min-clients`` (node config): a floor under the run config's ``eval-min-clients`` —
  the node evaluates only when it holds at least the larger of the two. This floor and the
  DP settings below are about the node's clients: a node with any of them refuses a model
  run without its own ``data`` (the spec's ``[data]`` options, the server's, choose and
  number its clients);
* ``data`` (node config): the node's own client store (:mod:`partialfl.data.store`, written
  by ``partialfl flower local``): every training client of the run in order, only this
  node's with examples. The node then reads no other client data (without it, the spec's
  ``[data]`` is read and the node serves its partition by index). A personalize stage's
  ``init-from`` (stage 1's parameters, global: every node and the server hold them) is
  still read from the path the run config names.
* ``dp-noise-key`` (node config, or the environment variable ``PARTIALFL_NODE_DP_NOISE_KEY``):
  the key of the noise local DP adds on this node's clients — an integer, or ``seed`` for the
  run's seed (the run then repeats the in-process one exactly; ``partialfl train --engine
  flower-sim|flower`` sets it for the SuperNodes it starts itself). Unset: each node draws a
  fresh secret key when it builds the run, which nothing sends, so the server cannot
  regenerate the noise and subtract it (local DP then holds against the server too, and the
  run does not repeat bit for bit).
* ``dp-min-noise`` (node config, or ``PARTIALFL_NODE_DP_MIN_NOISE``): the smallest local-DP
  noise multiplier z this node adds to its clients' updates. The run's privacy options come
  from the server, so without it a hostile server can ask for z = 0, central mode or no
  privacy at all; with it the node refuses (one line, a counted failure of the node) every run
  whose clients would send updates with local noise below z — the floor is what makes local
  DP hold against the server.
* ``dp-ledger`` (node config, or ``PARTIALFL_NODE_DP_LEDGER``): a file where the node counts,
  on its own disk, the updates it released per client and the rounds it was asked
  (:mod:`partialfl.flower.ledger`): a round asked again draws fresh noise even when every
  message runs in a new process, as in a real deployment. ``dp-max-releases`` (node config,
  or ``PARTIALFL_NODE_DP_MAX_RELEASES``; needs ``dp-ledger``): the most updates of one client
  the node ever sends — with the floor, what bounds a client's ε whatever the server asks
  (the run config's round budget is the server's to set).

This module does not import ``flwr``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partialfl.build.code import code_refs  # noqa: F401 - re-exported (the node checks)
from partialfl.flower.config import ConfigError, node_partition

#: the environment variable that lets a SuperNode import code named by a run's spec
ALLOW_IMPORTS_ENV = "PARTIALFL_NODE_ALLOW_IMPORTS"
#: the environment variable that sets a SuperNode's local-DP noise key (``dp-noise-key``)
NOISE_KEY_ENV = "PARTIALFL_NODE_DP_NOISE_KEY"
#: the environment variable of a SuperNode's floor under local DP's noise (``dp-min-noise``)
MIN_NOISE_ENV = "PARTIALFL_NODE_DP_MIN_NOISE"
#: the environment variables of a SuperNode's release ledger and cap
LEDGER_ENV, MAX_RELEASES_ENV = "PARTIALFL_NODE_DP_LEDGER", "PARTIALFL_NODE_DP_MAX_RELEASES"


@dataclass(frozen=True)
class NodeOptions:
    """A SuperNode's own settings (see the module docstring)."""

    partition: int
    num_partitions: int
    allow_imports: bool = False
    eval_min_clients: int = 1
    data: str = ""
    noise_key: int | str | None = None  # an integer, "seed" (the run seed) or None (secret)
    min_noise: float | None = None  # the floor under local DP's noise multiplier
    ledger: str = ""  # the file of the node's release ledger ("" none)
    max_releases: int | None = None  # the most updates of one client the node sends

    @property
    def guards_clients(self) -> bool:
        """Whether the operator set a policy about this node's clients (a release ledger, a
        local-DP floor, an evaluation floor above 1): it holds only for the node's own data."""
        return bool(self.ledger) or self.min_noise is not None or self.eval_min_clients > 1

    def release_ledger(self):
        """The node's :class:`~partialfl.flower.ledger.ReleaseLedger`, or None."""
        from partialfl.flower.ledger import ReleaseLedger

        return ReleaseLedger(self.ledger, self.max_releases) if self.ledger else None

    def check_noise(self, algorithm, num_clients: int, z: float | None = None) -> None:
        """Refuse a run whose clients would add less local-DP noise than this node's floor
        (``z``: the multiplier if already computed from ``algorithm``)."""
        if self.min_noise is None:
            return
        from partialfl.flower.dp_policy import local_noise_multiplier

        z = float(local_noise_multiplier(algorithm, num_clients) if z is None else z)
        if not z >= self.min_noise:
            raise ConfigError(
                f"SuperNode refuses the run: its clients would add local-DP noise of multiplier "
                f"{z:g}, below this node's floor dp-min-noise = {self.min_noise:g} (its own "
                "node config: the server's run config cannot lower it)")

    def local_noise_key(self, run_seed: int) -> int:
        """The key of this node's local-DP noise for a run of seed ``run_seed``: the operator's
        integer, the run seed (``seed``), or a fresh secret (drawn per call: a node draws it
        once per run it builds)."""
        import secrets

        if self.noise_key == "seed":
            return int(run_seed)
        if self.noise_key is None:
            return secrets.randbits(63)
        return int(self.noise_key)


def _flag(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: got {v!r}; expected true or false")


#: the keys of a SuperNode's ``--node-config`` (Flower's partition keys, then the node's own)
NODE_KEYS = ("partition-id", "num-partitions", "data", "allow-imports", "eval-min-clients",
             "dp-noise-key", "dp-min-noise", "dp-ledger", "dp-max-releases")


def node_options(node_config: Mapping[str, Any],
                 environ: Mapping[str, str] | None = None) -> NodeOptions:
    """The options of a SuperNode from its ``--node-config`` and environment; an unknown key
    is refused (a misspelt floor, e.g. ``dp_min_noise``, would otherwise be dropped)."""
    from partialfl.config import did_you_mean

    unknown = sorted(set(node_config) - set(NODE_KEYS))
    if unknown:
        raise ConfigError(f"node-config: unknown key {unknown[0]!r}"
                          f"{did_you_mean(unknown[0], NODE_KEYS)}; allowed: "
                          f"{', '.join(NODE_KEYS)}")
    env = os.environ if environ is None else environ
    part, nparts = node_partition(node_config)
    allow = _flag(node_config.get("allow-imports", False), "node-config 'allow-imports'") or \
        _flag(env.get(ALLOW_IMPORTS_ENV, ""), f"environment variable {ALLOW_IMPORTS_ENV}")
    floor = node_config.get("eval-min-clients", 1)
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        raise ConfigError(f"node-config 'eval-min-clients': got {floor!r}; expected an "
                          "integer >= 1")
    data = node_config.get("data", "")
    if not isinstance(data, str):
        raise ConfigError(f"node-config 'data': got {data!r}; expected the path of the node's "
                          "client store")
    key = node_config.get("dp-noise-key", env.get(NOISE_KEY_ENV))
    z = node_config.get("dp-min-noise", env.get(MIN_NOISE_ENV))
    ledger = node_config.get("dp-ledger", env.get(LEDGER_ENV, ""))
    if not isinstance(ledger, str):
        raise ConfigError(f"node-config 'dp-ledger': got {ledger!r}; expected the path of the "
                          "node's release ledger")
    cap = _max_releases(node_config.get("dp-max-releases", env.get(MAX_RELEASES_ENV)))
    if cap is not None and not ledger.strip():
        raise ConfigError("node-config 'dp-max-releases' needs 'dp-ledger' (a file where the "
                          "node counts its releases: a count kept in memory is gone with the "
                          "process, and a deployment runs each message in a new one)")
    return NodeOptions(part, nparts, allow, floor, data.strip(), _noise_key(key),
                       _min_noise(z), ledger.strip(), cap)


def _max_releases(v: Any) -> int | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    text = str(v).strip()
    if isinstance(v, bool) or not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ConfigError(f"node-config 'dp-max-releases' ({MAX_RELEASES_ENV}): got {v!r}; "
                          "expected an integer >= 1 (updates of one client this node sends)")
    return int(text)


def _min_noise(v: Any) -> float | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    try:
        z = float(v) if not isinstance(v, bool) else math.nan
    except ValueError:
        z = math.nan
    if not (math.isfinite(z) and z >= 0):
        raise ConfigError(f"node-config 'dp-min-noise' ({MIN_NOISE_ENV}): got {v!r}; expected "
                          "a finite number >= 0 (the smallest local-DP noise multiplier)")
    return z


def _noise_key(v: Any) -> int | str | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    text = str(v).strip()
    if text == "seed":
        return "seed"
    if not isinstance(v, bool) and text.isascii() and text.isdigit() and int(text) < 2**63:
        return int(text)
    raise ConfigError(f"node-config 'dp-noise-key' ({NOISE_KEY_ENV}): got {v!r}; expected an "
                      "integer in [0, 2^63) or 'seed' (the run's seed)")


def check_code(spec: Mapping[str, Any], opts: NodeOptions) -> None:
    """Refuse a spec that names code unless this node's own configuration allows imports
    (see the module docstring)."""
    refs = code_refs(spec)
    if refs and not opts.allow_imports:
        key, ref = refs[0]
        raise ConfigError(
            f"SuperNode refuses spec {key} = {ref!r}: a SuperNode never imports code named "
            "by a message; its operator may allow it with --node-config 'allow-imports=true' "
            f"or {ALLOW_IMPORTS_ENV}=1")


def load_node_data(path: str):
    """The node's own client store (``data`` in its node config), in memory."""
    from partialfl.data.store import StoreError, open_store

    p = Path(path).expanduser()
    try:
        return open_store(p).to_memory()
    except (StoreError, OSError) as e:
        raise ConfigError(f"node-config 'data': {e}") from None


def check_node_data(data, clients: np.ndarray) -> None:
    """A node store must hold examples for this node's clients only (a store of another
    partition, or the whole data set, is refused)."""
    sizes = np.asarray(data.train_sizes()) + np.asarray(data.test_sizes())
    foreign = np.setdiff1d(np.flatnonzero(sizes > 0), clients)
    if foreign.size:
        raise ConfigError(f"node-config 'data': the store holds examples of clients "
                          f"{foreign[:5].tolist()} outside this node's partition "
                          f"({int(clients[0])}..{int(clients[-1])})")


def screened(rt, updates, theta, cohort):
    """``updates`` as values only (:func:`partialfl.privacy.values_only`: what is checked
    is what is sent) if the in-process privacy screen lets them pass
    (:func:`partialfl.privacy.check_updates` against the run's θ: declared extras, θ-shaped
    finite float rows, allowed float metrics), else a :class:`~partialfl.privacy.PrivacyError`
    whose reason holds no value — raised on the node, so nothing of a refused message
    (not even an error quoting it) reaches the server. ``theta``: the θ the server sent,
    which must have exactly this run's leaves; ``cohort``: the client ids it asked for, which
    the updates must name in that order (ids are no channel: nothing else is sent in them).
    Client-side metrics (the algorithm's ``client_metrics`` that its server step does not
    read) stay on the node, as :func:`partialfl.privacy.server_view` keeps them in process."""
    import dataclasses

    from partialfl.flower.codec import metric_names
    from partialfl.privacy import PrivacyError, check_updates, values_only

    if set(theta) != set(rt.theta_names):
        raise PrivacyError(f"the server's θ has the leaves {sorted(theta)[:8]}, not this run's "
                           f"θ {sorted(rt.theta_names)[:8]}")
    updates = values_only(updates)  # checked as sent
    check_updates(updates, theta, rt.algorithm)
    if not np.array_equal(np.asarray(updates.cohort), np.asarray(cohort)):
        raise PrivacyError("the updates name other client ids than the server asked for")
    sent = metric_names(rt.algorithm)
    return dataclasses.replace(updates, metrics={n: v for n, v in updates.metrics.items()
                                                 if n in sent})


def shared_values(record, algorithm) -> dict[str, int | float]:
    """The numbers of the server state ``algorithm``'s clients read (``shared_extra``) from a
    train message's record (``extra.<name>`` entries, :func:`partialfl.flower.rounds.
    shared_entries`): an int stays an int, a float a float; anything else is refused."""
    out: dict[str, int | float] = {}
    for n in getattr(algorithm, "shared_extra", ()):
        if f"extra.{n}" in record:
            v = record[f"extra.{n}"]
            if type(v) not in (int, float):
                raise ValueError(f"the server sent the shared number {n!r} as a "
                                 f"{type(v).__name__}, not an int or a float")
            out[n] = v
    return out


def refuse_non_finite(partition: int, updates) -> None:
    """Refuse to send ``updates`` with a row that is not finite (a counted failure of the
    node, in counts only): the server would refuse it too, but only after receiving it, and
    a NaN's payload bits pass clipping and noise (local DP) untouched, carrying a client's
    values; SecAgg+ would quantise it into a finite, wrong aggregate."""
    from partialfl.runtime.faults import finite_mask

    ok = finite_mask(updates)
    if not ok.all():
        raise ClientComputationError(
            f"partition {partition}: {int((~ok).sum())} of {len(ok)} client updates are not "
            "finite; the node does not send them")


def _error_kind(t: type) -> str:
    """What the server may learn of an exception type client code raised: decided by identity
    alone (no hash, attribute or name of the type is read; its metaclass runs nothing):
    the privacy screen's and DP budget's refusals, one of Python's built-in exceptions (its
    name as Python spells it), else "an exception"."""
    import builtins

    from partialfl.algorithms.dp import PrivacyBudgetError
    from partialfl.privacy import PrivacyError

    if t is PrivacyError:
        return "the privacy screen refused it"
    if t is PrivacyBudgetError:
        return "PrivacyBudgetError: the node's DP budget refuses this round"
    if t is ConfigError:
        return "ConfigError"
    for name, b in vars(builtins).items():
        if b is t:
            return name
    return "an exception"


class ClientComputationError(RuntimeError):
    """A client computation on this SuperNode failed; its message stayed on the node."""


@contextlib.contextmanager
def kept_on_node(partition: int, what: str, passes: type | None = None) -> Iterator[None]:
    """Run a client computation (``client_update`` and the privacy screen, the deployed
    model's evaluation): an exception's text — written by client code, or quoting what the
    screen refused — goes to this node's log only; the error the server receives says where
    and what kind (the exception's type when it is Python's own or the screen's refusal,
    else "an exception"), never the text. (In process the researcher's own log shows it.)
    ``passes``: an exception of exactly this type (partialfl's own, e.g. ConfigError: what a
    node's configuration lacks, in partialfl's words) leaves as it is."""
    try:
        yield
    except Exception as e:
        if passes is not None and type(e) is passes:
            raise
        try:  # client code chose the exception's type: its metaclass may raise with w's text
            logging.getLogger("partialfl.flower.node").warning(
                "partition %d: %s failed: %s: %s", partition, what, type(e).__name__, e)
        except Exception:  # noqa: BLE001 - nothing of it may leave the node
            pass
        kind = _error_kind(type(e))
        raise ClientComputationError(f"partition {partition}: {what} failed on the node "
                                     f"({kind}); its message stays in the node's log") from None
