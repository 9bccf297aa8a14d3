"""The SQL index of committed versions: a cache for queries across datasets.

Manifests on disk are the truth; this index only answers questions that would otherwise read
every manifest (which versions have this parent, which are models). It can be deleted at any
time and is rebuilt from the manifests.

The default index, a SQLite file (``sqlite:///<home>/index.sqlite``), is served here with the
standard library's ``sqlite3``; other URLs (``SHARDFLOW_CATALOG_URL=postgresql://...``, or a SQLite
URL with a driver or options) go through SQLAlchemy in :mod:`data_catalog.index_sqlalchemy`,
imported only then. Why hand-written SQL where SQLAlchemy exists: every process that imports the
catalog (each command, Dask worker and rank) paid for importing SQLAlchemy: without it,
``import data_catalog.catalog`` takes 0.20 CPU-seconds instead of 0.36 (docs/STACK.md, "The
catalog index without SQLAlchemy"). The two backends keep the same tables, busy timeout,
connection per call and transaction boundaries; tests/data_catalog/test_sqlite_index.py compares
them.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from data_catalog.errors import CatalogError
from data_catalog.manifest import Manifest, ParentRef

log = logging.getLogger(__name__)

# Writers in other processes hold SQLite's lock for one short transaction each; wait for them
# rather than fail.
SQLITE_BUSY_TIMEOUT_S = 60

# The tables as SQLAlchemy's SQLite dialect creates them from index_sqlalchemy's metadata
# (tests/data_catalog/test_sqlite_index.py checks that they stay the same), parents first.
SQLITE_TABLES = (
    "CREATE TABLE IF NOT EXISTS parents (\n"
    "\tname VARCHAR(64) NOT NULL, \n"
    "\tversion VARCHAR(16) NOT NULL, \n"
    "\tparent_name VARCHAR(64) NOT NULL, \n"
    "\tparent_version VARCHAR(16) NOT NULL, \n"
    "\tPRIMARY KEY (name, version, parent_name, parent_version)\n"
    ")",
    "CREATE TABLE IF NOT EXISTS versions (\n"
    "\tname VARCHAR(64) NOT NULL, \n"
    "\tversion VARCHAR(16) NOT NULL, \n"
    "\tkind VARCHAR(16) NOT NULL, \n"
    "\tcreated VARCHAR(40) NOT NULL, \n"
    "\trows BIGINT NOT NULL, \n"
    "\tcode_version VARCHAR(200) NOT NULL, \n"
    "\tmanifest_path TEXT NOT NULL, \n"
    "\tPRIMARY KEY (name, version)\n"
    ")",
)

# SQLAlchemy 2.0's URL grammar (sqlalchemy/engine/url.py, _parse_url), so that a URL means here
# what it means to SQLAlchemy; the database part is not unquoted there either.
_URL = re.compile(
    r"""
        (?P<name>[\w\+]+)://
        (?:
            (?P<username>[^:/]*)
            (?::(?P<password>[^@]*))?
        @)?
        (?:
            (?:
                \[(?P<ipv6host>[^/\?]+)\] |
                (?P<ipv4host>[^/:\?]+)
            )?
            (?::(?P<port>[^/\?]*))?
        )?
        (?:/(?P<database>[^\?]*))?
        (?:\?(?P<query>.*))?
    """,
    re.X,
)


@dataclass(frozen=True)
class SqliteUrl:
    """A ``sqlite[+driver]://`` URL: its ``database`` as SQLAlchemy's ``make_url`` reads it, and
    whether the standard library serves it (``plain``)."""

    database: str | None
    plain: bool

    @property
    def in_memory(self) -> bool:
        return self.database in (None, "", ":memory:")

    @property
    def filename(self) -> str:
        """What SQLAlchemy's pysqlite dialect hands ``sqlite3.connect`` (create_connect_args)."""
        return ":memory:" if self.in_memory else os.path.abspath(self.database or "")


def parse_sqlite_url(url: str) -> SqliteUrl | None:
    """The SQLite URL; None for another database or a string that is not a URL."""
    match = _URL.match(url)
    if match is None:
        return None
    backend, _, driver = match["name"].partition("+")
    if backend != "sqlite":
        return None
    # pysqlite refuses a user, password, host or port; options (a query) and other drivers are
    # SQLAlchemy's to interpret.
    located = any(match[part] for part in ("username", "password", "ipv6host", "ipv4host", "port"))
    plain = driver in ("", "pysqlite") and not located and match["query"] is None
    return SqliteUrl(database=match["database"], plain=plain)


class IndexUnusable(CatalogError):
    """The index cannot be read or written; ``corrupt`` when its SQLite file is garbled.

    ``cause`` is the database driver's own error."""

    def __init__(self, url: str, cause: BaseException) -> None:
        # The driver's first line is enough.
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
    parsed = parse_sqlite_url(url)
    if parsed is None or parsed.in_memory:
        return None
    return Path(parsed.database or "")


def _shown(url: str) -> str:
    """The URL without its password."""
    parsed = parse_sqlite_url(url)
    if parsed is not None and parsed.plain:
        return url  # no password; SQLAlchemy renders it unchanged
    from data_catalog.index_sqlalchemy import shown

    return shown(url)


class _Backend(Protocol):
    """What the index does, on one kind of database; it raises the driver's ``errors``."""

    @property
    def errors(self) -> tuple[type[Exception], ...]: ...
    def cause(self, exc: BaseException) -> BaseException: ...
    def close(self) -> None: ...
    def ensure_tables(self) -> bool: ...
    def record(self, manifest: Manifest, manifest_path: str) -> None: ...
    def rebuild(self, manifests: Callable[[], Iterable[tuple[Manifest, str]]]) -> int: ...
    def entries(self) -> set[tuple[str, str]]: ...
    def search(self, *, kind: str | None, parent: ParentRef | None) -> list[tuple[str, str]]: ...


class Index:
    """Versions and their parents in an SQL database; connects on first use.

    Every database error is raised as an :class:`IndexUnusable` (a :class:`CatalogError`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._backend: _Backend | None = None

    @property
    def backend(self) -> _Backend:
        if self._backend is None:
            parsed = parse_sqlite_url(self.url)
            if parsed is not None and parsed.plain:
                self._backend = SqliteIndex(self.url, parsed)
            else:
                from data_catalog.index_sqlalchemy import SqlAlchemyIndex

                self._backend = SqlAlchemyIndex(self.url, sqlite_timeout_s=SQLITE_BUSY_TIMEOUT_S)
        return self._backend

    @contextmanager
    def _errors(self) -> Iterator[_Backend]:
        backend = self.backend
        try:
            yield backend
        except backend.errors as exc:
            raise IndexUnusable(self.url, backend.cause(exc)) from exc

    def ensure_tables(self) -> bool:
        """Create missing tables; True if the versions table was missing (index must be rebuilt)."""
        with self._errors() as backend:
            return backend.ensure_tables()

    def remove_garbled_file(self) -> bool:
        """Delete a SQLite index file that is not a database (and its journals), so that it can
        be built afresh; False if the index is not a SQLite file."""
        path = _sqlite_path(self.url)
        if path is None:
            return False
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        log.warning("catalog index %s is garbled; rebuilding it from the manifests", path)
        for suffix in ("", "-journal", "-wal", "-shm"):
            path.with_name(path.name + suffix).unlink(missing_ok=True)
        return True

    def record(self, manifest: Manifest, manifest_path: str) -> None:
        """Insert or replace one version."""
        with self._errors() as backend:
            backend.record(manifest, manifest_path)

    def rebuild(self, manifests: Callable[[], Iterable[tuple[Manifest, str]]]) -> int:
        """Replace the whole index with ``manifests()``; returns how many versions it holds.

        The delete runs first so that the transaction holds the write lock while the manifests
        are read: a version committed meanwhile is either read here or recorded after us.
        """
        with self._errors() as backend:
            return backend.rebuild(manifests)

    def entries(self) -> set[tuple[str, str]]:
        """Every ``(name, version)`` in the index."""
        with self._errors() as backend:
            return backend.entries()

    def search(self, *, kind: str | None, parent: ParentRef | None) -> list[tuple[str, str]]:
        """``(name, version)`` of the versions of ``kind`` with ``parent``, either if None."""
        with self._errors() as backend:
            return backend.search(kind=kind, parent=parent)


class SqliteIndex:
    """The index's backend in a SQLite database, through the standard library's ``sqlite3``.

    A file database gets a connection per call (as SQLAlchemy's NullPool gave), so that a forked
    worker never shares one; an in-memory database lives in one connection per process, held
    under a lock (a connection per call would give every call an empty database)."""

    errors = (sqlite3.Error,)

    def __init__(self, url: str, parsed: SqliteUrl) -> None:
        self.url = url
        self._parsed = parsed
        self._memory: tuple[int, sqlite3.Connection] | None = None
        self._memory_lock = threading.RLock()

    def _open(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; writes BEGIN IMMEDIATE themselves.
        return sqlite3.connect(
            self._parsed.filename,
            timeout=SQLITE_BUSY_TIMEOUT_S,
            isolation_level=None,
            check_same_thread=not self._parsed.in_memory,
        )

    @staticmethod
    def cause(exc: BaseException) -> BaseException:
        return exc

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        if not self._parsed.in_memory:
            conn = self._open()
            try:
                yield conn
            finally:
                conn.close()
            return
        with self._memory_lock:
            if self._memory is None or self._memory[0] != os.getpid():
                # A forked child starts its own (empty) index, rebuilt from the manifests.
                self._memory = (os.getpid(), self._open())
            yield self._memory[1]

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that holds the write lock from its start."""
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:  # SQLite rolls some errors back itself
                    conn.rollback()
                raise
            conn.execute("COMMIT")

    def close(self) -> None:
        with self._memory_lock:
            if self._memory is not None and self._memory[0] == os.getpid():
                self._memory[1].close()
            self._memory = None

    def ensure_tables(self) -> bool:
        with self._connection() as conn:
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'versions'"
            ).fetchone()
            # IF NOT EXISTS: another process may create them between our check and here.
            for table in SQLITE_TABLES:
                conn.execute(table)
        return found is None

    def record(self, manifest: Manifest, manifest_path: str) -> None:
        with self._transaction() as conn:
            # Delete-then-insert, as the SQLAlchemy backend does it.
            for table in ("parents", "versions"):
                conn.execute(
                    f"DELETE FROM {table} WHERE name = ? AND version = ?",
                    (manifest.name, manifest.version),
                )
            _insert(conn, manifest, manifest_path)

    def rebuild(self, manifests: Callable[[], Iterable[tuple[Manifest, str]]]) -> int:
        count = 0
        with self._transaction() as conn:
            conn.execute("DELETE FROM parents")
            conn.execute("DELETE FROM versions")
            for manifest, path in manifests():
                _insert(conn, manifest, path)
                count += 1
        return count

    def entries(self) -> set[tuple[str, str]]:
        with self._connection() as conn:
            return {(n, v) for n, v in conn.execute("SELECT name, version FROM versions")}

    def search(self, *, kind: str | None, parent: ParentRef | None) -> list[tuple[str, str]]:
        sql = "SELECT versions.name, versions.version FROM versions"
        where: list[str] = []
        values: list[str] = []
        if kind is not None:
            where.append("versions.kind = ?")
            values.append(kind)
        if parent is not None:
            sql += (
                " JOIN parents ON parents.name = versions.name"
                " AND parents.version = versions.version"
            )
            where += ["parents.parent_name = ?", "parents.parent_version = ?"]
            values += [parent.name, parent.version]
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY versions.created, versions.version"
        with self._connection() as conn:
            return [(n, v) for n, v in conn.execute(sql, values)]


def _insert(conn: sqlite3.Connection, manifest: Manifest, manifest_path: str) -> None:
    conn.execute(
        "INSERT INTO versions (name, version, kind, created, rows, code_version, manifest_path)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            manifest.name,
            manifest.version,
            manifest.kind,
            manifest.created,
            manifest.rows,
            manifest.code_version,
            manifest_path,
        ),
    )
    # A parent listed twice is one edge.
    parents = sorted({(p.name, p.version) for p in manifest.parents})
    conn.executemany(
        "INSERT INTO parents (name, version, parent_name, parent_version) VALUES (?, ?, ?, ?)",
        [(manifest.name, manifest.version, n, v) for n, v in parents],
    )
