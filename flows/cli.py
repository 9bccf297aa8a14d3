"""The ``shardflow`` command: each stage on its own, or all three as one Prefect flow run.

main ─ parser (flows.commands.*: stages, catalog, bench, server) ─ Settings from the env
     ─ the command's handler ─ one line on stderr and exit 1 for any user error
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from data_catalog.errors import ConfigError, ShardflowError

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

Data and catalog live under $SHARDFLOW_HOME (default ~/.shardflow): catalog/ holds every
dataset and model version, runs/ the training runs' checkpoints and logs.
Design notes: docs/preprocessing.md, docs/training.md, docs/prefect.md in the repository.
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit 1, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from flows.commands import bench, catalog, server, stages

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
    for family in (stages, bench, server, catalog):
        family.register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from flows.console import Context
    from flows.logs import route_library_logs
    from flows.options import flag_for
    from flows.settings import Settings

    args = build_parser().parse_args(argv)
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
        print(f"shardflow: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardflow: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"shardflow: internal error: {type(exc).__name__}: {message} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
