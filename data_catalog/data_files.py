"""Which files of a version hold its data: what the ecosystem's Parquet readers should open.

```
manifest ──► data_entries(manifest, split) ──► Catalog.files(): each one verified ──► paths/URLs
              processed: split=<split>/*.parquet  (size, sha256,       dd.read_parquet, DuckDB,
              other kinds: every *.parquet          Parquet footer)      Polars, Spark, pyarrow
              never: _manifest.json, _quarantine/,
              _state/, _common_metadata
```

A version folder holds more than data: ``_manifest.json``, an SDSS version's ``_quarantine/``
(rows in another schema, set aside), its incremental state under ``_state/``, and a Petastorm
split's ``_common_metadata``. Since folder layout 2 (data_catalog/layout.py) all of them have
names readers skip, and the folder reads whole; a version written before keeps
``manifest.json`` and ``quarantine/`` beside its splits, where generic readers fail on the one
or silently mix the other in. The list of data files serves both.
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
        chosen = [split] if split is not None else list(layout.splits)
        entries = [e for s in chosen for e in layout.split_entries(manifest, s)]
        entries.sort(key=lambda e: e.path)
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
