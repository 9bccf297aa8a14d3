"""The default SQLite index on the standard library's sqlite3: it reads URLs as SQLAlchemy does,
keeps SQLAlchemy's tables and answers, and spares the catalog SQLAlchemy's import."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from data_catalog import Catalog, Manifest, ParentRef
from data_catalog.index import SQLITE_BUSY_TIMEOUT_S, Index, IndexUnusable, parse_sqlite_url
from data_catalog.index_sqlalchemy import SqlAlchemyIndex
from preprocessing.sources.synth import write_sdss_exports

ROOT = Path(__file__).resolve().parents[2]

URLS = [
    "sqlite://",
    "sqlite:///:memory:",
    "sqlite:///index.sqlite",
    "sqlite:///relative/dir/index.sqlite",
    "sqlite:////abs/path/index.sqlite",
    "sqlite:////abs/with space/and%20quote.db",
    "sqlite+pysqlite:////abs/index.sqlite",
    "sqlite:///index.sqlite?timeout=5",
    "sqlite:///file:index.sqlite?mode=ro&uri=true",
    "sqlite+aiosqlite:////abs/index.sqlite",
    "sqlite://host/index.sqlite",
    "sqlite://user:secret@/index.sqlite",
    "postgresql+psycopg2://user:secret@127.0.0.1:5432/shardflow",
    "mysql://user@127.0.0.1:1/shardflow",
]


@pytest.mark.parametrize("url", URLS)
def test_urls_mean_what_they_mean_to_sqlalchemy(url: str) -> None:
    parsed = parse_sqlite_url(url)
    sa_url = sa.make_url(url)
    if sa_url.get_backend_name() != "sqlite":
        assert parsed is None
        return
    assert parsed is not None
    assert parsed.database == sa_url.database
    if not parsed.plain:
        return  # served by SQLAlchemy itself
    assert sa_url.get_driver_name() == "pysqlite" and not sa_url.query
    # The file sqlite3 opens is the one SQLAlchemy's pysqlite dialect would open.
    engine = sa.create_engine(url)
    (filename,), _ = engine.dialect.create_connect_args(sa_url)
    assert parsed.filename == filename
    assert sa_url.render_as_string(hide_password=True) == url  # shown as it is written


def _commit(
    catalog: Catalog, name: str, kind: str, text: str, parents: tuple[ParentRef, ...] = ()
) -> Manifest:
    with catalog.stage(name, kind=kind) as stage:
        (stage.path / "data.txt").write_text(text)
        return stage.commit(
            parents=parents, parameters={"text": text}, rows=1, file_rows={"data.txt": 1}
        )


def _lineage(catalog: Catalog) -> list[Manifest]:
    raw = _commit(catalog, "raw-set", "raw", "a")
    other = _commit(catalog, "other-raw", "raw", "b")
    first = _commit(catalog, "raw-set-processed", "processed", "c", (raw.ref,))
    both = _commit(catalog, "raw-set-processed", "processed", "d", (raw.ref, other.ref, raw.ref))
    return [raw, other, first, both]


def _tables(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()


def test_sqlite3_and_sqlalchemy_keep_the_same_tables_and_answers(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")  # the default index: sqlite3
    manifests = _lineage(catalog)
    ours = Index(f"sqlite:///{tmp_path / 'catalog' / 'index.sqlite'}")
    theirs = SqlAlchemyIndex(
        f"sqlite:///{tmp_path / 'sa.sqlite'}", sqlite_timeout_s=SQLITE_BUSY_TIMEOUT_S
    )
    assert theirs.ensure_tables() is True and theirs.ensure_tables() is False
    where = {m.ref: catalog.manifest_location(m.name, m.version) for m in manifests}
    assert theirs.rebuild(lambda: [(m, where[m.ref]) for m in manifests]) == 4

    assert _tables(tmp_path / "catalog" / "index.sqlite") == _tables(tmp_path / "sa.sqlite")
    assert len(ours.entries()) == 4 and ours.entries() == theirs.entries()
    raw, other = manifests[0].ref, manifests[1].ref
    queries = [(None, None), ("raw", None), ("processed", raw), (None, other), ("model", None)]
    for kind, parent in queries:
        assert ours.search(kind=kind, parent=parent) == theirs.search(kind=kind, parent=parent)
    assert [v for _, v in ours.search(kind=None, parent=raw)] == [
        manifests[2].version,
        manifests[3].version,
    ]
    with sqlite3.connect(tmp_path / "catalog" / "index.sqlite") as db:
        rows = db.execute("SELECT * FROM versions ORDER BY created, version").fetchall()
    with sqlite3.connect(tmp_path / "sa.sqlite") as db:
        assert rows == db.execute("SELECT * FROM versions ORDER BY created, version").fetchall()
    theirs.close()


def test_rebuild_holds_the_write_lock_while_it_reads_the_manifests(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    manifests = _lineage(catalog)
    path = tmp_path / "catalog" / "index.sqlite"
    seen: list[str] = []

    def reading() -> list[tuple[Manifest, str]]:
        # Another process trying to record a version now waits (here: gives up at once).
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            sqlite3.connect(path, timeout=0, isolation_level=None).execute("BEGIN IMMEDIATE")
        seen.append("locked")
        return [(m, "m.json") for m in manifests[:2]]

    assert Index(f"sqlite:///{path}").rebuild(reading) == 2
    assert seen == ["locked"]
    assert catalog.reindex() == 4


def test_a_failed_rebuild_leaves_the_index_as_it_was(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    _lineage(catalog)
    index = Index(f"sqlite:///{tmp_path / 'catalog' / 'index.sqlite'}")
    before = index.entries()

    def failing() -> list[tuple[Manifest, str]]:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        index.rebuild(failing)
    assert index.entries() == before and len(before) == 4


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_index_answers_within_its_process(tmp_path: Path, url: str) -> None:
    catalog = Catalog(tmp_path / "catalog", index_url=url)
    raw, _, first, both = _lineage(catalog)
    assert not (tmp_path / "catalog" / "index.sqlite").exists()
    assert [m.version for m in catalog.search(parent=raw.ref)] == [first.version, both.version]
    assert catalog.reindex() == 4


def test_a_sqlite_url_with_options_goes_through_sqlalchemy(tmp_path: Path) -> None:
    path = tmp_path / "idx.sqlite"
    catalog = Catalog(tmp_path / "catalog", index_url=f"sqlite:///{path}?timeout=5")
    raw, _, first, both = _lineage(catalog)
    assert [m.version for m in catalog.search(parent=raw.ref)] == [first.version, both.version]
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM parents").fetchone() == (3,)


def test_index_errors_keep_their_one_line_and_remedy(tmp_path: Path) -> None:
    folder = tmp_path / "index.sqlite"
    folder.mkdir()
    with pytest.raises(IndexUnusable, match=f"{folder} is a directory: remove it") as info:
        Index(f"sqlite:///{folder}").ensure_tables()
    assert not info.value.corrupt and "\n" not in str(info.value)

    garbled = tmp_path / "garbled.sqlite"
    garbled.write_bytes(b"not a database at all" * 400)
    index = Index(f"sqlite:///{garbled}")
    with pytest.raises(IndexUnusable, match=r"file is not a database\); run `shardflow catalog"):
        index.ensure_tables()
    with pytest.raises(IndexUnusable) as info:
        index.entries()
    assert info.value.corrupt
    assert index.remove_garbled_file() and not garbled.exists()
    assert index.ensure_tables() is True and index.entries() == set()


def _python(code: str, cwd: Path, **env: str) -> str:
    """The last line a fresh interpreter prints, running ``code`` with this checkout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(cwd), **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_catalog_imports_no_sqlalchemy(tmp_path: Path) -> None:
    code = "import sys, data_catalog.catalog; print('sqlalchemy' in sys.modules)"
    assert _python(code, tmp_path) == "False"


def test_a_whole_sdss_ingest_imports_no_sqlalchemy(tmp_path: Path) -> None:
    write_sdss_exports(tmp_path / "exports", rows=3000, files=2, fmt="csv", seed=5)
    code = f"""
        import sys
        from flows.cli import main
        sys.argv = ["shardflow", "ingest", "sdss", "--source", {str(tmp_path / "exports")!r}]
        try:
            main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        from data_catalog import Catalog
        [raw] = Catalog({str(tmp_path / "home" / "catalog")!r}).search(kind="raw")
        print(raw.rows, 'sqlalchemy' in sys.modules)
    """
    home = str(tmp_path / "home")
    assert _python(code, tmp_path, SHARDFLOW_HOME=home) == "3000 False"


def test_a_parent_given_twice_is_one_edge(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog")
    raw, other, _, both = _lineage(catalog)
    with sqlite3.connect(tmp_path / "catalog" / "index.sqlite") as db:
        edges = db.execute(
            "SELECT parent_name, parent_version FROM parents WHERE version = ?", (both.version,)
        ).fetchall()
    assert sorted(edges) == sorted([(raw.name, raw.version), (other.name, other.version)])
