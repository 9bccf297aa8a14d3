"""flows.failures: environmental failures anywhere in an exception's chain become one line."""

from __future__ import annotations

import botocore.exceptions
import httpx
import pytest

from flows.failures import describe


def _raised_from(outer: Exception, inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except Exception as caught:
        return caught


def test_no_credentials() -> None:
    line = describe(botocore.exceptions.NoCredentialsError())
    assert line is not None and line.startswith("no credentials for the object store")
    assert "AWS_ACCESS_KEY_ID" in line


def test_an_unreachable_store_deep_in_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    inner = botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b")
    line = describe(_raised_from(RuntimeError("commit failed"), inner))
    assert line is not None
    assert line.startswith("cannot reach the object store at http://127.0.0.1:9 (")
    assert line.endswith("then rerun (finished work is kept)")


def test_a_prefect_api_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    line = describe(httpx.ReadTimeout("timed out"))
    assert line is not None
    assert line.startswith("the Prefect API at http://127.0.0.1:9/api did not answer in time")
    assert "unset PREFECT_API_URL" in line


def test_a_refused_socket_and_a_bug() -> None:
    assert describe(ConnectionRefusedError(111, "Connection refused")) is not None
    assert describe(ValueError("a bug")) is None
    assert describe(_raised_from(KeyError("x"), ValueError("y"))) is None
