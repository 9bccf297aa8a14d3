"""Checks of a processed version's manifest against its files, for ``shardflow catalog verify``.

```
processed manifest                         the files (trusted: their digests matched)
──────────────────                         ──────────────────────────────────────────
statistics.<split>.rows, num_row_groups,   ◄── Parquet footers of <split>/*.parquet:
  num_shards, rows_per_group                     rows of every row group, per file
rows                                       ◄── the splits' rows, summed
statistics.normalization.mean, std         ◄── recomputed from every train/ row, with the
                                                 writer's own functions, in its order
```

The catalog checks what any version holds (digests, each Parquet file's rows and row groups);
these checks know what preprocessing writes, so they live here and the CLI hands
:func:`check_processed` to :meth:`data_catalog.Catalog.verify_report`, which calls it only when
every file of the version matched its digest (statistics recomputed from damaged bytes would
blame the manifest for the file's damage).

The normalisation statistics are recomputed from the whole training split, not a sample: the
verify that calls this has just read every byte to hash it, the recomputation reads the
training split once more and is of the same order (docs/training.md, "Checking the input",
has the measured cost), and only the whole split gives the writer's figures exactly, so a
changed digit is found, not just a changed magnitude.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from data_catalog import Catalog, Manifest, Problem
from data_catalog.layout import LayoutError, ProcessedLayout, SplitLayout

# Both figures are recomputed bit for bit as the writer computed them; the tolerance only
# absorbs a last-digit difference should a numpy upgrade sum in another order.
RELATIVE_TOLERANCE = 1e-9


def check_processed(catalog: Catalog, manifest: Manifest) -> list[Problem]:
    """Problems of a processed version's layout against its files, each naming the field (a
    layout that cannot be read is one problem naming its first garbled field); [] for other
    kinds, and for catalogs that are not local (preprocessing writes only to local catalogs)."""
    if manifest.kind != "processed" or not catalog.is_local:
        return []
    location = catalog.manifest_location(manifest.name, manifest.version)
    try:
        layout = ProcessedLayout.of(manifest)
    except LayoutError as exc:
        return [Problem(path=location, reason=str(exc))]
    problems: list[str] = []
    split_rows = 0
    for split, split_layout in sorted(layout.splits.items()):
        paths = _split_files(catalog, manifest, split)
        groups = [_row_group_rows(path) for path in paths]
        split_rows += sum(sum(g) for g in groups)
        problems += _split_problems(split, split_layout, groups)
    if split_rows != manifest.rows:
        problems.append(
            f"manifest field rows is {manifest.rows}, the splits' files hold {split_rows} rows"
        )
    problems += _normalization_problems(catalog, manifest, layout)
    return [Problem(path=location, reason=f"{manifest.ref}: {p}") for p in problems]


def _split_files(catalog: Catalog, manifest: Manifest, split: str) -> list[Path]:
    entries = ProcessedLayout.of(manifest).split_entries(manifest, split)
    return [catalog.file_path(manifest, entry) for entry in entries]


def _row_group_rows(path: Path) -> list[int]:
    metadata = pq.read_metadata(path)
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


def _split_problems(split: str, layout: SplitLayout, groups: list[list[int]]) -> list[str]:
    """What ``statistics.<split>`` says against the row groups of its files, in path order."""
    field = f"statistics.{split}"
    found = {
        "rows": (layout.rows, sum(sum(g) for g in groups)),
        "num_row_groups": (layout.num_row_groups, sum(len(g) for g in groups)),
        "num_shards": (layout.num_shards, len(groups)),
    }
    problems = [
        f"{field}.{key} is {recorded}, the {split}/ files hold {value}"
        for key, (recorded, value) in found.items()
        if recorded != value
    ]
    per_group = layout.rows_per_group
    if layout.equal_row_groups:
        sizes = sorted({n for g in groups for n in g})
        if sizes and sizes != [per_group]:
            problems.append(
                f"{field}.rows_per_group is {per_group}, the {split}/ row groups hold "
                f"{', '.join(map(str, sizes))} rows"
            )
        return problems
    # Whole splits: every row group but the last of each file is full, the last no larger.
    short = [n for g in groups for n in g[:-1] if n != per_group]
    large = [g[-1] for g in groups if g and g[-1] > per_group]
    if short or large:
        sizes = sorted({n for g in groups for n in g})
        problems.append(
            f"{field}.rows_per_group is {per_group}, the {split}/ row groups hold "
            f"{', '.join(map(str, sizes))} rows"
        )
    return problems


def _normalization_problems(
    catalog: Catalog, manifest: Manifest, layout: ProcessedLayout
) -> list[str]:
    """statistics.normalization.mean and std against the figures recomputed from train/."""
    recomputed = recompute_normalization(layout, _split_files(catalog, manifest, "train"))
    if recomputed is None:
        return []
    problems = []
    recorded = {"mean": layout.normalization.mean, "std": layout.normalization.std}
    for key, values in recorded.items():
        field = f"statistics.normalization.{key}"
        if len(values) != len(recomputed[key]):
            problems.append(
                f"{field} is {list(values)!r}, recomputed from the train/ files: {recomputed[key]}"
            )
            continue
        for i, (value, expected) in enumerate(zip(values, recomputed[key], strict=True)):
            if not _close(value, expected):
                problems.append(
                    f"{field}[{i}] is {value!r}, recomputed from the train/ files: {expected!r}"
                )
    return problems


def recompute_normalization(
    layout: ProcessedLayout, train_files: Sequence[Path]
) -> dict[str, list[float]] | None:
    """Mean and std as the writer computed them: its per-shard sums (pixel / 255 per channel,
    or the features), one shard at a time in path order, combined by its own function.

    None when there are no training files.
    """
    from preprocessing.images import channel_sums
    from preprocessing.statistics import combine_sums

    sums = []
    if layout.image_shape is not None:
        shape = list(layout.image_shape)
        channels = layout.pixel_shape[-1]
        petastorm = layout.format == "petastorm"
        for path in train_files:
            column = pq.read_table(path, columns=["image"]).column("image")
            pixels = _decoded(column, shape) if petastorm else _pixels(column)
            sums.append(channel_sums(pixels, channels))
    else:
        from preprocessing.sdss import feature_sums

        columns = list(layout.feature_columns or ())
        for path in train_files:
            sums.append(feature_sums(pq.read_table(path, columns=columns), tuple(columns)))
    if not sums:
        return None
    return combine_sums(sums)


def _pixels(column: pa.ChunkedArray) -> npt.NDArray[np.uint8]:
    """The raw image bytes of a binary column, concatenated, without a Python object per row."""
    parts = []
    for chunk in column.chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)
        offsets = offsets[chunk.offset : chunk.offset + len(chunk) + 1]
        data = np.frombuffer(chunk.buffers()[2], dtype=np.uint8)
        parts.append(data[offsets[0] : offsets[-1]])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def _decoded(column: pa.ChunkedArray, shape: list[int]) -> npt.NDArray[np.uint8]:
    """Petastorm-encoded images (its NdarrayCodec), decoded with the schema's own codec."""
    from preprocessing.schemas import image_unischema

    field = image_unischema(shape).image
    images = [field.codec.decode(field, value) for value in column.to_pylist()]
    return np.stack(images) if images else np.zeros(0, dtype=np.uint8)


def _close(value: Any, expected: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isclose(value, expected, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-12)
