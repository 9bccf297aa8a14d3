"""Which files of a version hold its data: what the ecosystem's Parquet readers should open.

```
manifest ──► data_entries(manifest, split) ──► Catalog.files(): each one verified ──► paths/URLs
              processed: <split>/*.parquet        (size, sha256,       dd.read_parquet, DuckDB,
              other kinds: every *.parquet          Parquet footer)      Polars, Spark, pyarrow
              never: manifest, quarantine/,
              _state/, _common_metadata
```

A version folder holds more than data: ``manifest.json``, an SDSS version's ``quarantine/``
(rows in another schema, set aside), its incremental state under ``_state/``, and a Petastorm
split's ``_common_metadata``. Pointed at the folder, generic readers fail on the manifest or
silently mix the quarantine's rows in, so readers are given the list of data files instead.
The selection is pure (it reads only the manifest); :meth:`data_catalog.Catalog.files` checks
each selected file against the manifest before naming it.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from data_catalog.errors import CatalogError
from data_catalog.layout import ProcessedLayout
from data_catalog.manifest import FileEntry, Manifest


class NoSuchSplit(CatalogError):
    """A split the version does not have, or a split asked of a version without splits."""


def data_entries(manifest: Manifest, split: str | None = None) -> list[FileEntry]:
    """The manifest's entries of data files, in the manifest's (sorted) order.

    Processed versions: the Parquet files of ``split``'s folder, or of every split's folder
    when ``split`` is None (never the quarantine). Other kinds (raw, model): every Parquet
    file outside a ``_``- or ``.``-prefixed folder; asking them for a split is an error.
    A :class:`CatalogError` when nothing is left: a version of IDX files or a model has no
    table a Parquet reader can open.
    """
    if manifest.kind == "processed":
        layout = ProcessedLayout.of(manifest)
        if split is not None and split not in layout.splits:
            raise NoSuchSplit(
                f"{manifest.ref} has no split {split!r}; its splits: {', '.join(layout.splits)}"
            )
        folders = [split] if split is not None else list(layout.splits)
        entries = [e for e in manifest.files if _is_data(e) and _folder(e) in folders]
    else:
        if split is not None:
            raise NoSuchSplit(
                f"{manifest.ref} is a {manifest.kind} version: it has no splits (drop --split)"
            )
        entries = [e for e in manifest.files if _is_data(e)]
    if not entries:
        what = f"split {split!r} of " if split is not None else ""
        raise CatalogError(
            f"{what}{manifest.ref} ({manifest.kind}) holds no Parquet data file; "
            "`shardflow catalog show` lists its files"
        )
    return entries


def _is_data(entry: FileEntry) -> bool:
    parts = PurePosixPath(entry.path).parts
    # Readers skip names starting with "_" or "." (Hive, Spark, pyarrow, dask): the same rule
    # keeps _common_metadata, _metadata and _state/ out.
    return entry.path.endswith(".parquet") and not any(p[:1] in ("_", ".") for p in parts)


def _folder(entry: FileEntry) -> str:
    parts = PurePosixPath(entry.path).parts
    return parts[0] if len(parts) > 1 else ""
