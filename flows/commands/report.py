"""`shardflow report MODEL[@VERSION]`: one model version's view, from the ingest to every
rank's input, written again from the catalog (training.report)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.console import Context


def cmd_report(ctx: Context, args: argparse.Namespace) -> int:
    from training.input_metrics import summarize
    from training.report import gather, recorded_input_by_rank, write_report

    name, _, version = args.ref.partition("@")
    catalog = ctx.settings.catalog()
    path = write_report(catalog, name, version or None, Path(args.out) if args.out else None)
    model = gather(catalog, name, version or None).model
    input_by_rank = recorded_input_by_rank(model)
    # As the page: today's flags from the recorded figures.
    summary = summarize(input_by_rank)
    ctx.emit(
        {
            "model": model.name,
            "version": model.version,
            "path": str(path),
            "input_by_rank": input_by_rank,
            "input_summary": summary,
        },
        [str(path)],
    )
    return 0


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    report = commands.add_parser(
        "report",
        parents=[common],
        help="write a model version's HTML report: ingest, preprocess, every rank's input",
    )
    report.add_argument("ref", metavar="MODEL[@VERSION]", help="e.g. fashion-mnist-cnn")
    report.add_argument(
        "--out", help="the HTML file to write (default: report.html in the version's run folder)"
    )
    report.set_defaults(handler=cmd_report)
