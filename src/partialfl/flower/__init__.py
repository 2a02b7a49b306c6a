"""partialfl on Flower (``pip install 'partialfl[flower]'``, Flower >= 1.42, Message API).

* :mod:`partialfl.flower.server` — the ServerApp (``partialfl.flower.server:app``): θ, the
  aggregator and the server optimizer; synchronous rounds (:mod:`~partialfl.flower.rounds`)
  or asynchronous push/pull (:mod:`~partialfl.flower.jobs`: FedBuff-style buffer K, K = 1 =
  the paper's Algorithm 3), the nodes' evaluation (:mod:`~partialfl.flower.evaluate`);
  failure handling (:mod:`~partialfl.flower.report`).
* :mod:`partialfl.flower.codec` — the wire format; every reply a SuperNode sends is checked
  there against what the server sent (a bad reply is a counted failure of its node).
* :mod:`partialfl.flower.client` — the ClientApp (``partialfl.flower.client:app``): a
  SuperNode serves the clients of its partition, fine-tunes their personal parameters locally
  and sends only :class:`~partialfl.types.ClientUpdates`; :mod:`partialfl.flower.node`: what
  only the node's own configuration decides (it never imports code a message names).
* :mod:`partialfl.flower.config` — the run config: Flower's own keys (transport, evaluation
  floor, output, checkpoints, SecAgg+) and the run's whole spec (key ``spec``), validated (no
  ``flwr`` import); :mod:`partialfl.flower.stage` builds the spec's stage through
  :mod:`partialfl.build`, as in-process.
* :mod:`partialfl.flower.train` — ``partialfl run|train --engine flower-sim|flower``.
* :mod:`partialfl.flower.simulation` — run the app in Flower's simulation engine from Python.
* :mod:`partialfl.flower.project` — the Flower app folder (``pyproject.toml``);
  :mod:`partialfl.flower.deployment` — SuperLink/SuperNode processes on this machine (TLS,
  node authentication, per-node data, restarts) or a connection to a deployment;
  :mod:`partialfl.flower.local` — ``partialfl flower local CONFIG --nodes N``;
  :mod:`partialfl.flower.secagg` — SecAgg+ of θ.

Both apps call exactly ``Algorithm.client_update`` / ``Algorithm.server_update``: no algorithm
math is re-implemented here.

Importing this package changes nothing in the process: the Flower environment (no telemetry,
no update check, no run-time ``uv sync``; :mod:`partialfl.flower.env`) is applied when a
simulation or a train run starts, and given to every Flower process partialfl launches.
"""

from partialfl.flower.config import ConfigError, FlowerConfig, parse_run_config

__all__ = ["ConfigError", "FlowerConfig", "parse_run_config"]
