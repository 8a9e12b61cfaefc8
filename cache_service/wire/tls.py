"""TLS and mutual-TLS credentials for the gRPC API, built from PEM files.

Server side: `ServerTLSConfig(cert_file, key_file, client_ca_file=None)`. With a client CA
the server requires and verifies a client certificate signed by it (mutual TLS); without
one it is server-authenticated TLS only.

Client side: `ClientTLSConfig(ca_file, cert_file=None, key_file=None)`. The CA verifies the
server; the optional certificate and key are presented for mutual TLS.

Files are read once, when the credentials are built; a missing file, an unreadable one or
one without the expected PEM block raises TLSConfigError naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "ClientTLSConfig",
    "ServerTLSConfig",
    "TLSConfigError",
    "channel_credentials",
    "channel_options",
    "server_credentials",
]

_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"
# Matches "PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY" and "ENCRYPTED PRIVATE KEY".
_KEY_MARKER = b"PRIVATE KEY-----"


class TLSConfigError(ValueError):
    """A TLS setting is inconsistent or one of its PEM files is missing or malformed."""


@dataclass(frozen=True)
class ServerTLSConfig:
    """PEM paths for the server.

    cert_file: the server's certificate chain (leaf first).
    key_file: its private key (unencrypted PEM: gRPC cannot prompt for a passphrase).
    client_ca_file: CA bundle that client certificates must chain to; set it to require
    mutual TLS.
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return self.client_ca_file is not None


@dataclass(frozen=True)
class ClientTLSConfig:
    """PEM paths for a client channel.

    ca_file: CA bundle that the server's certificate must chain to (None: the system roots).
    cert_file, key_file: the client's certificate chain and key, both or neither (mTLS).
    server_name: the name to verify in the server's certificate when it differs from the
    dialled address (e.g. dialling 127.0.0.1 for a certificate issued to "kvcache").
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TLSConfigError(
                "client TLS: cert_file and key_file must be given together (mutual TLS) "
                "or both left out"
            )


def _read_pem(path: str, field: str, marker: bytes, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{field}={path!r}: cannot read: {exc.strerror}") from None
    if marker not in data:
        raise TLSConfigError(f"{field}={path!r}: no PEM {what} found in the file")
    return data


def server_credentials(config: ServerTLSConfig) -> grpc.ServerCredentials:
    """grpc.ServerCredentials for `config` (TLS, or mTLS when client_ca_file is set)."""
    cert = _read_pem(config.cert_file, "cert_file", _CERT_MARKER, "certificate")
    key = _read_pem(config.key_file, "key_file", _KEY_MARKER, "private key")
    client_ca = None
    if config.client_ca_file is not None:
        client_ca = _read_pem(
            config.client_ca_file, "client_ca_file", _CERT_MARKER, "CA certificate"
        )
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def channel_credentials(config: ClientTLSConfig) -> grpc.ChannelCredentials:
    """grpc.ChannelCredentials for `config`.

    Pass `channel_options(config)` to the channel as well when server_name is set.
    """
    root = None
    if config.ca_file is not None:
        root = _read_pem(config.ca_file, "ca_file", _CERT_MARKER, "CA certificate")
    key = chain = None
    if config.cert_file is not None and config.key_file is not None:
        chain = _read_pem(config.cert_file, "cert_file", _CERT_MARKER, "certificate")
        key = _read_pem(config.key_file, "key_file", _KEY_MARKER, "private key")
    return grpc.ssl_channel_credentials(
        root_certificates=root, private_key=key, certificate_chain=chain
    )


def channel_options(config: ClientTLSConfig) -> list[tuple[str, str]]:
    """Channel options that go with channel_credentials (the TLS name override, if any)."""
    if config.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", config.server_name)]
