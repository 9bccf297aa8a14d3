"""The ``shardflow`` command: each stage on its own, or all three as one Prefect flow run.

main ─ parser (flows.commands.*: stages, catalog, bench, experiment, server)
     ─ Settings from the env
     ─ the command's handler ─ one line on stderr and exit 1 for any user error
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from data_catalog.errors import ConfigError, ShardflowError
from flows.console import INTERRUPT

EPILOG = """\
examples:
  shardflow run fashion-mnist --np 2 --epochs 3       ingest, preprocess, train (a Prefect flow)
  shardflow ingest mnist --source http://host/mnist/  fetch the four IDX files into the catalog
  shardflow preprocess mnist                          shards on a Dask LocalCluster
  shardflow train mnist --np 2 --epochs 5             horovodrun -np 2 on localhost (Gloo)
  shardflow synth sdss --rows 200000 --out exports/   calibrated synthetic CasJobs exports
  shardflow run sdss --source exports/ --np 2         the same pipeline for SDSS (model dnn)
  shardflow bench scaling fashion-mnist --json        samples/s on 2 ranks / 1 rank
  shardflow catalog lineage fashion-mnist-cnn         a model back to its raw files
  shardflow experiment models-datasets --quick        a seed paper's experiment, its report

Data and catalog live under $SHARDFLOW_HOME (default ~/.shardflow): catalog/ holds every
dataset and model version, runs/ the training runs' checkpoints and logs.
Design notes: docs/preprocessing.md, docs/training.md, docs/prefect.md in the repository.
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit 1, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# The module of each command: a command line that names one imports only its module (the
# experiments' and benches' imports cost a stage command 0.15 s); --help imports them all.
FAMILIES = {
    **dict.fromkeys(("ingest", "preprocess", "train", "run", "synth"), "stages"),
    "bench": "bench",
    "experiment": "experiment",
    "report": "report",
    **dict.fromkeys(("server", "deploy"), "server"),
    "catalog": "catalog",
}


def _families(argv: Sequence[str] | None) -> list[str]:
    """The command modules to register for ``argv``: the named command's, else all."""
    named = next((a for a in (argv or ()) if not a.startswith("-")), None)
    if named in FAMILIES:
        return [FAMILIES[named]]
    return list(dict.fromkeys(FAMILIES.values()))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with ``argv``, only the commands it may name."""
    import importlib

    common = _Parser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on the last line of stdout",
    )
    common.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show progress on stderr even when it is not a terminal",
    )
    parser = _Parser(
        prog="shardflow",
        description="Raw data to a trained model: ingest → Dask preprocessing → Parquet shards "
        "→ Horovod data-parallel training, every step a catalog version.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    for family in _families(argv):
        importlib.import_module(f"flows.commands.{family}").register(commands, common)
    return parser


# Set once the command line is parsed: with --debug the teardown after an interrupt is shown.
_SHOW_TEARDOWN = {"debug": False}


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    INTERRUPT["pending"] = True
    _quiet_teardown()
    raise KeyboardInterrupt


def _quiet_teardown() -> None:
    """After Ctrl-C or SIGTERM the command stops what it started and says so in one line. What
    the libraries log, or raise in their own threads, while they are being stopped (Dask's
    event loop, tornado, Prefect's clients) is not the user's to act on: two such tracebacks
    reached stderr under a CPU hog. ``--debug`` keeps them."""
    if _SHOW_TEARDOWN["debug"]:
        return
    logging.disable(logging.CRITICAL)
    sys.unraisablehook = lambda _unraisable: None
    threading.excepthook = lambda _args: None


def keep_freed_memory() -> None:
    """Have glibc's malloc keep the memory this process frees for its next allocations: the
    tasks a command runs on its own threads allocate and free arrays of megabytes per column
    per piece, and glibc's defaults hand each back to the kernel (mmap above a threshold that
    starts at 128 KiB, trim above 128 KiB free), so each next one was faulted in and zeroed
    again: 210,000 page faults and 1.2 s of system time in a 2M-row SDSS preprocess. Kept up
    to 256 MiB: 68,000 faults, CPU 0.92x and wall 0.93x, peak RSS +4 MiB (docs/STACK.md).
    This process's only; Dask's workers keep distributed's own setting. Not glibc: nothing."""
    import ctypes

    if sys.platform != "linux" or not hasattr(os, "confstr"):
        return
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return
        mallopt = ctypes.CDLL(None).mallopt  # this process's own libc
    except (OSError, ValueError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX)
    mallopt(m_trim_threshold, 256 << 20)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a user error is one line on stderr and exit 1, an interruption
    (Ctrl-C, or SIGTERM as `kill`, `timeout`, systemd, SLURM and Kubernetes send) one line and
    exit 130, once the command has cleaned up after itself (its Dask cluster closed,
    horovodrun and the ranks stopped, the Prefect flow run marked Crashed, the command's
    Prefect server stopped)."""
    keep_freed_memory()
    # A Prefect flow run swaps in its own SIGTERM handler while it runs, and once it has
    # recorded the crash sends the signal again to this one (prefect.utilities.engine's
    # capture_sigterm).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    INTERRUPT["pending"] = False
    try:
        code = _run_command(argv)
        if not INTERRUPT["pending"]:  # see flows.console.INTERRUPT
            return code
    except KeyboardInterrupt:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print("shardflow: interrupted", file=sys.stderr)
    return 130


def _run_command(argv: Sequence[str] | None) -> int:
    from flows import failures
    from flows.console import Context
    from flows.logs import route_library_logs
    from flows.options import flag_for
    from flows.settings import Settings

    args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    _SHOW_TEARDOWN["debug"] = args.debug
    # No option takes a list: CPython 3.11's argparse drops a value of exactly '--'
    # ("--source=--") and hands over an empty list, past the option's type.
    dropped = sorted(dest for dest, value in vars(args).items() if isinstance(value, list))
    if dropped:
        flag = flag_for(dropped[0])
        flag = flag if flag.startswith("-") else "--" + flag.replace("_", "-")
        print(f"shardflow: error: {flag} needs a value (got '--')", file=sys.stderr)
        return 1
    try:
        ctx = Context(
            settings=Settings.from_env(),
            as_json=args.json,
            verbose=args.verbose or sys.stderr.isatty(),
            debug=args.debug,
        )
        route_library_logs(ctx.settings.home / "logs")
        return int(args.handler(ctx, args))
    except ConfigError as exc:
        if args.debug:
            raise
        print(f"shardflow: error: {flag_for(exc.field)} {exc.problem}", file=sys.stderr)
        return 1
    except ShardflowError as exc:
        if args.debug:
            raise
        print(f"shardflow: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:
        if args.debug:
            raise
        if INTERRUPT["pending"]:
            # Ctrl-C raised inside a library that wraps what it catches (pydantic turned the
            # KeyboardInterrupt into a PydanticSerializationError while Prefect serialised a
            # flow parameter): the command was interrupted, not broken.
            return 130
        environmental = failures.describe(exc)
        if environmental is not None:
            # A server that refuses or stops answering, no credentials: not a bug.
            print(f"shardflow: error: {environmental}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError) and exc.errno in _USER_FIXABLE:
            # The machine refused: a full disk, a read-only or missing folder, no permission.
            print(f"shardflow: error: {_describe_os_error(exc)}", file=sys.stderr)
            return 1
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"shardflow: internal error: {type(exc).__name__}: {message} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 2


# errno values that name a state of the machine the user can change, not a bug.
_USER_FIXABLE = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.EEXIST,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.ENOTEMPTY,
        errno.EMFILE,
    }
)
_OS_ERROR_HINTS = {
    errno.ENOSPC: "free some space and rerun (finished work is kept)",
    errno.EDQUOT: "free some space and rerun (finished work is kept)",
    errno.EFBIG: "a file size limit is in force (ulimit -f)",
    errno.EROFS: "point SHARDFLOW_HOME (or the path given) at a writable filesystem",
    errno.EACCES: "check the permissions, or point SHARDFLOW_HOME elsewhere",
    errno.EPERM: "check the permissions, or point SHARDFLOW_HOME elsewhere",
}


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _describe_os_error(exc: OSError) -> str:
    """One line: what the system refused, on which path, and what to do about it."""
    what = exc.strerror or _one_line(str(exc)) or type(exc).__name__
    paths = [p for p in (exc.filename, exc.filename2) if p is not None]
    where = f" ({' -> '.join(map(str, paths))})" if paths else ""
    hint = _OS_ERROR_HINTS.get(exc.errno or 0)
    return _one_line(f"{what}{where}" + (f": {hint}" if hint else ""))


if __name__ == "__main__":
    sys.exit(main())
