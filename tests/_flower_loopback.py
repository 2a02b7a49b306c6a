"""A Flower federation in one process, without Ray or a SuperLink: :class:`LoopbackGrid`
implements the Grid calls the ServerApp uses (``get_node_ids``, ``push_messages``,
``pull_messages``) by handing every message to the real ClientApp of its SuperNode (with that
node's own ``node_config``) and keeping the reply. ``tamper(partition, message_type,
content)`` may rewrite a reply's content before the server pulls it — a hostile SuperNode.
Runs a least-squares ServerApp end to end in well under a second.

Test-only: messages need Flower's task identity (set by the ``loopback`` fixture) and a
message id, which a real Grid assigns on push; both use flwr internals (flwr 1.42).
"""

from __future__ import annotations

import uuid

import pytest


class LoopbackGrid:
    def __init__(self, num_nodes: int = 2, *, tamper=None, node_config=None, client_app=None):
        from flwr.app import Context, RecordDict

        from partialfl.flower.client import app

        self.app = client_app or app
        self.tamper = tamper
        self.replies: dict[str, object] = {}
        self.sent: list = []
        self.contexts = {}
        for i in range(num_nodes):
            cfg = {"partition-id": i, "num-partitions": num_nodes, **(node_config or {})}
            self.contexts[1000 + i] = Context(1, 1000 + i, cfg, RecordDict(), {})

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        from flwr.app import Error, Message

        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            self.sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.app(msg, ctx)
            except Exception as e:  # noqa: BLE001 - what a SuperNode reports as an error
                reply = Message(Error(0, f"{type(e).__name__}: {e}"), reply_to=msg)
            else:
                if self.tamper is not None and not reply.has_error():
                    self.tamper(int(ctx.node_config["partition-id"]),
                                msg.metadata.message_type, reply.content)
            self.replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


@pytest.fixture
def loopback(monkeypatch):
    """:class:`LoopbackGrid` with Flower's task identity set for this test."""
    pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    return LoopbackGrid
