"""`shardflow catalog list | show | files | verify | lineage | gc | reindex`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from flows.console import Context


def _split_ref(ref: str) -> tuple[str, str | None]:
    name, _, version = ref.partition("@")
    return name, version or None


def manifest_json(catalog: Any, manifest: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(manifest.to_json())
    # "path": where the bytes are (the file in the version's folder, or its object in an
    # object store); "file": its name in the version.
    data["files"] = [
        {**entry, "path": catalog.file_url(manifest, file), "file": file.path}
        for entry, file in zip(data["files"], manifest.files, strict=True)
    ]
    data["directory"] = catalog.version_url(manifest.name, manifest.version)
    return data


def cmd_list(ctx: Context, args: argparse.Namespace) -> int:
    from data_catalog import Problem

    catalog = ctx.settings.catalog()
    rows = []
    # A manifest that cannot be read is named, never allowed to hide the rest of the catalog.
    unreadable: list[Problem] = []
    for name in catalog.names():
        versions = catalog.versions(name, unreadable=unreadable)
        if not versions:
            continue
        latest = versions[-1]
        rows.append(
            {
                "name": name,
                "kind": latest.kind,
                "latest": latest.version,
                "versions": len(versions),
                "rows": latest.rows,
                "created": latest.created,
            }
        )
    lines = [f"{'NAME':32} {'KIND':10} {'LATEST':17} {'VERSIONS':>8} {'ROWS':>12}"]
    lines += [
        f"{r['name']:32} {r['kind']:10} {r['latest']:17} {r['versions']:>8} {r['rows']:>12,}"
        for r in rows
    ]
    root = ctx.settings.catalog_root
    if not rows and not unreadable:
        lines = [f"the catalog at {root} is empty; start with `shardflow ingest`"]
    lines += [f"UNREADABLE {p.path}: {p.reason}" for p in unreadable]
    ctx.emit(
        {
            "datasets": rows,
            "root": str(root),
            "unreadable": [{"path": p.path, "reason": p.reason} for p in unreadable],
        },
        lines,
    )
    if unreadable:
        print(
            f"shardflow: warning: {len(unreadable)} manifest(s) could not be read and are "
            "left out; run `shardflow catalog verify` for details",
            file=sys.stderr,
        )
    return 0


def cmd_show(ctx: Context, args: argparse.Namespace) -> int:
    catalog = ctx.settings.catalog()
    name, version = _split_ref(args.ref)
    manifest = catalog.get(name, version)
    data = manifest_json(catalog, manifest)
    lines = [
        f"{manifest.name}@{manifest.version} ({manifest.kind}), {manifest.rows:,} rows, "
        f"created {manifest.created}, code {manifest.code_version}"
    ]
    lines += [f"  parent {p.name}@{p.version}" for p in manifest.parents]
    lines += [f"  source {s.get('uri', s)}" for s in manifest.sources]
    lines += [f"  {f['path']}  rows={f['rows']}  sha256={f['sha256'][:12]}…" for f in data["files"]]
    ctx.emit(data, lines)
    return 0


def cmd_files(ctx: Context, args: argparse.Namespace) -> int:
    """One data file per line (paths, or object URLs), each checked against the manifest:
    what DuckDB, Polars, dask.dataframe, Spark or pyarrow should read, never the manifest or
    the quarantine."""
    catalog = ctx.settings.catalog()
    name, version = _split_ref(args.ref)
    manifest = catalog.get(name, version)
    files = catalog.files(manifest.name, manifest.version, split=args.split)
    ctx.emit(
        {"name": manifest.name, "version": manifest.version, "split": args.split, "files": files},
        files,
    )
    return 0


def cmd_verify(ctx: Context, args: argparse.Namespace) -> int:
    from data_catalog.errors import CatalogError, NotFound
    from preprocessing.verify_processed import check_processed

    catalog = ctx.settings.catalog()
    name, version = _split_ref(args.ref) if args.ref else (None, None)
    if name is not None:
        try:
            catalog.get(name, version)  # an unknown name is an error, not a clean bill of health
        except NotFound:
            raise
        except CatalogError:
            pass  # an edited or garbled manifest: the report below names it
    report = catalog.verify_report(name, version, checks=[check_processed])
    problems, notes = report.problems, report.notes
    result = {
        "ok": not problems,
        "versions": report.versions,
        "problems": [{"path": p.path, "reason": p.reason} for p in problems],
        "notes": [{"path": p.path, "reason": p.reason} for p in notes],
    }
    lines = [f"BAD {p.path}: {p.reason}" for p in problems]
    lines += [f"NOTE {p.path}: {p.reason}" for p in notes]
    if not problems:
        lines.append(f"{report.versions} versions: all files and manifests match")
    ctx.emit(result, lines)
    if problems:
        for p in problems:
            print(f"shardflow: verify: {p.path}: {p.reason}", file=sys.stderr)
        return 1
    return 0


def cmd_lineage(ctx: Context, args: argparse.Namespace) -> int:
    name, version = _split_ref(args.ref)
    tree = ctx.settings.catalog().lineage(name, version)

    def render(node: dict[str, Any], depth: int) -> list[str]:
        label = f"{node['name']}@{node['version']}"
        if node.get("missing"):
            label += " (missing from catalog)"
        else:
            label += f" ({node.get('kind')})"
        out = ["  " * depth + label]
        if "new_since" in node:
            grew = node["new_since"]
            new = grew.get("new", [])
            out.append(
                "  " * (depth + 1)
                + f"new since {grew.get('base')}: {len(new)} ({', '.join(map(str, new[:5]))}"
                + (", ..." if len(new) > 5 else "")
                + f"), {grew.get('reused', 0)} reused"
            )
        out += ["  " * (depth + 1) + f"source {s.get('uri', s)}" for s in node.get("sources", [])]
        for parent in node.get("parents", []):
            out += render(parent, depth + 1)
        return out

    ctx.emit(tree, render(tree, 0))
    return 0


def cmd_gc(ctx: Context, args: argparse.Namespace) -> int:
    """The catalog's leftovers (staging of dead writers, versions without manifest, objects no
    version holds), then the work folders no live run holds and the download cache's stale
    entries; never a committed version, never a run folder."""
    from preprocessing.work_gc import DEFAULT_MIN_AGE, remove_unused_work

    catalog = ctx.settings.catalog()
    removed: list[Any] = catalog.gc()
    removed += remove_unused_work(ctx.settings.work_dir, min_age=DEFAULT_MIN_AGE)
    ctx.emit(
        {"removed": [str(p) for p in removed]},
        [f"removed {p}" for p in removed] or ["nothing to remove"],
    )
    return 0


def cmd_reindex(ctx: Context, args: argparse.Namespace) -> int:
    count = ctx.settings.catalog().reindex()
    ctx.emit({"versions": count}, [f"indexed {count} versions"])
    return 0


Handler = Callable[[Context, argparse.Namespace], int]
ACTIONS: dict[str, tuple[Handler, str, str | None]] = {
    "list": (cmd_list, "every dataset and model with its latest version", None),
    "show": (cmd_show, "one version's manifest (default: the latest)", "NAME[@VERSION]"),
    "files": (
        cmd_files,
        "a version's verified data files, one per line, for DuckDB, Polars, dask, Spark, "
        "pyarrow (--split S: one split)",
        "NAME[@VERSION]",
    ),
    "verify": (
        cmd_verify,
        "recompute every file's digest; non-zero exit on damage",
        "[NAME[@VERSION]]",
    ),
    "lineage": (cmd_lineage, "the tree of parents back to the raw sources", "NAME[@VERSION]"),
    "gc": (
        cmd_gc,
        "remove leftover staging, uncommitted files, work folders of no live run and "
        "stale downloads (untouched for an hour)",
        None,
    ),
    "reindex": (cmd_reindex, "rebuild the index from the manifests", None),
}


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    catalog = commands.add_parser("catalog", help="list, show, verify dataset and model versions")
    actions = catalog.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, (handler, help_text, ref) in ACTIONS.items():
        sub = actions.add_parser(action, parents=[common], help=help_text)
        if ref is not None:
            sub.add_argument("ref", metavar=ref, nargs="?" if ref.startswith("[") else None)
        if action == "files":
            sub.add_argument(
                "--split", metavar="S", help="only this split (train, validation, test)"
            )
        sub.set_defaults(handler=handler)
