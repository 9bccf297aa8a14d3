"""Where everything lives, read from the environment once, at the process edge.

    SHARDFLOW_HOME          default ~/.shardflow: catalog/, runs/, work/
    SHARDFLOW_CATALOG       the catalog elsewhere: a path or an fsspec URL (s3://bucket/prefix)
    SHARDFLOW_CATALOG_URL   the catalog index in another SQLAlchemy database (default SQLite)

The CLI reads them when it starts, a flow run when it starts (a deployment's worker has its
own); nothing else reads them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from data_catalog.errors import ShardflowError

if TYPE_CHECKING:
    from data_catalog import Catalog

DEFAULT_HOME = "~/.shardflow"


@dataclass(frozen=True, kw_only=True)
class Settings:
    home: Path
    """Everything shardflow keeps, unless the catalog is put elsewhere."""
    catalog_location: str | None = None
    """A path or an fsspec URL; None: ``home/catalog``."""
    catalog_index_url: str | None = None
    """SQLAlchemy URL of the catalog index; None: SQLite inside the catalog."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, home: str | None = None) -> Settings:
        """The settings of this process; ``home`` (a flow parameter) overrides the env."""
        chosen = home or environ.get("SHARDFLOW_HOME") or DEFAULT_HOME
        path = Path(chosen).expanduser().resolve()
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            where = "is a file" if existing == path else f"cannot be made: {existing} is a file"
            raise ShardflowError(
                f"SHARDFLOW_HOME {path} {where}; point it at a directory (it is created if missing)"
            )
        return cls(
            home=path,
            catalog_location=environ.get("SHARDFLOW_CATALOG") or None,
            catalog_index_url=environ.get("SHARDFLOW_CATALOG_URL") or None,
        )

    @property
    def catalog_root(self) -> str:
        return self.catalog_location or str(self.home / "catalog")

    @property
    def runs_dir(self) -> Path:
        """Training runs: checkpoints, logs, TensorBoard."""
        return self.home / "runs"

    @property
    def work_dir(self) -> Path:
        """Downloads and files of unfinished work, kept so that a rerun resumes."""
        return self.home / "work"

    def catalog(self) -> Catalog:
        """The catalog, checked usable before any work (a bucket that is missing, credentials
        the store refuses); a ``memory://`` catalog, which would vanish when the command ends,
        is refused."""
        from data_catalog import Catalog

        root = self.catalog_root
        if root.split("://", 1)[0].lower() == "memory" and "://" in root:
            raise ShardflowError(
                f"SHARDFLOW_CATALOG {root!r} lives in this process's memory and would vanish "
                "when the command ends: use a path or an object store (s3://bucket/prefix)"
            )
        catalog = Catalog(root, index_url=self.catalog_index_url)
        catalog.check()
        return catalog
