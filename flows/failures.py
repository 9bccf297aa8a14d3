"""Failures of the environment, not of shardflow: one line a person can act on, for every command.

    a command's exception ─▶ describe(exc): its chain (__cause__, __context__), innermost
                             first, matched by class against the failures below ─▶ one line,
                             or None (a bug: the CLI's "internal error" with --debug's hint)

- no credentials for an object store (botocore's NoCredentialsError and kin);
- a server that refuses, cannot be resolved or stops answering: an object store, the Prefect
  API, a Dask scheduler, any socket (botocore's endpoint and timeout errors, aiohttp's and
  httpx's connect and timeout errors, ConnectionError, TimeoutError, socket.gaierror).

Classes are matched by module and name, so that nothing here imports botocore, aiohttp or httpx
(a command that never touched them pays nothing). The libraries raise what they know
(shardflow's own ShardflowError) where they can; this is the net under every command.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

_CREDENTIALS = {
    "botocore.exceptions": {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "NoAuthTokenError",
    },
}
# Reached nothing, or nothing answered: by library, the classes that say so.
_UNREACHABLE = {
    "botocore.exceptions": {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
    },
    "aiohttp.client_exceptions": {
        "ClientConnectorError",
        "ClientConnectorDNSError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ConnectionTimeoutError",
        "SocketTimeoutError",
    },
    "httpx": {"ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout"},
    "httpcore": {"ConnectError", "ConnectTimeout", "ReadTimeout"},
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or during, innermost last; each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is(exc: BaseException, table: dict[str, set[str]]) -> bool:
    for cls in type(exc).__mro__:
        module = cls.__module__
        if cls.__name__ in table.get(module, ()) or cls.__name__ in table.get(
            module.split(".")[0], ()
        ):
            return True
    return False


def _text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe(exc: BaseException) -> str | None:
    """One line for an environmental failure anywhere in ``exc``'s chain; None otherwise."""
    chain = list(_chain(exc))
    for link in chain:
        if _is(link, _CREDENTIALS):
            return (
                f"no credentials for the object store ({_text(link)}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"
            )
    for link in chain:
        if _is(link, _UNREACHABLE) or isinstance(
            link, ConnectionError | TimeoutError | socket.gaierror
        ):
            what, remedy = _where(link)
            return f"{what} ({_text(link)}); {remedy}, then rerun (finished work is kept)"
    return None


def _where(exc: BaseException) -> tuple[str, str]:
    """(what did not answer, what to check)."""
    timed_out = "Timeout" in type(exc).__name__ or isinstance(exc, TimeoutError)
    module = type(exc).__module__

    def said(server: str) -> str:
        return f"{server} did not answer in time" if timed_out else f"cannot reach {server}"

    if module.startswith("botocore") or module.startswith("aiohttp"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        store = f"the object store at {endpoint}" if endpoint else "the object store"
        return said(
            store
        ), "check that it is up and that AWS_ENDPOINT_URL and SHARDFLOW_CATALOG name it"
    if module.startswith(("httpx", "httpcore")):
        api = os.environ.get("PREFECT_API_URL")
        if api:
            return said(f"the Prefect API at {api}"), (
                "start that server (shardflow server), or unset PREFECT_API_URL to run on a "
                "temporary local one"
            )
        return said("the Prefect API"), "check the Prefect server"
    return said("a server"), "check that it is up and reachable"
