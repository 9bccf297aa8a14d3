"""The catalog index on a shared PostgreSQL server (a real one, started on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from data_catalog import Catalog, Manifest
from data_catalog.index_sqlalchemy import versions_table
from tests.postgres_server import postgres_server


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    with postgres_server() as pg:
        pg.psql("postgres", "CREATE DATABASE shardflow")
        yield f"postgresql+psycopg2://{pg.user}:{pg.password}@127.0.0.1:{pg.port}/shardflow"


def _commit(catalog: Catalog, name: str, kind: str, text: str, parents: tuple = ()) -> Manifest:
    with catalog.stage(name, kind=kind) as stage:
        (stage.path / "data.txt").write_text(text)
        return stage.commit(
            parents=parents, parameters={"text": text}, rows=1, file_rows={"data.txt": 1}
        )


def test_two_catalog_clients_share_one_postgres_index(postgres_url: str, tmp_path: Path) -> None:
    root = tmp_path / "catalog"
    writer = Catalog(root, index_url=postgres_url)
    raw = _commit(writer, "raw-set", "raw", "a")
    processed = _commit(writer, "raw-set-processed", "processed", "b", (raw.ref,))
    _commit(writer, "raw-set-processed", "processed", "c", (raw.ref,))

    reader = Catalog(root, index_url=postgres_url)  # another client of the same server
    assert [m.version for m in reader.search(kind="raw")] == [raw.version]
    children = reader.search(parent=raw.ref)
    assert processed.version in {m.version for m in children}
    assert len(children) == 2

    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(versions_table)).scalar() == 3
        conn.execute(versions_table.delete())  # the index is a cache: lose it
    assert reader.reindex() == 3
    with engine.connect() as conn:
        names = sorted(r.name for r in conn.execute(sa.select(versions_table.c.name)))
    assert names == ["raw-set", "raw-set-processed", "raw-set-processed"]
    engine.dispose()
