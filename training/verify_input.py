"""Refuse to train on a processed version that is not what its manifest says.

```
catalog.get(processed)            the manifest matches the digest recorded at its commit
    │                             (data_catalog refuses an edited one)
    ▼
verify_input(catalog, processed)  before the launcher plans or starts a rank:
    │  catalog.verify_report      every file's size and sha256 (the train, validation and test
    │                             shards the ranks open, petastorm's _common_metadata), each
    │                             Parquet footer's rows and row groups against the manifest, no
    │                             file the manifest does not list (petastorm would read a stray
    │                             part file in train/)
    │  layout_problems            what the launcher plans from, statistics.train.rows_per_group
    │                             and num_row_groups, against the train/ footers: every row
    │                             group holds rows_per_group rows, and there are num_row_groups
    ▼
ShardflowError, one line naming the file and what differs; nothing launched, nothing written
```

Hashing is the cost: the whole processed version is read once (docs/training.md, "Checking the
input", has the figure for Fashion-MNIST).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow.parquet as pq

from data_catalog import Catalog, Manifest, Problem
from data_catalog.errors import ShardflowError
from data_catalog.manifest import MANIFEST_NAME, FileEntry


@dataclass(frozen=True, kw_only=True)
class InputCheck:
    """What :func:`verify_input` checked, for the progress line."""

    files: int
    bytes: int
    seconds: float
    notes: tuple[str, ...]
    """What could not be checked (a manifest written before manifests carried a digest)."""


def verify_input(
    catalog: Catalog, processed: Manifest, progress: Callable[[str], None] = lambda _m: None
) -> InputCheck:
    """Check ``processed`` before training on it; a :class:`ShardflowError` naming the first
    file (or manifest field) that differs, with the count of the others."""
    started = time.perf_counter()
    report = catalog.verify_report(processed.name, processed.version)
    problems = list(report.problems) or layout_problems(catalog, processed)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ShardflowError(
            f"{processed.ref} is not what its manifest says: {first.path}: "
            f"{_one_line(first.reason)}{more}; nothing was trained (see `shardflow catalog "
            f"verify {processed.name}@{processed.version}`)"
        )
    check = InputCheck(
        files=len(processed.files),
        bytes=sum(f.bytes for f in processed.files),
        seconds=time.perf_counter() - started,
        notes=tuple(n.reason for n in report.notes),
    )
    for note in check.notes:
        progress(f"note: {note}")
    progress(
        f"verified {processed.ref}: {check.files} files, {check.bytes / 1e6:.1f} MB in "
        f"{check.seconds:.2f} s"
    )
    return check


def layout_problems(catalog: Catalog, processed: Manifest) -> list[Problem]:
    """The training split's layout in the manifest (what the launcher plans the ranks' row
    groups and steps from) against its Parquet footers."""
    location = f"{catalog.version_url(processed.name, processed.version)}/{MANIFEST_NAME}"
    statistics = processed.statistics.get("train")
    if not isinstance(statistics, dict):
        return [Problem(path=location, reason="no statistics.train: not a training split")]
    sizes: list[int] = []
    for entry in sorted(processed.files, key=lambda e: e.path):
        if entry.path.startswith("train/") and entry.path.endswith(".parquet"):
            metadata = _footer(catalog, processed, entry)
            sizes += [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    problems = []
    recorded_groups = statistics.get("num_row_groups")
    if recorded_groups != len(sizes):
        problems.append(
            f"statistics.train.num_row_groups is {recorded_groups}, the train/ files hold "
            f"{len(sizes)} row groups"
        )
    per_group = statistics.get("rows_per_group")
    if sorted(set(sizes)) != [per_group]:
        held = ", ".join(str(n) for n in sorted(set(sizes))) or "no"
        problems.append(
            f"statistics.train.rows_per_group is {per_group}, the train/ row groups hold "
            f"{held} rows"
        )
    if "rows" in statistics and statistics["rows"] != sum(sizes):
        problems.append(
            f"statistics.train.rows is {statistics['rows']}, the train/ files hold {sum(sizes)}"
        )
    return [Problem(path=location, reason=p) for p in problems]


def _footer(catalog: Catalog, processed: Manifest, entry: FileEntry) -> pq.FileMetaData:
    """The Parquet footer of one file, local or in an object-store catalog."""
    if catalog.is_local:
        return pq.read_metadata(catalog.file_path(processed, entry))
    import fsspec

    with fsspec.open(catalog.file_url(processed, entry), "rb") as stream:
        return pq.read_metadata(stream)


def _one_line(text: str) -> str:
    return " ".join(text.split())
