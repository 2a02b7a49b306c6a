"""Environment for Flower processes started by partialfl.

* ``FLWR_TELEMETRY_ENABLED=0`` — Flower sends anonymous usage events to
  telemetry.flower.ai by default (``flwr.supercore.telemetry``); offline machines would wait
  for each event's timeout and we do not want training runs to phone home.
* ``FLWR_DISABLE_UPDATE_CHECK=1`` — the CLI and SuperLink check PyPI for a newer Flower.
* ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (and ``--disable-runtime-dependency-
  installation`` on the SuperLink) — by default a SuperLink runs ``uv sync`` on the app's
  dependencies before every ServerApp; the environment already has partialfl and the
  machines may be offline, so installing at run time would fail or change the environment.
  SuperNodes only install when started with ``--allow-runtime-dependency-installation``.
* ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` — how often SuperExec looks for new ClientApp /
  ServerApp tasks (Flower's default is 1 s; 0.2 s shortens every deployment round).

The variable names were checked against flwr 1.42 (``flwr/supercore/telemetry.py``,
``flwr/supercore/update_check.py``, ``flwr/common/constant.py``,
``flwr/supercore/superexec/run_superexec.py``).

Paths: the processes partialfl starts run in folders of their own, so the data folder
(``PARTIALFL_DATA_DIR``, or the default one this process found) and every ``PYTHONPATH``
entry are given to them as absolute paths (:func:`absolute_paths`; a relative data folder
used to be looked up from the SuperNode's folder and fail there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path


class FlowerRunError(RuntimeError):
    """A Flower run ended without its result; the first line of the message is the cause
    found in the processes' output (e.g. a SuperNode's data-not-found error)."""

FLOWER_ENV: dict[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",
}


def absolute_paths(env: dict[str, str], cwd: str | Path | None = None) -> dict[str, str]:
    """``env`` with ``PARTIALFL_DATA_DIR`` (set to the default data folder found from
    ``cwd`` when unset, :func:`partialfl.data.paths.default_data_dir`) and every
    ``PYTHONPATH`` entry made absolute against ``cwd`` (default: the working folder)."""
    from partialfl.data.paths import ENV_VAR, default_data_dir

    here = Path(cwd) if cwd is not None else Path.cwd()
    out = dict(env)
    found = default_data_dir() if cwd is None and not out.get(ENV_VAR) else None
    data = out.get(ENV_VAR) or (str(found) if found is not None else "")
    if data:
        out[ENV_VAR] = os.path.normpath(here / Path(data).expanduser())
    if out.get("PYTHONPATH"):
        out["PYTHONPATH"] = os.pathsep.join(os.path.normpath(here / p) if p else str(here)
                                            for p in out["PYTHONPATH"].split(os.pathsep))
    return out


def flower_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: ``os.environ``) with :data:`FLOWER_ENV` and ``extra`` applied and
    its paths absolute (:func:`absolute_paths`)."""
    env = dict(os.environ if base is None else base)
    env.update(FLOWER_ENV)
    env.update(extra)
    return absolute_paths(env)


def apply_flower_env() -> None:
    """Set :data:`FLOWER_ENV` in this process where the user has not set a variable
    explicitly; called when partialfl starts Flower work (a simulation, a train run), never at
    import. flwr reads the telemetry switch once, when ``flwr.supercore.telemetry`` is
    imported: if it already is, its switch follows the environment too."""
    import sys

    for k, v in FLOWER_ENV.items():
        os.environ.setdefault(k, v)
    from partialfl.data.paths import ENV_VAR

    if os.environ.get(ENV_VAR):  # Ray's workers run in folders of their own
        os.environ[ENV_VAR] = absolute_paths(dict(os.environ))[ENV_VAR]
    tel = sys.modules.get("flwr.supercore.telemetry")
    if tel is not None:
        tel.FLWR_TELEMETRY_ENABLED = os.environ["FLWR_TELEMETRY_ENABLED"]


def require_flower(simulation: bool = False) -> None:
    """Raise :class:`~partialfl.flower.config.ConfigError` (one line) unless Flower — and for
    its simulation engine, Ray — is installed, before anything is built or started."""
    import importlib.util

    from partialfl.flower.config import ConfigError

    def missing(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    if missing("flwr"):
        raise ConfigError("the Flower engines need Flower: pip install 'partialfl[flower]' "
                          "(flwr[simulation] >= 1.42)")
    if simulation and missing("ray"):
        raise ConfigError("--engine flower-sim needs Flower's simulation engine (Ray): pip "
                          "install 'partialfl[flower]' (flwr[simulation] >= 1.42)")


def die_with_parent():
    """A ``preexec_fn`` for the processes partialfl starts (SuperLink, SuperNodes, ``flwr
    run``): on Linux they get SIGTERM when the process that started them dies, even by
    ``kill -9`` (``prctl(PR_SET_PDEATHSIG)``), so a killed ``partialfl flower local`` leaves no
    SuperLink, SuperNode or ServerApp running (writing into the run folder a rerun uses).
    None elsewhere (no such call: a kill -9 there can leave them running)."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def exit_with_parent(poll: float = 1.0) -> threading.Thread:
    """In a process a SuperLink started for partialfl's ServerApp (``flwr-serverapp``,
    ``flwr-simulation``): exit (status 1) once that parent is gone. A SuperLink killed while
    a round is in flight otherwise leaves the ServerApp waiting for it for good (Flower's
    retrying pulls), orphaned, until someone kills it by hand."""
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    t = threading.Thread(target=watch, daemon=True, name="partialfl-parent-watch")
    t.start()
    return t


def started_by_superlink() -> bool:
    """Whether this process is a ServerApp process a SuperLink started."""
    return Path(sys.argv[0]).name in ("flwr-serverapp", "flwr-simulation")


def run_echoing(args: list[str], env, cwd, timeout: float, label: str
                 ) -> subprocess.CompletedProcess:
    """``subprocess.run(args)`` that also prints the ServerApp's ``partialfl:`` log lines
    (one per round) to stderr as they arrive, prefixed with ``label``."""
    proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent())
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "partialfl:" in line:
                print(f"[{label}] {line.split('partialfl:', 1)[1].strip()}", file=sys.stderr,
                      flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout)
    except BaseException:  # a timeout or Ctrl-C: the submission stops too
        proc.kill()
        proc.wait()
        raise
    reader.join(10)
    return subprocess.CompletedProcess(args, rc, "".join(lines), "")
