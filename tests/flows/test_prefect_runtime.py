"""What flows.prefect_runtime and flows.prefect_flow change in Prefect gives what Prefect
gives: each flow's parameter schema, the settings its logging.yml is filled from, and API
clients that verify the server's certificate."""

from __future__ import annotations

import http.server
import ipaddress
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import serving


def test_a_flows_parameter_schema_is_prefects_made_when_first_read() -> None:
    from prefect import Flow, flow
    from prefect.utilities.callables import parameter_schema

    import flows.pipeline

    ours = [value for value in vars(flows.pipeline).values() if isinstance(value, Flow)]
    assert sorted(f.name for f in ours) == [
        "shardflow-catalog-verify",
        "shardflow-ingest",
        "shardflow-pipeline",
        "shardflow-preprocess",
        "shardflow-train",
    ]
    for made in ours:
        assert not hasattr(made.__dict__.get("parameters"), "properties")  # not made yet
        assert made.parameters == parameter_schema(made.fn)
        assert made.parameters is made.parameters  # made once
        assert "home" in made.parameters.properties

    # A copy made before its schema was (cloudpickle, as Prefect ships a flow) makes it too.
    import cloudpickle

    from flows.prefect_flow import flow as our_flow

    @our_flow(name="shardflow-test-pickled")
    def pickled(rows: int = 5) -> int:
        return rows

    copy = cloudpickle.loads(cloudpickle.dumps(pickled))
    assert copy.__dict__["parameters"] is None
    assert copy.parameters.properties["rows"]["default"] == 5

    # A flow defined with Prefect's own decorator, here, still gets its schema at once.
    @flow(name="shardflow-test-prefects-own")
    def prefects_own(rows: int = 3) -> int:
        return rows

    assert prefects_own.__dict__["parameters"] == parameter_schema(prefects_own.fn)
    assert prefects_own.parameters.properties["rows"]["default"] == 3


def test_logging_yml_is_filled_from_the_settings_prefect_serialises() -> None:
    from prefect.logging import configuration
    from prefect.settings import get_current_settings

    import flows.pipeline  # noqa: F401  (applies logging_settings_on_demand)
    from flows.prefect_runtime import SettingsEnvironment, logging_settings_on_demand

    assert logging_settings_on_demand()
    assert isinstance(
        configuration.get_current_settings().to_environment_variables(include_aliases=True),
        SettingsEnvironment,
    )
    settings = get_current_settings()
    every = settings.to_environment_variables(include_aliases=True)
    on_demand = SettingsEnvironment(settings)
    for name, value in every.items():
        assert on_demand[name] == value, name
    assert dict(on_demand) == every
    with pytest.raises(KeyError):
        on_demand["PREFECT_NOT_A_SETTING"]
    # Anything else asked of the settings there is Prefect's.
    assert configuration.get_current_settings().logging.level == settings.logging.level


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, signed by its own key: (certificate, key) PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"shardflow-test-{name}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@contextmanager
def _https_health(cert: Path, key: Path) -> Iterator[str]:
    """An HTTPS server on loopback that answers every GET as Prefect's /api/health does."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    with serving(server, scheme="https") as url:
        yield url + "/api"


def test_prefects_clients_share_one_verified_tls_context(tmp_path: Path) -> None:
    """Prefect's API clients in a flow process share one verified TLS context per CA file
    (flows.prefect_runtime.verified_tls_shared), and it still verifies: a server whose
    certificate the CA file holds answers; one it does not hold is refused; another CA file,
    or the same file rewritten, gets its own context; skipping verification still works."""
    from prefect.client.orchestration import get_client
    from prefect.settings import (
        PREFECT_API_SSL_CERT_FILE,
        PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
        PREFECT_API_URL,
        temporary_settings,
    )

    import flows.pipeline  # noqa: F401  (applies verified_tls_shared)
    from flows.prefect_runtime import TLS_CONTEXT_MODULES, verified_tls_shared

    assert verified_tls_shared() == list(TLS_CONTEXT_MODULES)  # already so after the import

    def context_of(client: Any) -> ssl.SSLContext:
        return client._client._transport._pool._ssl_context  # type: ignore[no-any-return]

    ours, ours_key = _self_signed(tmp_path, "ours")
    theirs, _ = _self_signed(tmp_path, "theirs")
    with _https_health(ours, ours_key) as api:
        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_SSL_CERT_FILE: str(ours)}):
            first, second = get_client(sync_client=True), get_client(sync_client=True)
            assert context_of(first) is context_of(second) is context_of(get_client())
            assert context_of(first).verify_mode == ssl.CERT_REQUIRED
            assert context_of(first).check_hostname
            with first, second:
                assert first.api_healthcheck() is None  # None: healthy
                assert second.api_healthcheck() is None

            ours.write_bytes(ours.read_bytes() + b"\n")  # the same file, rewritten
            rewritten = get_client(sync_client=True)
            assert context_of(rewritten) is not context_of(first)

        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_SSL_CERT_FILE: str(theirs)}):
            refused = get_client(sync_client=True)
            assert context_of(refused) is not context_of(first)
            with refused:
                failure = refused.api_healthcheck()
            assert failure is not None and "CERTIFICATE_VERIFY_FAILED" in str(failure)

        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
            insecure, again = get_client(sync_client=True), get_client(sync_client=True)
            assert context_of(insecure) is not context_of(again)
            assert context_of(insecure).verify_mode == ssl.CERT_NONE
            with insecure:
                assert insecure.api_healthcheck() is None
