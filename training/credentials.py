"""Secrets reach the ranks through a file only this user can read, never a command line.

horovodrun starts every rank with its whole environment spelled out on the rank's command
line (``env K=V ... python -m training.worker``, through ``ssh`` for a remote host): anyone who
can list processes on either host reads an object store's secret key there. So:

    launcher     the environment's secrets (:func:`secret_variables`) into
                 ``<run folder>/.rank-credentials.json`` (0600; the run folder is on storage
                 every host sees), named to the ranks by ``SHARDFLOW_RANK_CREDENTIALS``;
                 removed when horovodrun ends
    horovodrun   (training.horovodrun) spells no secret on a command line
                 (:func:`withhold_from_command_lines`); ranks on its own host inherit them
    each rank    loads the file first thing (:func:`load`, training.worker.main)

A launcher killed outright leaves the file in the run folder until the next run there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

from data_catalog.errors import ShardflowError

FILE_VARIABLE = "SHARDFLOW_RANK_CREDENTIALS"
FILE_NAME = ".rank-credentials.json"
# Variables that hold a secret (re.match, whole name). Horovod's own key is its business.
SECRET_PATTERNS = (
    r"AWS_SECRET_ACCESS_KEY$",
    r"AWS_SESSION_TOKEN$",
    r"AWS_SECURITY_TOKEN$",
    r"AZURE_STORAGE_(ACCOUNT_)?KEY$",
    r"AZURE_STORAGE_SAS_TOKEN$",
    r"(?!HOROVOD_).*_SECRET(_KEY)?$",
    r"(?!HOROVOD_).*_PASSWORD$",
    r"(?!HOROVOD_).*_TOKEN$",
)
_SECRET = re.compile("|".join(f"(?:{p})" for p in SECRET_PATTERNS))


def is_secret(name: str) -> bool:
    return _SECRET.match(name) is not None


def secret_variables(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if is_secret(k)}


@contextlib.contextmanager
def credentials_file(run_dir: Path, environ: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """For as long as the ranks run: the secrets of ``environ`` in a file of ``run_dir`` that
    only this user can read; yields what to add to horovodrun's environment (nothing when
    there is no secret). The file goes when the block ends."""
    secrets = secret_variables(environ)
    path = run_dir / FILE_NAME
    path.unlink(missing_ok=True)  # a killed launcher's
    if not secrets:
        yield {}
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(secrets, f)
        yield {FILE_VARIABLE: str(path)}
    finally:
        path.unlink(missing_ok=True)


def load(environ: MutableMapping[str, str] = os.environ) -> None:
    """In a rank: the launcher's secrets into this process's environment (a rank on another
    host has none of them otherwise)."""
    where = environ.get(FILE_VARIABLE)
    if not where:
        return
    try:
        secrets = json.loads(Path(where).read_text())
    except OSError as exc:
        raise ShardflowError(
            f"this rank cannot read the run's credentials at {where} ({exc.strerror}): the run "
            "folder (SHARDFLOW_HOME) must be on storage every host shares (docs/cluster.md)"
        ) from None
    for name, value in secrets.items():
        environ.setdefault(name, value)


def withhold_from_command_lines() -> None:
    """In horovodrun: no secret variable on the command lines it starts ranks with
    (``horovod.runner.common.util.env.is_exportable`` is what decides)."""
    from horovod.runner.common.util import env as env_util

    env_util.IGNORE_REGEXES.update(SECRET_PATTERNS)
