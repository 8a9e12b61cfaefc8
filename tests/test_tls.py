"""TLS and mutual TLS through a real grpc.aio server on a loopback port.

A throwaway CA and certificates are generated per test module with `cryptography`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cache_service.wire.tls import (
    ClientTLSConfig,
    ServerTLSConfig,
    TLSConfigError,
    channel_credentials,
    channel_options,
    server_credentials,
)

pytestmark = pytest.mark.timeout(60)


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    rogue_client_cert: Path  # signed by other_ca
    rogue_client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _make_ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _make_leaf(
    cn: str,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    usage: x509.ObjectIdentifier,
    san: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = _make_ca("kvcache test CA")
    other_ca, other_key = _make_ca("some other CA")
    server, server_key = _make_leaf(
        "kvcache",
        ca,
        ca_key,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client, client_key = _make_leaf("tenant-a", ca, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue, rogue_key = _make_leaf("rogue", other_ca, other_key, ExtendedKeyUsageOID.CLIENT_AUTH)
    pki = Pki(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        other_ca=d / "other-ca.pem",
        rogue_client_cert=d / "rogue.pem",
        rogue_client_key=d / "rogue.key",
    )
    _write_cert(pki.ca, ca)
    _write_cert(pki.other_ca, other_ca)
    _write_cert(pki.server_cert, server)
    _write_key(pki.server_key, server_key)
    _write_cert(pki.client_cert, client)
    _write_key(pki.client_key, client_key)
    _write_cert(pki.rogue_client_cert, rogue)
    _write_key(pki.rogue_client_key, rogue_key)
    return pki


async def _start(creds: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    assert port > 0, "could not bind a loopback port"
    await server.start()
    return server, port


async def _check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """Status of one health Check over `channel` (OK when the handshake succeeded)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


async def _secure_check(port: int, config: ClientTLSConfig, host: str = "127.0.0.1"):
    async with grpc.aio.secure_channel(
        f"{host}:{port}", channel_credentials(config), options=channel_options(config)
    ) as channel:
        return await _check(channel)


async def _insecure_check(port: int) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await _check(channel)


def test_tls_server_accepts_verified_clients_and_refuses_others(pki: Pki) -> None:
    async def scenario() -> dict[str, grpc.StatusCode]:
        server, port = await _start(
            server_credentials(ServerTLSConfig(str(pki.server_cert), str(pki.server_key)))
        )
        try:
            return {
                "trusted": await _secure_check(port, ClientTLSConfig(ca_file=str(pki.ca))),
                "by_name": await _secure_check(
                    port, ClientTLSConfig(ca_file=str(pki.ca)), host="localhost"
                ),
                "wrong_ca": await _secure_check(port, ClientTLSConfig(ca_file=str(pki.other_ca))),
                "wrong_name": await _secure_check(
                    port, ClientTLSConfig(ca_file=str(pki.ca), server_name="not-the-server")
                ),
                "plaintext": await _insecure_check(port),
            }
        finally:
            await server.stop(None)

    codes = asyncio.run(scenario())
    assert codes["trusted"] is grpc.StatusCode.OK
    assert codes["by_name"] is grpc.StatusCode.OK
    assert codes["wrong_ca"] is grpc.StatusCode.UNAVAILABLE
    assert codes["wrong_name"] is grpc.StatusCode.UNAVAILABLE
    assert codes["plaintext"] is grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(pki: Pki) -> None:
    config = ServerTLSConfig(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    assert config.mutual

    async def scenario() -> dict[str, grpc.StatusCode]:
        server, port = await _start(server_credentials(config))
        try:
            return {
                "client_cert": await _secure_check(
                    port,
                    ClientTLSConfig(str(pki.ca), str(pki.client_cert), str(pki.client_key)),
                ),
                "no_client_cert": await _secure_check(port, ClientTLSConfig(str(pki.ca))),
                "foreign_client_cert": await _secure_check(
                    port,
                    ClientTLSConfig(
                        str(pki.ca), str(pki.rogue_client_cert), str(pki.rogue_client_key)
                    ),
                ),
                "plaintext": await _insecure_check(port),
            }
        finally:
            await server.stop(None)

    codes = asyncio.run(scenario())
    assert codes["client_cert"] is grpc.StatusCode.OK
    assert codes["no_client_cert"] is grpc.StatusCode.UNAVAILABLE
    assert codes["foreign_client_cert"] is grpc.StatusCode.UNAVAILABLE
    assert codes["plaintext"] is grpc.StatusCode.UNAVAILABLE


def test_bad_pem_settings_raise_errors_naming_the_field(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TLSConfigError, match=r"cert_file=.*nope\.pem.*cannot read"):
        server_credentials(ServerTLSConfig(str(missing), str(pki.server_key)))
    # A key where a certificate belongs, and a certificate where a key belongs.
    with pytest.raises(TLSConfigError, match=r"cert_file=.*no PEM certificate"):
        server_credentials(ServerTLSConfig(str(pki.server_key), str(pki.server_key)))
    with pytest.raises(TLSConfigError, match=r"key_file=.*no PEM private key"):
        server_credentials(ServerTLSConfig(str(pki.server_cert), str(pki.server_cert)))
    with pytest.raises(TLSConfigError, match=r"client_ca_file=.*cannot read"):
        server_credentials(ServerTLSConfig(str(pki.server_cert), str(pki.server_key), str(missing)))
    with pytest.raises(TLSConfigError, match=r"ca_file=.*no PEM CA certificate"):
        channel_credentials(ClientTLSConfig(ca_file=str(pki.client_key)))
    with pytest.raises(TLSConfigError, match="together"):
        ClientTLSConfig(ca_file=str(pki.ca), cert_file=str(pki.client_cert))


def test_token_call_credentials_over_tls_reach_the_auth_interceptor(pki: Pki) -> None:
    """grpc.access_token_call_credentials sends the header the AuthInterceptor parses."""
    from cache_service.api.auth import AuthInterceptor, current_principal, parse_token_document

    token = "tls-token-0123456789abcdef"
    table = parse_token_document({"tokens": {token: "acme"}})

    async def whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        principal = current_principal()
        return b"" if principal is None else principal.tenant.encode()

    async def scenario() -> tuple[bytes, grpc.StatusCode]:
        server = grpc.aio.server(interceptors=[AuthInterceptor(table)])
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.S", {"W": grpc.unary_unary_rpc_method_handler(whoami)}
                ),
            )
        )
        port = server.add_secure_port(
            "127.0.0.1:0",
            server_credentials(ServerTLSConfig(str(pki.server_cert), str(pki.server_key))),
        )
        await server.start()
        tls = channel_credentials(ClientTLSConfig(ca_file=str(pki.ca)))
        try:
            with_token = grpc.composite_channel_credentials(
                tls, grpc.access_token_call_credentials(token)
            )
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", with_token) as ch:
                tenant = await ch.unary_unary("/t.S/W")(b"", timeout=5)
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls) as ch:
                try:
                    await ch.unary_unary("/t.S/W")(b"", timeout=5)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
            return tenant, code
        finally:
            await server.stop(None)

    tenant, code = asyncio.run(scenario())
    assert tenant == b"acme"
    assert code is grpc.StatusCode.UNAUTHENTICATED
