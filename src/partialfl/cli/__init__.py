"""The ``partialfl`` command line: one module per group of commands, each a thin call into
:mod:`partialfl.pipeline` or :mod:`partialfl.reproductions` — ``catalog`` (list, reference,
reproduce), ``run`` (run, train), ``runs`` (evaluate, report), ``data``, ``flower``, and
``advise`` (:mod:`partialfl.reproductions.advise`)."""

from __future__ import annotations

import argparse
import os
import sys

from partialfl import __version__
from partialfl.config import ConfigError
from partialfl.runtime.faults import ClientFaultError, InjectedFault


def build_parser(epilog: bool = True) -> argparse.ArgumentParser:
    """The ``partialfl`` argument parser with its subcommands (``epilog``: list the
    reproductions under ``reproduce --help``, which imports them)."""
    from partialfl.cli import catalog, data, flower, run, runs
    from partialfl.reproductions.advise import add_parser as add_advise

    p = argparse.ArgumentParser(
        prog="partialfl",
        description="Partially personalized federated learning (FFGG and baselines).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    catalog.add_commands(sub, epilog=epilog)
    runs.add_commands(sub)
    run.add_commands(sub)
    data.add_commands(sub)
    flower.add_commands(sub)
    add_advise(sub)
    return p


def _stdout_closed() -> int:
    """The reader of our stdout went away (``partialfl list | head -2``): stop quietly, as a
    command-line tool does, instead of a BrokenPipeError traceback at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what the shell reports for a tool stopped this way


def _interrupted() -> int:
    print("partialfl: interrupted", file=sys.stderr)
    return 130


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status (0
    success, 2 bad input, 130 interrupted, 141 output pipe closed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # building the parser imports torch and the components (a second or so)
        parser = build_parser(epilog="reproduce" in argv and ("-h" in argv or "--help" in argv))
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return _interrupted()
    if args.command is None:
        parser.print_help()
        return 0
    try:
        rc = args.fn(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except (ConfigError, ValueError, NotImplementedError, FileNotFoundError,
            FileExistsError, IsADirectoryError, NotADirectoryError, MemoryError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"partialfl: error: {msg}", file=sys.stderr)
        return 2
    except (ClientFaultError, InjectedFault, ConnectionError) as e:  # injected: a whole
        # cohort failed before any client succeeded (FaultLog.raise_if_systematic)
        print(f"partialfl: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except OSError as e:  # a path the system refuses (no permission, a symlink loop, EIO)
        print(f"partialfl: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a Flower run that failed: its cause, in one line
        if str(e).startswith("Symlink loop from "):  # Path.resolve() before Python 3.13: a
            print(f"partialfl: error: {e}", file=sys.stderr)  # path the system refuses, as
            return 2  # the OSError (ELOOP) above
        env, jobs = sys.modules.get("partialfl.flower.env"), sys.modules.get(
            "partialfl.pipeline.jobs")  # or a study's worker process that died
        if not ((env is not None and isinstance(e, env.FlowerRunError))
                or (jobs is not None and isinstance(e, jobs.JobsFailed))):
            raise
        print(f"partialfl: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return _interrupted()
