"""The SQL index of committed versions: a cache for queries across datasets.

Manifests on disk are the truth; this index only answers questions that would otherwise read
every manifest (which versions have this parent, which are models). It can be deleted at any
time and is rebuilt from the manifests.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateTable

from data_catalog.errors import CatalogError
from data_catalog.manifest import Manifest, ParentRef

log = logging.getLogger(__name__)

# Writers in other processes hold SQLite's lock for one short transaction each; wait for them
# rather than fail.
SQLITE_BUSY_TIMEOUT_S = 60

metadata = sa.MetaData()
versions_table = sa.Table(
    "versions",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("version", sa.String(16), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("created", sa.String(40), nullable=False),
    sa.Column("rows", sa.BigInteger, nullable=False),
    sa.Column("code_version", sa.String(200), nullable=False),
    sa.Column("manifest_path", sa.Text, nullable=False),
)
parents_table = sa.Table(
    "parents",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("version", sa.String(16), primary_key=True),
    sa.Column("parent_name", sa.String(64), primary_key=True),
    sa.Column("parent_version", sa.String(16), primary_key=True),
)


class IndexUnusable(CatalogError):
    """The index cannot be read or written; ``corrupt`` when its SQLite file is garbled."""

    def __init__(self, url: str, exc: sa.exc.SQLAlchemyError) -> None:
        cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
        # SQLAlchemy's own text spans lines (the SQL, a link); the driver's first line is enough.
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        self.corrupt = type(cause) is sqlite3.DatabaseError
        # A read-only index is not fixed by rebuilding it (which writes it), nor one that
        # cannot be opened at all (a folder where the file should be).
        database = _sqlite_path(url)
        if database is not None and database.is_dir():
            remedy = (
                f"{database} is a directory: remove it, or point SHARDFLOW_CATALOG_URL at a file"
            )
        elif "readonly" in reason.replace("-", "").replace(" ", "").lower():
            remedy = "point SHARDFLOW_HOME (or SHARDFLOW_CATALOG) at a writable filesystem"
        elif "unable to open database file" in reason:
            remedy = f"check that {database or url} can be created and written"
        else:
            remedy = "run `shardflow catalog reindex` to rebuild it from the manifests"
        super().__init__(f"the catalog index {_shown(url)} cannot be used ({reason}); {remedy}")


def _sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for another database (or an in-memory one)."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def _shown(url: str) -> str:
    """The URL without its password."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


class Index:
    """Versions and their parents in a SQLAlchemy database; connects on first use.

    Every database error is raised as an :class:`IndexUnusable` (a :class:`CatalogError`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine: sa.Engine | None = None

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            try:
                backend = sa.make_url(self.url).get_backend_name()
            except sa.exc.ArgumentError as exc:
                raise CatalogError(
                    f"the catalog index URL {self.url!r} is not a database URL ({exc}); "
                    "fix SHARDFLOW_CATALOG_URL (e.g. postgresql://user@host/db)"
                ) from None
            sqlite = backend == "sqlite"
            connect_args: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT_S} if sqlite else {}
            try:
                # NullPool: no connection outlives a call, so a forked worker never shares one.
                self._engine = sa.create_engine(
                    self.url, poolclass=NullPool, connect_args=connect_args
                )
            except ImportError as exc:  # the dialect's driver is not installed
                raise CatalogError(
                    f"the catalog index {_shown(self.url)} needs the {backend} database driver, "
                    f"which is not installed ({exc}); install it (e.g. pip install pymysql, with "
                    "a mysql+pymysql:// URL) or unset SHARDFLOW_CATALOG_URL"
                ) from None
            except sa.exc.SQLAlchemyError as exc:  # an unknown dialect, a bad argument
                raise IndexUnusable(self.url, exc) from exc
        return self._engine

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sa.exc.SQLAlchemyError as exc:
            raise IndexUnusable(self.url, exc) from exc

    def ensure_tables(self) -> bool:
        """Create missing tables; True if the versions table was missing (index must be rebuilt)."""
        with self._errors():
            missing = not sa.inspect(self.engine).has_table(versions_table.name)
            with self.engine.begin() as conn:
                for table in metadata.sorted_tables:
                    # IF NOT EXISTS: another process may create them between our check and here.
                    conn.execute(CreateTable(table, if_not_exists=True))
        return missing

    def remove_garbled_file(self) -> bool:
        """Delete a SQLite index file that is not a database (and its journals), so that it can
        be built afresh; False if the index is not a SQLite file."""
        url = sa.make_url(self.url)
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return False
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        path = Path(url.database)
        log.warning("catalog index %s is garbled; rebuilding it from the manifests", path)
        for suffix in ("", "-journal", "-wal", "-shm"):
            path.with_name(path.name + suffix).unlink(missing_ok=True)
        return True

    def record(self, manifest: Manifest, manifest_path: str) -> None:
        """Insert or replace one version."""
        with self._errors(), self.engine.begin() as conn:
            _delete(conn, manifest.name, manifest.version)
            _insert(conn, manifest, manifest_path)

    def rebuild(self, manifests: Callable[[], Iterable[tuple[Manifest, str]]]) -> int:
        """Replace the whole index with ``manifests()``; returns how many versions it holds.

        The delete runs first so that the transaction holds the write lock while the manifests
        are read: a version committed meanwhile is either read here or recorded after us.
        """
        count = 0
        with self._errors(), self.engine.begin() as conn:
            conn.execute(parents_table.delete())
            conn.execute(versions_table.delete())
            for manifest, path in manifests():
                _insert(conn, manifest, path)
                count += 1
        return count

    def entries(self) -> set[tuple[str, str]]:
        """Every ``(name, version)`` in the index."""
        with self._errors(), self.engine.connect() as conn:
            rows = conn.execute(sa.select(versions_table.c.name, versions_table.c.version))
            return {(r.name, r.version) for r in rows}

    def search(self, *, kind: str | None, parent: ParentRef | None) -> list[tuple[str, str]]:
        """``(name, version)`` of the versions of ``kind`` with ``parent``, either if None."""
        query = sa.select(versions_table.c.name, versions_table.c.version)
        if kind is not None:
            query = query.where(versions_table.c.kind == kind)
        if parent is not None:
            query = query.join(
                parents_table,
                sa.and_(
                    parents_table.c.name == versions_table.c.name,
                    parents_table.c.version == versions_table.c.version,
                ),
            ).where(
                parents_table.c.parent_name == parent.name,
                parents_table.c.parent_version == parent.version,
            )
        query = query.order_by(versions_table.c.created, versions_table.c.version)
        with self._errors(), self.engine.connect() as conn:
            return [(r.name, r.version) for r in conn.execute(query)]


def _delete(conn: sa.Connection, name: str, version: str) -> None:
    # Delete-then-insert is an upsert every SQL dialect runs, inside one transaction.
    for table in (parents_table, versions_table):
        conn.execute(table.delete().where(table.c.name == name, table.c.version == version))


def _insert(conn: sa.Connection, manifest: Manifest, manifest_path: str) -> None:
    conn.execute(
        versions_table.insert().values(
            name=manifest.name,
            version=manifest.version,
            kind=manifest.kind,
            created=manifest.created,
            rows=manifest.rows,
            code_version=manifest.code_version,
            manifest_path=manifest_path,
        )
    )
    # A parent listed twice is one edge.
    parents = {(p.name, p.version) for p in manifest.parents}
    if parents:
        conn.execute(
            parents_table.insert(),
            [
                {
                    "name": manifest.name,
                    "version": manifest.version,
                    "parent_name": n,
                    "parent_version": v,
                }
                for n, v in sorted(parents)
            ],
        )
