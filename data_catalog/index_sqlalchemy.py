"""The catalog index in a database that SQLAlchemy reaches (``SHARDFLOW_CATALOG_URL``).

Imported only for index URLs that :mod:`data_catalog.index` does not serve with the standard
library's ``sqlite3`` (PostgreSQL, MySQL, a SQLite URL with options): importing SQLAlchemy costs
every process about 0.16 CPU-seconds, which the default SQLite index does not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateTable

from data_catalog.errors import CatalogError
from data_catalog.manifest import Manifest, ParentRef

# The same tables and columns as data_catalog.index's SQLite DDL (a test compares them).
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


def shown(url: str) -> str:
    """The URL without its password."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


class SqlAlchemyIndex:
    """The index's backend in a SQLAlchemy database; connects on first use.

    It raises SQLAlchemy's errors (``errors``); :class:`data_catalog.index.Index` turns them
    into its ``IndexUnusable`` with the driver's own error (``cause``)."""

    errors = (sa.exc.SQLAlchemyError,)

    def __init__(self, url: str, *, sqlite_timeout_s: float) -> None:
        self.url = url
        self._sqlite_timeout_s = sqlite_timeout_s
        self._engine: sa.Engine | None = None

    @staticmethod
    def cause(exc: BaseException) -> BaseException:
        """The driver's own error (SQLAlchemy's text spans lines: the SQL, a link)."""
        orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else None
        return orig if orig is not None else exc

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
            connect_args: dict[str, Any] = {"timeout": self._sqlite_timeout_s} if sqlite else {}
            try:
                # NullPool: no connection outlives a call, so a forked worker never shares one.
                self._engine = sa.create_engine(
                    self.url, poolclass=NullPool, connect_args=connect_args
                )
            except ImportError as exc:  # the dialect's driver is not installed
                raise CatalogError(
                    f"the catalog index {shown(self.url)} needs the {backend} database driver, "
                    f"which is not installed ({exc}); install it (e.g. pip install pymysql, with "
                    "a mysql+pymysql:// URL) or unset SHARDFLOW_CATALOG_URL"
                ) from None
            # An unknown dialect or a bad argument raises a SQLAlchemyError.
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def ensure_tables(self) -> bool:
        missing = not sa.inspect(self.engine).has_table(versions_table.name)
        with self.engine.begin() as conn:
            for table in metadata.sorted_tables:
                # IF NOT EXISTS: another process may create them between our check and here.
                conn.execute(CreateTable(table, if_not_exists=True))
        return missing

    def record(self, manifest: Manifest, manifest_path: str) -> None:
        with self.engine.begin() as conn:
            _delete(conn, manifest.name, manifest.version)
            _insert(conn, manifest, manifest_path)

    def rebuild(self, manifests: Callable[[], Iterable[tuple[Manifest, str]]]) -> int:
        count = 0
        with self.engine.begin() as conn:
            conn.execute(parents_table.delete())
            conn.execute(versions_table.delete())
            for manifest, path in manifests():
                _insert(conn, manifest, path)
                count += 1
        return count

    def entries(self) -> set[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(versions_table.c.name, versions_table.c.version))
            return {(r.name, r.version) for r in rows}

    def search(self, *, kind: str | None, parent: ParentRef | None) -> list[tuple[str, str]]:
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
        with self.engine.connect() as conn:
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
