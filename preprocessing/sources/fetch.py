"""Fetch one URL or local path to a file: retries with backoff, HTTP Range resume, progress,
sha256 while streaming, and an optional download cache. Every source fetches through here.

url ── cache given and the source's state known (size, mtime / ETag / Last-Modified)?
    │      a whole entry fetched before from this state, digest checked: placed, not fetched
    │  http(s): urllib, one GET per attempt
    │      transient failure (connection reset or cut short, timeout, HTTP 5xx / 408 / 429)?
    │      wait (sources/retry.py: backoff doubling + jitter, at least the Retry-After a
    │      429 or 503 names), then ask for the rest with "Range: bytes=<have>-";
    │      a server that answers 200 instead of 206 sends everything again: start over
    │  other fsspec URLs and local paths (file://, s3://, /data/...): streamed copy,
    │      retried from the start
    ▼
<name>.<host>.<pid>.<token>.part ── this process's own partial file, hashed as it is written
    │  renamed only when whole (size checked against the server's length)
    ▼
dest (and the cache entry <url key>-<state key> with its <entry>.sha256)

Fetched(sha256, size); on any refusal neither dest nor a partial file is left behind. Two
processes fetching the same URL into one cache each write their own partial file; the last
rename wins and both get the whole file.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import secrets
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, NamedTuple

from preprocessing.sources.errors import SourceError
from preprocessing.sources.retry import (
    RetryPolicy,
    ServerAsksTooLong,
    Transient,
    is_transient_status,
    retry_after_seconds,
)

__all__ = ["DownloadError", "Fetched", "fetch", "forget", "sha256_file", "sweep_cache"]

Progress = Callable[[str], None]

_CHUNK = 1 << 16
# Seconds between progress messages when the size is unknown or the transfer is slow.
_PROGRESS_SECONDS = 5.0
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
# What fsspec's info() may tell of a file's current state, by filesystem.
_STATE_FIELDS = ("size", "mtime", "ETag", "etag", "LastModified", "Last-Modified")


class DownloadError(SourceError):
    """A URL could not be fetched whole; the message names the URL and the last failure."""


class Fetched(NamedTuple):
    """What was fetched: the sha256 (hex) and the size in bytes of the file at dest."""

    sha256: str
    size: int


class _Reporter:
    """Progress every ~10% of the size (when known) or every 5 s, whichever comes first."""

    def __init__(self, url: str, progress: Progress) -> None:
        self.url = url
        self.progress = progress
        self.last_time = time.monotonic()
        self.last_tenth = -1

    def update(self, have: int, total: int | None) -> None:
        now = time.monotonic()
        tenth = have * 10 // total if total else -1
        if (total and tenth > self.last_tenth) or now - self.last_time >= _PROGRESS_SECONDS:
            of = f" of {total:,} ({100 * have // total}%)" if total else ""
            self.progress(f"{self.url}: {have:,} bytes{of}")
            self.last_time = now
            self.last_tenth = max(tenth, self.last_tenth)


class _Partial:
    """The file one transfer writes before it is whole, and the sha256 of the bytes it holds."""

    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self.path = path
        self.size = 0
        self._digest = hashlib.sha256()
        self._file: IO[bytes] | None = None

    def held(self) -> int:
        """Bytes already held that a resume may keep: all of them when the digest covers
        exactly what is on disk, else none (the transfer then starts over)."""
        try:
            on_disk = self.path.stat().st_size
        except FileNotFoundError:
            on_disk = 0
        if on_disk != self.size:
            self.discard()
        return self.size

    def open(self, *, append: bool) -> None:
        """Start writing: after the bytes held when ``append``, else from the beginning."""
        if not append:
            self.size, self._digest = 0, hashlib.sha256()
        try:
            # Held across write() calls; the attempts close it in a finally (close()).
            self._file = open(self.path, "ab" if append else "wb")  # noqa: SIM115
        except OSError as exc:
            raise self._cannot_write(exc) from exc

    def write(self, chunk: bytes) -> None:
        assert self._file is not None, "write before open"
        try:
            self._file.write(chunk)
        except OSError as exc:
            raise self._cannot_write(exc) from exc
        self._digest.update(chunk)
        self.size += len(chunk)

    def close(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            file.close()
        except OSError as exc:
            raise self._cannot_write(exc) from exc

    def discard(self) -> None:
        """Forget what is held: the next transfer starts from the beginning."""
        file, self._file = self._file, None
        if file is not None:
            file.close()
        self.path.unlink(missing_ok=True)
        self.size, self._digest = 0, hashlib.sha256()

    def fetched(self) -> Fetched:
        return Fetched(self._digest.hexdigest(), self.size)

    def _cannot_write(self, exc: OSError) -> DownloadError:
        # Not retried: a full disk or a missing folder stays so on the next attempt.
        return DownloadError(f"{self.url}: cannot write {self.path}: {exc}")


def sha256_file(path: Path) -> tuple[str, int]:
    """(sha256 hex, bytes) of a local file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def fetch(
    url: str,
    dest: Path,
    *,
    cache: Path | None = None,
    progress: Progress = lambda _msg: None,
    timeout: float = 60.0,
    attempts: int = 4,
    backoff: float = 1.0,
) -> Fetched:
    """Fetch ``url`` (any fsspec URL or a local path) into ``dest``; returns its sha256 and size.

    http(s) transfers cut short resume with a Range request where the server allows it;
    ``attempts`` counts tries in all, waiting ``backoff`` seconds before the second and twice as
    long before each next one. ``timeout`` bounds each connect and each read, not the whole
    transfer. Other URLs go through fsspec and restart from the beginning on failure.

    With ``cache`` (a directory), a file fetched whole before is placed from there instead
    (hard-linked where the filesystem allows, else copied) while the source's size and
    modification stamp (or ETag) are unchanged; a source that tells neither is not cached.
    Call :func:`forget` once the bytes are kept elsewhere.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    dest = Path(dest)

    def transfer(partial: Path) -> Fetched:
        return _transfer(
            url, partial, timeout=timeout, attempts=attempts, backoff=backoff, progress=progress
        )

    key = _entry_key(url) if cache is not None else None
    if cache is None or key is None:
        partial = _partial_path(dest)
        try:
            fetched = transfer(partial)
            _publish(url, partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    else:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DownloadError(f"{url}: cannot use the download cache {cache}: {exc}") from exc
        _sweep(cache, url)
        entry, record = cache / key, cache / f"{key}.sha256"
        reused = _reuse(url, entry, record, dest)
        if reused is not None:
            progress(f"reused {url} from the download cache")
            return reused
        partial = _partial_path(entry)
        try:
            fetched = transfer(partial)
            _place(url, partial, dest)
            try:
                # Whole or absent under its name: a crash leaves at most this partial file.
                _publish(url, partial, entry)
                _write_atomically(url, record, fetched.sha256 + "\n")
            except DownloadError:
                dest.unlink(missing_ok=True)
                raise
        finally:
            partial.unlink(missing_ok=True)
    progress(f"{url}: fetched {fetched.size:,} bytes")
    return fetched


def forget(urls: Iterable[str], *, cache: Path | None) -> None:
    """Drop the cache entries of ``urls`` (every state fetched), once their bytes are kept
    elsewhere, e.g. in a committed catalog version. The partial files of fetches still
    running stay; those of processes that are gone are removed."""
    if cache is None:
        return
    for url in urls:
        for path in cache.glob(f"{_url_key(url)}-*"):
            if not path.name.endswith(".part"):
                path.unlink(missing_ok=True)
        _sweep(cache, url)


def sweep_cache(cache: Path, *, min_age: timedelta) -> list[Path]:
    """Remove the entries of the download ``cache`` not fetched or reused for ``min_age``, and
    its partial files whose process is gone or that were not written to for ``min_age``;
    returns what it removed. Safe next to running fetches: a fetch that finds its entry gone
    fetches again, and files placed from an entry are hard links or copies of it."""
    removed: list[Path] = []
    horizon = time.time() - min_age.total_seconds()
    for path in sorted(cache.iterdir()):
        try:
            stale = path.stat().st_mtime < horizon
        except FileNotFoundError:
            continue
        if path.name.endswith(".part"):
            stale = stale or _abandoned(path)
        if stale and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------
# The download cache


def _url_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def _entry_key(url: str) -> str | None:
    """Names one state of a source: ``<url key>-<state key>``; None when fsspec tells nothing
    of the state (no size, modification time or ETag), so that a change could go unseen."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except (ImportError, OSError, ValueError):
        return None
    state = [info.get(name) for name in _STATE_FIELDS]
    if all(value is None for value in state):
        return None
    return f"{_url_key(url)}-{hashlib.sha256(repr(state).encode()).hexdigest()[:16]}"


def _reuse(url: str, entry: Path, record: Path, dest: Path) -> Fetched | None:
    """The cached entry placed at ``dest`` when whole (its digest as recorded), else None."""
    try:
        expected = record.read_text().strip()
    except OSError:
        return None
    try:
        _place(url, entry, dest)
    except DownloadError:
        if entry.exists():
            raise
        return None  # forgotten by another process meanwhile
    # The placed bytes are checked, not the entry's name: another process may replace it.
    digest, size = sha256_file(dest)
    if digest != expected:
        dest.unlink()
        return None
    # Used now: `sweep_cache` removes the entries unused longest.
    for path in (entry, record):
        with contextlib.suppress(OSError):
            os.utime(path)
    return Fetched(digest, size)


def _sweep(cache: Path, url: str) -> None:
    """Remove the partial files of ``url`` left by processes of this host that are gone."""
    for path in cache.glob(f"{_url_key(url)}-*.part"):
        if _abandoned(path):
            path.unlink(missing_ok=True)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _partial_path(final: Path) -> Path:
    """A name beside ``final`` that no other process or thread writes."""
    return final.with_name(f"{final.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.part")


def _abandoned(partial: Path) -> bool:
    """Whether ``partial`` was written by a process of this host that no longer runs."""
    parts = partial.name.removesuffix(".part").rsplit(".", 3)
    if len(parts) != 4 or parts[1] != _host() or not parts[2].isdigit():
        return False  # another host's (a shared cache): its process cannot be asked
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, someone else's
    return False


def _place(url: str, source: Path, dest: Path) -> None:
    """Put ``source``'s bytes at ``dest`` in one step: hard-linked, or copied across
    filesystems, under a partial name first."""
    partial = _partial_path(dest)
    try:
        try:
            os.link(source, partial)
        except OSError:
            shutil.copyfile(source, partial)
        os.replace(partial, dest)
    except OSError as exc:
        raise DownloadError(f"{url}: cannot write {dest}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)


def _publish(url: str, partial: Path, final: Path) -> None:
    try:
        os.replace(partial, final)
    except OSError as exc:
        raise DownloadError(f"{url}: cannot write {final}: {exc}") from exc


def _write_atomically(url: str, path: Path, text: str) -> None:
    partial = _partial_path(path)
    try:
        try:
            partial.write_text(text)
        except OSError as exc:
            raise DownloadError(f"{url}: cannot write {path}: {exc}") from exc
        _publish(url, partial, path)
    finally:
        partial.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# One transfer, retried


def _transfer(
    url: str, path: Path, *, timeout: float, attempts: int, backoff: float, progress: Progress
) -> Fetched:
    """Fetch ``url`` whole into ``path``, retrying transient failures by the sources' one
    policy (:mod:`preprocessing.sources.retry`: jitter, Retry-After obeyed); each retry of an
    HTTP transfer resumes after the bytes held (the caller removes ``path`` when this raises)."""
    partial = _Partial(url, path)
    reporter = _Reporter(url, progress)
    is_http = url.lower().startswith(("http://", "https://"))

    def attempt(number: int) -> Fetched:
        if is_http:
            _http_attempt(url, partial, timeout=timeout, resume=number > 1, reporter=reporter)
        else:
            _fsspec_attempt(url, partial, reporter=reporter)
        return partial.fetched()

    def on_retry(number: int, failure: Transient, wait: float) -> None:
        have = partial.held() if is_http else 0
        progress(
            f"{url}: {failure} (attempt {number}/{attempts}); retrying in {wait:.1f} s"
            + (f", resuming at byte {have:,}" if have else "")
        )

    try:
        return RetryPolicy(attempts=attempts, backoff=backoff).call(attempt, on_retry=on_retry)
    except ServerAsksTooLong as exc:
        raise DownloadError(f"{url}: {exc}; retry later") from exc
    except Transient as exc:
        raise DownloadError(
            f"{url}: failed {attempts} times, last: {exc}; check the URL and the "
            "network, then retry"
        ) from exc


def _http_attempt(
    url: str, partial: _Partial, *, timeout: float, resume: bool, reporter: _Reporter
) -> None:
    """One GET into ``partial``, resuming after the bytes it holds when ``resume``; raises
    Transient."""
    have = partial.held() if resume else 0
    headers = {"User-Agent": "shardflow", "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response: Any = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and have:
            # Our partial file is at or past the end the server knows: it cannot be trusted.
            partial.discard()
            raise Transient("HTTP 416 on resume; starting over") from exc
        if is_transient_status(exc.code):
            raise Transient(
                f"HTTP {exc.code} {exc.reason}",
                retry_after=retry_after_seconds(exc.headers.get("Retry-After")),
            ) from exc
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise Transient(_describe(exc)) from exc
    with response:
        status = response.status
        if have and status == 206:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
            if match is None or int(match.group(1)) != have:
                partial.discard()
                raise Transient(
                    f"server answered the resume with Content-Range "
                    f"{response.headers.get('Content-Range')!r}; starting over"
                )
            append = True
            total = None if match.group(3) == "*" else int(match.group(3))
        elif status == 200:
            append = False  # no Range support (or ignored): the whole body comes again
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        else:
            raise DownloadError(f"{url}: unexpected HTTP {status} {response.reason}")
        partial.open(append=append)
        try:
            while True:
                try:
                    chunk = response.read(_CHUNK)
                except (OSError, http.client.HTTPException) as exc:
                    raise Transient(f"{_describe(exc)} after {partial.size:,} bytes") from exc
                if not chunk:
                    break
                partial.write(chunk)
                reporter.update(partial.size, total)
        finally:
            partial.close()
    if total is not None and partial.size != total:
        # http.client returns EOF quietly when the peer closes early: check the length here.
        raise Transient(f"connection closed after {partial.size:,} of {total:,} bytes")


def _fsspec_attempt(url: str, partial: _Partial, *, reporter: _Reporter) -> None:
    """One streamed copy of ``url`` into ``partial``, from the beginning; raises Transient."""
    import fsspec

    try:
        with fsspec.open(url, "rb") as src:
            partial.open(append=False)
            try:
                while chunk := src.read(1 << 20):
                    partial.write(chunk)
                    reporter.update(partial.size, None)
            finally:
                partial.close()
    except FileNotFoundError as exc:
        raise DownloadError(f"{url}: no such file") from exc
    except (ImportError, ValueError) as exc:
        raise DownloadError(f"{url}: cannot open: {exc}") from exc
    except OSError as exc:
        raise Transient(_describe(exc)) from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, str):
        exc = exc.reason
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
