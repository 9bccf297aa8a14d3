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
    │  ProcessedLayout.of         the layout, every field present and well-formed
    │  layout_problems            what the launcher plans from, statistics.train.rows_per_group
    │                             and num_row_groups, against the train/ footers: every row
    │                             group holds rows_per_group rows, and there are num_row_groups
    ▼
the checked layout, for the launcher to plan from; or a ShardflowError, one line naming the
file (or field) and what differs: nothing launched, nothing written
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
from data_catalog.layout import LayoutError, ProcessedLayout
from data_catalog.manifest import FileEntry


@dataclass(frozen=True, kw_only=True)
class InputCheck:
    """What :func:`verify_input` checked, for the progress line."""

    layout: ProcessedLayout
    """The version's layout, read once and checked against its files: what the launcher
    plans the ranks' steps from."""
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
    problems = list(report.problems)
    layout = None
    if not problems:
        try:
            layout = ProcessedLayout.of(processed)
        except LayoutError as exc:
            problems = [Problem(path=_manifest_location(catalog, processed), reason=str(exc))]
        else:
            problems = layout_problems(catalog, processed, layout)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ShardflowError(
            f"{processed.ref} is not what its manifest says: {first.path}: "
            f"{_one_line(first.reason)}{more}; nothing was trained (see `shardflow catalog "
            f"verify {processed.name}@{processed.version}`)"
        )
    assert layout is not None  # read whenever the files were intact
    check = InputCheck(
        layout=layout,
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


def layout_problems(
    catalog: Catalog, processed: Manifest, layout: ProcessedLayout
) -> list[Problem]:
    """The training split's layout (what the launcher plans the ranks' row groups and steps
    from) against its Parquet footers."""
    train = layout.train
    groups: list[list[int]] = []
    for entry in layout.split_entries(processed, "train"):
        metadata = _footer(catalog, processed, entry)
        groups.append([metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)])
    sizes = [n for g in groups for n in g]
    problems = []
    if train.num_row_groups != len(sizes):
        problems.append(
            f"statistics.train.num_row_groups is {train.num_row_groups}, the train/ files hold "
            f"{len(sizes)} row groups"
        )
    # Equal row groups; or, where each file's last group may be shorter, every other full.
    full = sizes if train.equal_row_groups else [n for g in groups for n in g[:-1]]
    if any(n != train.rows_per_group for n in full) or any(
        g and g[-1] > train.rows_per_group for g in groups
    ):
        held = ", ".join(str(n) for n in sorted(set(sizes))) or "no"
        problems.append(
            f"statistics.train.rows_per_group is {train.rows_per_group}, the train/ row groups "
            f"hold {held} rows"
        )
    if train.rows != sum(sizes):
        problems.append(
            f"statistics.train.rows is {train.rows}, the train/ files hold {sum(sizes)}"
        )
    location = _manifest_location(catalog, processed)
    return [Problem(path=location, reason=p) for p in problems]


def _manifest_location(catalog: Catalog, processed: Manifest) -> str:
    return catalog.manifest_location(processed.name, processed.version)


def _footer(catalog: Catalog, processed: Manifest, entry: FileEntry) -> pq.FileMetaData:
    """The Parquet footer of one file, local or in an object-store catalog."""
    if catalog.is_local:
        return pq.read_metadata(catalog.file_path(processed, entry))
    import fsspec

    with fsspec.open(catalog.file_url(processed, entry), "rb") as stream:
        return pq.read_metadata(stream)


def _one_line(text: str) -> str:
    return " ".join(text.split())
