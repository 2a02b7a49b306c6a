"""The ServerApp's view of the federation: the message link to the SuperNodes, which
SuperNode holds which clients (from their checked ``query.describe`` replies), and the problem
as a server without data sees it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from partialfl.flower.codec import WireFormatError, decode_describe, decode_theta0
from partialfl.flower.config import ConfigError, FlowerConfig
from partialfl.flower.report import Failure, last_line, log, short
from partialfl.types import Params

MessageHook = Callable[[Message], None]


class MessageAudit:
    """Write every message the ServerApp receives, as Flower serialises it (the message and
    every nested record and array: what travelled), to ``folder/NNNNNN-TYPE-NODE.bin``
    (run-config ``audit-dir``)."""

    def __init__(self, folder: str) -> None:
        from pathlib import Path

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.count = len(list(self.folder.glob("*.bin")))

    def __call__(self, m: Message) -> None:
        from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

        from partialfl import io as pio

        blob = b"".join(o.deflate() for o in get_all_nested_objects(m).values())
        # the type is the node's to set (unchecked, unbounded): ASCII, 40 characters at most
        kind = "".join(c if c.isascii() and c.isalnum() else "_"
                       for c in str(m.metadata.message_type)[:40])
        pio.write_bytes(self.folder / f"{self.count:06d}-{kind}-{m.metadata.src_node_id}.bin",
                        blob)
        self.count += 1


class Link:
    """push/pull with our own polling (``send_and_receive`` of the deployment Grid sleeps 3 s
    between pulls); every received message goes through ``hook`` first."""

    def __init__(self, grid: Grid, cfg: FlowerConfig, hook: MessageHook | None) -> None:
        self.grid, self.cfg, self.hook = grid, cfg, hook
        if cfg.audit_dir:
            tap = MessageAudit(cfg.audit_dir)
            self.hook = tap if hook is None else (lambda m: (tap(m), hook(m)))
        self.ttl = max(cfg.round_timeout, cfg.node_wait_timeout) + 60.0
        # The server's validated config travels with every message, so all SuperNodes run
        # exactly the server's configuration (and simulation needs no app folder).
        self.run_config = ConfigRecord(cfg.to_run_config())

    def push(self, items: list[tuple[int, str, RecordDict, int]]) -> list[str]:
        msgs = []
        for node, mtype, content, group in items:
            content["run-config"] = self.run_config
            msgs.append(Message(content, node, mtype, ttl=self.ttl, group_id=str(group)))
        ids = [str(i) if i is not None else "" for i in self.grid.push_messages(msgs)]
        return ids

    def pull(self, ids) -> dict[str, Message]:
        if not ids:
            return {}
        out = {}
        for m in self.grid.pull_messages(list(ids)):
            if self.hook is not None:
                self.hook(m)
            out[m.metadata.reply_to_message_id] = m
        return out

    def exchange(self, items, timeout: float) -> tuple[list[str], dict[str, Message]]:
        """Push ``items`` and pull until every reply arrived or ``timeout`` seconds passed."""
        ids = self.push(items)
        pending = {i for i in ids if i}
        got: dict[str, Message] = {}
        deadline = time.monotonic() + timeout
        while pending:
            new = self.pull(pending)
            got.update(new)
            pending -= set(new)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.cfg.poll_interval)
        return ids, got


@dataclass
class Federation:
    nodes: dict[int, dict[str, Any]]  # node id -> describe info (checked)
    order: list[int]  # node ids by partition
    owner: np.ndarray  # client id -> position in `order` (node ids exceed int64)
    num_clients: int
    theta0: Params
    torch: bool
    examples: np.ndarray  # client id -> its number of training examples (from the nodes)
    failures: list[Failure] = field(default_factory=list)  # describe replies refused

    def partition(self, node: int) -> int:
        return int(self.nodes[node]["partition-id"])

    def clients_of(self, node: int) -> int:
        """How many clients ``node`` holds (from its description)."""
        return len(self.nodes[node]["clients"])

    def max_weights(self, clients) -> np.ndarray:
        """The largest aggregation weight each client may send: ``max(1, n_m)``, n_m the
        example count its node declared."""
        return np.maximum(1.0, self.examples[np.asarray(clients, dtype=np.int64)])


def wait_for_nodes(grid: Grid, cfg: FlowerConfig) -> list[int]:
    deadline = time.monotonic() + cfg.node_wait_timeout
    while True:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= cfg.min_nodes:
            return nodes
        if time.monotonic() >= deadline:
            raise TimeoutError(f"only {len(nodes)} SuperNode(s) connected after "
                               f"{cfg.node_wait_timeout}s; min-nodes = {cfg.min_nodes}")
        time.sleep(min(0.5, cfg.poll_interval * 5))


def _federation_key(info: dict[str, Any]) -> tuple[int, int, int]:
    """What every SuperNode of one federation describes alike: (num-partitions,
    num-clients, torch)."""
    return (info["num-partitions"], info["num-clients"], info["torch"])


def _kind(key: tuple[int, int, int]) -> str:
    return f"{key[1]} clients, {'a model' if key[2] else 'closed-form'}"


def _settled(nodes: dict[int, dict[str, Any]], seen: dict[tuple, int],
             failures: list[Failure], expect: tuple[int | None, int | None],
             final: bool, waiting: bool = False) -> bool:
    """Whether the described nodes are one federation holding every partition; nodes of
    another federation are then left out (a ``describe-invalid`` failure each).

    Descriptions may disagree (:func:`_federation_key`): a stranger, a misconfigured or a
    hostile node. The run's federation is the complete group that fits the server's spec
    (``expect`` = (number of clients, torch), None where the spec does not say) with the
    most nodes; while a fitting group that is not complete could still grow beyond it, the
    server waits (``final``: ``node-wait-timeout`` passed). So one node cannot stop the
    ServerApp nor take the run over by describing a federation of its own, whenever it
    connects; a tie, or no complete group at the deadline, is a misconfigured federation —
    one :class:`ConfigError` naming each node. Nothing is settled while a connected node's
    description is awaited (``waiting``, before the deadline), nor on one group that does
    not fit the spec before the deadline: a node answering first never takes the run."""
    if waiting and not final:
        return False
    keys = {_federation_key(i) for i in nodes.values()}
    complete = {k for k in keys if all((k, p) in seen for p in range(k[0]))}
    fits = {k for k in keys if all(e is None or e == g for e, g in zip(expect, k[1:]))}
    if len(keys) < 2:  # one group: the run's if it fits the spec (or the wait is over)
        return bool(complete & fits) or (final and bool(complete))
    size = {k: sum(_federation_key(i) == k for i in nodes.values()) for k in keys}
    best = sorted(fits & complete, key=lambda k: -size[k])
    growing = [k for k in fits - complete if not best or k[0] > size[best[0]]]
    if growing and not final:
        return False
    if not best or (len(best) > 1 and size[best[0]] == size[best[1]]):
        if not final:
            return False
        each = "; ".join(f"node {n}: partition {i['partition-id']} of {i['num-partitions']}, "
                         f"{_kind(_federation_key(i))}"
                         for n, i in sorted(nodes.items(), key=lambda t: int(t[0])))
        raise ConfigError("SuperNodes disagree on num-partitions, the number of clients "
                          "or the kind of problem (start them with the same node config "
                          f"and run config): {each[:1500]}")
    ours = best[0]
    for n in [n for n, i in nodes.items() if _federation_key(i) != ours]:
        info = nodes.pop(n)
        key = (_federation_key(info), info["partition-id"])
        if seen.get(key) == n:
            del seen[key]
        why = (f"SuperNode {n} describes partition {info['partition-id']} of "
               f"{info['num-partitions']}, {_kind(key[0])}; the run's federation is the "
               f"{size[ours]} nodes holding all {ours[0]} partitions of {_kind(ours)}")
        log.warning("%s: it is left out", why)
        failures.append(Failure(-1, "describe-invalid", -1, [], why))
    return True


def _forget_departed(listed: set[int], nodes: dict[int, dict[str, Any]],
                     seen: dict[tuple, int], spares: dict[tuple, list[int]],
                     infos_of: dict[int, dict[str, Any]], asked: set[int]) -> None:
    """Before the federation is settled: a described node no longer listed (offline) gives
    its partition back, to a listed node that described it too, else to the next one that
    does (a SuperNode restarting without authentication gets a new id); listed again under
    its id, it is asked again."""
    for n in [n for n in nodes if n not in listed]:
        asked.discard(n)
        info = nodes.pop(n)
        slot = (_federation_key(info), info["partition-id"])
        if seen.get(slot) == n:
            del seen[slot]
            log.warning("SuperNode %s left before the run started; partition %d is open "
                        "again", n, info["partition-id"])
            alive = [m for m in spares.get(slot, []) if m in listed]
            if alive:
                spares[slot].remove(alive[0])
                seen[slot], nodes[alive[0]] = alive[0], infos_of[alive[0]]


def describe(link: Link, cfg: FlowerConfig, node_ids: list[int],
             expect: tuple[int | None, int | None] = (None, None)) -> Federation:
    """Ask every SuperNode which clients it holds (partition 0 also sends θ⁰); SuperNodes
    that connect later are asked too, until every partition has one or ``node-wait-timeout``
    passed. The queries are answered as they come: a node that does not answer (within
    ``max(round-timeout, node-wait-timeout)``: ClientApps may start slowly) never keeps the
    server from asking the others. A node that leaves before the federation is settled gives
    its partition back (to a node that described it too, or to the next one that does). A
    description the codec refuses (:func:`~partialfl.flower.codec.decode_describe`), or one
    of another federation than the run's (:func:`_settled`; ``expect``: the number of
    clients and the kind of problem the server's spec fixes, None where it does not), leaves
    its node out (a ``describe-invalid`` failure)."""
    request = RecordDict({"request": ConfigRecord({"init-partition": 0})})
    deadline = time.monotonic() + cfg.node_wait_timeout
    wait = max(cfg.round_timeout, cfg.node_wait_timeout)  # for one node's answer
    nodes: dict[int, dict[str, Any]] = {}
    seen: dict[tuple, int] = {}  # (federation key, partition) -> node
    spares: dict[tuple, list[int]] = {}  # (federation key, partition) -> other nodes with it
    infos_of: dict[int, dict[str, Any]] = {}  # every node's accepted description
    asked: set[int] = set()
    pending: dict[str, tuple[int, float]] = {}  # message id -> (node, until)
    failures: list[Failure] = []
    theta0s: dict[tuple, Params] = {}  # federation key -> θ⁰ its partition 0 sent
    last = ""  # the last refusal, for the error when no node is left
    raised: set[int] = set()  # nodes whose ClientApp raised (a node's own error: no retry)
    relist = 0.0  # when to list the registered nodes again
    while True:  # (nodes listed after the deadline are not asked: it ends discovery)
        new = [n for n in node_ids if n not in asked] if time.monotonic() < deadline else []
        asked.update(new)
        now = time.monotonic()
        for node, mid in zip(new, link.push([(n, "query.describe", request, -1)
                                              for n in new]) if new else ()):
            if mid:
                pending[mid] = (node, now + wait)
            else:
                last = "the describe query could not be delivered"
        got = link.pull(set(pending))
        now = time.monotonic()
        for mid in [m for m, (_, until) in pending.items() if m in got or until <= now]:
            node, _ = pending.pop(mid)
            m = got.get(mid)
            if m is None or m.has_error():
                reason = "no reply" if m is None else short(m.error.reason)
                log.warning("SuperNode %s did not describe itself (%s); it is left out", node,
                            reason)
                last = (last_line(m.error.reason) if m is not None else reason) or last
                if m is not None:
                    raised.add(node)
                continue
            try:
                info = decode_describe(m.content)
                p, key = info["partition-id"], _federation_key(info)
                if p == 0 and key not in theta0s:
                    if "theta0" not in m.content:
                        raise WireFormatError("partition 0 did not send the initial model")
                    theta0s[key] = decode_theta0(m.content["theta0"], bool(info["torch"]))
            except WireFormatError as e:
                log.warning("SuperNode %s sent an invalid description (%s); it is left out",
                            node, short(str(e)))
                failures.append(Failure(-1, "describe-invalid", -1, [], short(str(e))))
                last = str(e)
                continue
            infos_of[node] = info
            if (key, p) in seen:
                log.warning("SuperNodes %s and %s both hold partition %d; using %s",
                            seen[key, p], node, p, seen[key, p])
                spares.setdefault((key, p), []).append(node)
                continue
            seen[key, p], nodes[node] = node, info
        final = now >= deadline and not pending
        # a node asked but not answered yet may be of the run's federation: wait for it (at
        # most node-wait-timeout), so that a stranger answering first never takes the run
        if _settled(nodes, seen, failures, expect, final, bool(pending) and now < deadline):
            break
        if final:  # (a node's num-partitions is its own word: nothing here is sized by it)
            why = f" (last refusal: {last[:300]})" if last else ""
            if not nodes:
                raise RuntimeError(f"no SuperNode answered the describe query{why}")
            n = max(i["num-partitions"] for i in nodes.values())
            hs = {p for _, p in seen if p < n}
            held = sorted(hs)
            gaps = list(itertools.islice((p for p in range(n) if p not in hs), 20))
            more = ", ..." if n - len(held) > len(gaps) else ""
            raise RuntimeError(
                f"no SuperNode holds {n - len(held)} partition(s) ({str(gaps)[1:-1]}{more}) "
                f"after {cfg.node_wait_timeout}s; partitions present: {str(held[:20])[1:-1]}"
                f"{', ...' if len(held) > 20 else ''}{why}")
        time.sleep(cfg.poll_interval if pending else min(1.0, 20 * cfg.poll_interval))
        if time.monotonic() >= relist or not pending:
            relist = time.monotonic() + min(1.0, 20 * cfg.poll_interval)
            node_ids = sorted(int(n) for n in link.grid.get_node_ids())
            _forget_departed(set(node_ids), nodes, seen, spares, infos_of, asked)
            # every node listed now (listed again after the last answer) raised, e.g. its data
            # not found: waiting cannot help. A node that raised while others were still
            # connecting never stops them from being asked (they are listed by then).
            if not nodes and not pending and node_ids and set(node_ids) <= raised and \
                    len(raised) >= cfg.min_nodes:
                raise RuntimeError("no SuperNode answered the describe query (last refusal: "
                                   f"{last[:300]})")
    infos = list(nodes.values())
    theta0 = theta0s.get(_federation_key(infos[0]))
    order = sorted(nodes, key=lambda n: int(nodes[n]["partition-id"]))
    M = int(infos[0]["num-clients"])
    owner = np.full(M, -1, dtype=np.int64)  # client id -> position in `order`
    examples = np.zeros(M)
    for pos, node in enumerate(order):
        ids = np.asarray(nodes[node]["clients"], dtype=np.int64)
        owner[ids] = pos
        examples[ids] = np.asarray(nodes[node]["num-examples"], dtype=np.float64)
    if theta0 is None:
        raise RuntimeError("the SuperNode of partition 0 did not send the initial model")
    return Federation(nodes, order, owner, M, theta0, bool(int(nodes[order[0]]["torch"])),
                      examples, failures)


class ServerProblem:
    """What the server knows of the problem when it holds no data: the number of clients,
    their example counts (from the SuperNodes' descriptions) and the names and shapes of θ.
    Personal parameter names never reach the server: ``w_names`` and ``state_names`` are
    empty here (an algorithm that shares w refuses a personal split on the clients)."""

    w_names: tuple[str, ...] = ()
    state_names: tuple[str, ...] = ()

    def __init__(self, num_clients: int, examples: np.ndarray, theta0: Params) -> None:
        self.num_clients = num_clients
        self._examples = np.asarray(examples, dtype=np.float64)
        self.theta_names = tuple(theta0)
        self.theta_shapes = {n: tuple(np.shape(v)) for n, v in theta0.items()}

    def num_examples(self, cohort) -> np.ndarray:
        """The example counts the SuperNodes reported for ``cohort``."""
        return self._examples[np.asarray(cohort, dtype=np.int64)]
