"""A throwaway PostgreSQL cluster of Debian's server on a free loopback port, for the tests
that need a real one (`make test` installs the `postgresql` package)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port


def _as_postgres(*command: str) -> None:
    # PostgreSQL refuses to run as root; the tests may run as root (CI does).
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*prefix, *command], check=True, capture_output=True, timeout=120)


@dataclass(frozen=True)
class Postgres:
    port: int
    user: str
    password: str
    bin_dir: Path
    data: Path

    def psql(self, database: str, sql: str) -> str:
        """``sql`` run by psql in ``database``; its rows, unaligned, one a line."""
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [
                *prefix,
                str(self.bin_dir / "psql"),
                *("-h", str(self.data), "-p", str(self.port), "-U", self.user),
                *("-d", database, "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout


@contextmanager
def postgres_server(password: str = "shardflow-test") -> Iterator[Postgres]:
    """A PostgreSQL server on 127.0.0.1: connections over TCP need the password of user
    ``postgres`` (SCRAM), as a deployed server's do; the Unix socket in its data folder trusts
    the local user. Stopped and removed when the block ends."""
    binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not binaries:
        pytest.fail("PostgreSQL's server is missing: run `make test` (it installs postgresql)")
    bin_dir = Path(binaries[-1]).parent
    # Outside pytest's private tmp tree: the postgres user must be able to reach it.
    data = Path(tempfile.mkdtemp(prefix="shardflow-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(data, user.pw_uid, user.pw_gid)
    port = free_port()
    secret = data / "password"
    secret.write_text(password + "\n")
    if os.geteuid() == 0:
        os.chown(secret, user.pw_uid, user.pw_gid)
    _as_postgres(
        str(bin_dir / "initdb"),
        *("-D", str(data / "cluster"), "-U", "postgres", "--pwfile", str(secret)),
        *("--auth-local", "trust", "--auth-host", "scram-sha-256"),
    )
    _as_postgres(
        str(bin_dir / "pg_ctl"),
        *("-D", str(data / "cluster"), "-l", str(data / "server.log"), "-w"),
        *("-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1"),
        "start",
    )
    try:
        yield Postgres(port=port, user="postgres", password=password, bin_dir=bin_dir, data=data)
    finally:
        _as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data / "cluster"), "-m", "fast", "stop")
        shutil.rmtree(data, ignore_errors=True)
