"""The catalog index on a shared PostgreSQL server (a real one, started on loopback)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from data_catalog import Catalog, Manifest
from data_catalog.index import versions_table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(*command: str) -> None:
    # PostgreSQL refuses to run as root; the tests may run as root (CI does).
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*prefix, *command], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not binaries:
        pytest.fail("PostgreSQL's server is missing: run `make test` (it installs postgresql)")
    bin_dir = Path(binaries[-1]).parent
    # Outside pytest's private tmp tree: the postgres user must be able to reach it.
    data = Path(tempfile.mkdtemp(prefix="shardflow-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(data, user.pw_uid, user.pw_gid)
    port = _free_port()
    _as_postgres(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    _as_postgres(
        str(bin_dir / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(data / "server.log"),
        "-w",
        "-o",
        f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
        "start",
    )
    try:
        admin = sa.create_engine(
            f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres",
            isolation_level="AUTOCOMMIT",
        )
        with admin.connect() as conn:
            conn.execute(sa.text("CREATE DATABASE shardflow"))
        admin.dispose()
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/shardflow"
    finally:
        _as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop")
        shutil.rmtree(data, ignore_errors=True)


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
