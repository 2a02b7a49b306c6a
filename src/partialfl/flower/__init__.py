"""partialfl on Flower (``pip install 'partialfl[flower]'``, Flower >= 1.42, Message API).

* :mod:`partialfl.flower.server` — the ServerApp (``partialfl.flower.server:app``): θ, the
  aggregator and the server optimizer; synchronous rounds or asynchronous push/pull
  (FedBuff-style buffer K, K = 1 = the paper's Algorithm 3); failure handling.
* :mod:`partialfl.flower.client` — the ClientApp (``partialfl.flower.client:app``): a
  SuperNode serves the clients of its partition, fine-tunes their personal parameters locally
  and sends only :class:`~partialfl.types.ClientUpdates`.
* :mod:`partialfl.flower.config` — ``flwr run -c key=value`` keys → validated config → the same
  problem/algorithm objects as the in-process simulator (no ``flwr`` import).
* :mod:`partialfl.flower.simulation` — run the app in Flower's simulation engine from Python.
* :mod:`partialfl.flower.project` — the Flower app folder (``pyproject.toml``) and local
  SuperLink/SuperNode processes for deployment on one machine (tests, benchmarks).

Both apps call exactly ``Algorithm.client_update`` / ``Algorithm.server_update``: no algorithm
math is re-implemented here.
"""

import os as _os

# Before any flwr import: no telemetry, no PyPI update check, no run-time `uv sync`
# (see partialfl.flower.env for why); an explicit user setting wins.
for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"),
               ("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")):
    _os.environ.setdefault(_k, _v)

from partialfl.flower.config import ConfigError, FlowerConfig, parse_run_config  # noqa: E402

__all__ = ["ConfigError", "FlowerConfig", "parse_run_config"]
