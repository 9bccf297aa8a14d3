"""Download one URL to a file: retries with backoff, HTTP Range resume, progress, sha256.

url ── http(s): urllib, one GET per attempt
    │  transient failure (connection reset or cut short, timeout, HTTP 5xx / 408 / 429)?
    │      wait (backoff doubling), then ask for the rest with "Range: bytes=<have>-";
    │      a server that answers 200 instead of 206 sends everything again: start over
    │  other fsspec URLs (file://, s3://, ...): streamed copy, retried from the start
    ▼
dest.part ── renamed to dest only when whole (size checked against the server's length)
    ▼
(sha256, bytes) of dest; on any refusal neither dest nor dest.part is left behind
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from preprocessing.sources.mnist import SourceError

__all__ = ["DownloadError", "download"]

Progress = Callable[[str], None]

_CHUNK = 1 << 16
# Seconds between progress messages when the size is unknown or the transfer is slow.
_PROGRESS_SECONDS = 5.0
_MAX_BACKOFF = 60.0
# Statuses worth asking again: the server is busy, restarting or timed out on its side.
_TRANSIENT_STATUS = frozenset({408, 425, 429})
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class DownloadError(SourceError):
    """A URL could not be fetched whole; the message names the URL and the last failure."""


class _Transient(Exception):
    """A failure that another attempt may not meet; carries its one-line description."""


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


def sha256_file(path: Path) -> tuple[str, int]:
    """(sha256 hex, bytes) of a local file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _http_attempt(
    url: str, partial: Path, *, timeout: float, resume: bool, reporter: _Reporter
) -> None:
    """One GET into ``partial``, resuming from its size when ``resume``; raises _Transient."""
    have = partial.stat().st_size if resume and partial.exists() else 0
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
            partial.unlink()
            raise _Transient("HTTP 416 on resume; starting over") from exc
        if exc.code >= 500 or exc.code in _TRANSIENT_STATUS:
            raise _Transient(f"HTTP {exc.code} {exc.reason}") from exc
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise _Transient(_describe(exc)) from exc
    with response:
        status = response.status
        mode = "wb"
        if have and status == 206:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
            if match is None or int(match.group(1)) != have:
                partial.unlink()
                raise _Transient(
                    f"server answered the resume with Content-Range "
                    f"{response.headers.get('Content-Range')!r}; starting over"
                )
            mode = "ab"
            total = None if match.group(3) == "*" else int(match.group(3))
        elif status == 200:
            have = 0  # no Range support (or ignored): the whole body comes again
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        else:
            raise DownloadError(f"{url}: unexpected HTTP {status} {response.reason}")
        try:
            with open(partial, mode) as out:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    have += len(chunk)
                    reporter.update(have, total)
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, OSError) and exc.filename is not None:
                raise DownloadError(f"{url}: cannot write {exc.filename}: {exc}") from exc
            raise _Transient(f"{_describe(exc)} after {have:,} bytes") from exc
    if total is not None and have != total:
        # http.client returns EOF quietly when the peer closes early: check the length here.
        raise _Transient(f"connection closed after {have:,} of {total:,} bytes")


def _fsspec_attempt(url: str, partial: Path, *, reporter: _Reporter) -> None:
    import fsspec

    try:
        with fsspec.open(url, "rb") as src, open(partial, "wb") as out:
            have = 0
            while chunk := src.read(1 << 20):
                out.write(chunk)
                have += len(chunk)
                reporter.update(have, None)
    except FileNotFoundError as exc:
        raise DownloadError(f"{url}: no such file") from exc
    except (ImportError, ValueError) as exc:
        raise DownloadError(f"{url}: cannot open: {exc}") from exc
    except OSError as exc:
        raise _Transient(_describe(exc)) from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, str):
        exc = exc.reason
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def download(
    url: str,
    dest: Path,
    *,
    timeout: float = 60.0,
    attempts: int = 4,
    backoff: float = 1.0,
    progress: Progress = lambda _msg: None,
) -> tuple[str, int]:
    """Fetch ``url`` into ``dest``; returns (sha256 hex, bytes).

    http(s) transfers cut short resume with a Range request where the server allows it;
    ``attempts`` counts GETs in all, waiting ``backoff`` seconds before the second and twice as
    long before each next one. ``timeout`` bounds each connect and each read, not the whole
    transfer. Other URLs go through fsspec and restart from the beginning on failure.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    dest = Path(dest)
    partial = dest.with_name(dest.name + ".part")
    partial.unlink(missing_ok=True)
    reporter = _Reporter(url, progress)
    is_http = url.lower().startswith(("http://", "https://"))
    failures: list[str] = []
    try:
        for attempt in range(1, attempts + 1):
            try:
                if is_http:
                    _http_attempt(
                        url, partial, timeout=timeout, resume=attempt > 1, reporter=reporter
                    )
                else:
                    _fsspec_attempt(url, partial, reporter=reporter)
            except _Transient as exc:
                failures.append(str(exc))
                if attempt == attempts:
                    break
                wait = min(backoff * 2 ** (attempt - 1), _MAX_BACKOFF)
                have = partial.stat().st_size if partial.exists() else 0
                progress(
                    f"{url}: {exc} (attempt {attempt}/{attempts}); retrying in {wait:.1f} s"
                    + (f", resuming at byte {have:,}" if is_http and have else "")
                )
                time.sleep(wait)
                continue
            os.replace(partial, dest)
            digest, size = sha256_file(dest)
            progress(f"{url}: fetched {size:,} bytes")
            return digest, size
        raise DownloadError(
            f"{url}: failed {attempts} times, last: {failures[-1]}; check the URL and the "
            "network, then retry"
        )
    finally:
        partial.unlink(missing_ok=True)
