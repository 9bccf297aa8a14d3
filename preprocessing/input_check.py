"""Preprocessing reads only raw bytes that are what the raw version's manifest says.

    raw version (manifest: each file's size and sha256)
        │  plan (reads manifests, and SDSS Parquet footers: a footer that does not parse
        │  has the raw version verified, to name the damaged file)
        ▼
    the job, wrapped: pass "verify" first, one task per raw file the job's tasks will read
    (an SDSS version grown from an earlier one: only the files of the new pieces), each
    streaming the file where the catalog keeps it (a path, an s3:// object) and comparing
    its size and sha256 with the manifest's
        │  any difference: a ShardflowError naming the file; nothing is written or committed
        ▼
    the job's own passes, then its commit

``train`` does the same for processed versions (``training/verify_input.py``). The cost is one
read of what the job reads (page-cached for its own pass that follows on a local root).
Orchestration (``preprocessing.fingerprint.ORCHESTRATION``): nothing here shapes the bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest, Staging
from data_catalog.errors import ShardflowError
from preprocessing.driver import Job, Result, Results, TaskSpec

VERIFY = "verify"
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One raw file a job reads, as its manifest records it."""

    url: str
    """Where the catalog keeps its bytes (a local path or an object-store URL)."""
    bytes: int
    sha256: str
    version: str
    """``name@version`` of the raw version, for the message."""


class RawInputDamaged(ShardflowError):
    """A raw file preprocessing would read is not what its version's manifest says."""


def _damaged(version: str, location: str, reason: str) -> RawInputDamaged:
    # The message alone is the exception's argument: it comes back from a Dask worker pickled.
    return RawInputDamaged(
        f"{version} is not what its manifest says: {location}: {reason}; nothing was "
        f"preprocessed (see `shardflow catalog verify {version}`)"
    )


def check_input(file: InputFile) -> Result:
    """Verify task: stream ``file`` and compare its size and sha256 with the manifest's."""
    sha = hashlib.sha256()
    size = 0
    try:
        with _open(file.url) as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise _damaged(file.version, file.url, "missing") from None
    if size != file.bytes:
        raise _damaged(file.version, file.url, f"size {size} != manifest {file.bytes}")
    if sha.hexdigest() != file.sha256:
        raise _damaged(file.version, file.url, "sha256 mismatch")
    return {"path": file.url, "bytes": size}


def _open(url: str) -> Any:
    if "://" in url and not url.startswith("file://"):
        import fsspec

        return fsspec.open(url, "rb").open()
    return open(url.removeprefix("file://"), "rb")


def raw_files(catalog: Catalog, raw: Manifest) -> list[InputFile]:
    """Every file of ``raw``, where its bytes are."""
    return [
        InputFile(
            url=catalog.file_url(raw, entry),
            bytes=entry.bytes,
            sha256=entry.sha256,
            version=f"{raw.name}@{raw.version}",
        )
        for entry in raw.files
    ]


def verified(catalog: Catalog, raw: Manifest, job: Job, reads: Iterable[str]) -> VerifiedInputs:
    """``job`` verifying first the files of ``raw`` at ``reads``, and any other file of
    ``raw`` that a later pass's task reads before that pass."""
    files = raw_files(catalog, raw)
    wanted = set(reads)
    return VerifiedInputs(job, [f for f in files if f.url in wanted], files)


def refuse_if_damaged(catalog: Catalog, raw: Manifest) -> None:
    """Verify the whole raw version (a planner could not parse one of its files): raise
    :class:`RawInputDamaged` naming the first damaged file; return if every file is intact."""
    problems = catalog.verify(raw.name, raw.version)
    if problems:
        raise _damaged(f"{raw.name}@{raw.version}", problems[0].path, problems[0].reason)


class VerifiedInputs:
    """``job`` with a first pass that verifies ``inputs`` (a :class:`driver.Job`).

    A later pass's task that reads a raw file of ``raw_files`` no verify task has checked (an
    SDSS piece an earlier version holds, rescanned because new rows repeat its keys) has that
    file verified here, in the driver, before the pass runs."""

    def __init__(self, job: Job, inputs: Sequence[InputFile], raw_files: Sequence[InputFile]):
        self.job = job
        self.inputs = tuple(inputs)
        self._raw = {file.url: file for file in raw_files}
        self._verified = {file.url for file in self.inputs}

    def __getattr__(self, name: str) -> Any:
        # name, version, work_key, kind and whatever else callers read of the job.
        return getattr(self.job, name)

    @property
    def passes(self) -> tuple[str, ...]:
        return (VERIFY, *self.job.passes)

    def kept(self, pass_name: str, done: Results) -> Sequence[Result]:
        kept = getattr(self.job, "kept", None)
        if pass_name == VERIFY or kept is None:
            return []
        return list(kept(pass_name, _without_verify(done)))

    def tasks(self, pass_name: str, done: Results, work: Path) -> Sequence[TaskSpec]:
        if pass_name == VERIFY:
            return [
                # hashlib and file reads release the GIL: threads will do (cluster.py).
                TaskSpec(
                    key=f"verify-{number:05d}",
                    fn=check_input,
                    args=(file,),
                    bytes=file.bytes,
                    threads=True,
                )
                for number, file in enumerate(self.inputs)
            ]
        tasks = self.job.tasks(pass_name, _without_verify(done), work)
        for url in sorted(_locations_read(tasks) & set(self._raw) - self._verified):
            check_input(self._raw[url])
            self._verified.add(url)
        return tasks

    def commit(self, stage: Staging, done: Results, work: Path) -> Manifest:
        return self.job.commit(stage, _without_verify(done), work)


def _locations_read(tasks: Sequence[TaskSpec]) -> set[str]:
    """What the tasks' arguments name as the files they read: a raw piece's ``path``, a raw
    part's ``paths``."""
    found: set[str] = set()
    for spec in tasks:
        for arg in spec.args:
            path = getattr(arg, "path", None)
            if isinstance(path, str):
                found.add(path)
            found.update(p for p in getattr(arg, "paths", ()) if isinstance(p, str))
    return found


def _without_verify(done: Results) -> Results:
    return {name: results for name, results in done.items() if name != VERIFY}
