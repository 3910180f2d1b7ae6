"""TLS on the gateway's public port: PEM files read, checked, and turned into gRPC credentials.

`--tls-cert` and `--tls-key` (given together) make the port TLS; `--tls-client-ca` also makes every
client present a certificate signed by that CA (mutual TLS), or its handshake fails. Health and
reflection are served on the same port, so they need TLS too. The files are checked with the
standard `ssl` module before anything listens: a missing, unreadable, non-PEM, encrypted or
mismatched file stops the role with one line naming the flag, not a failure deep inside gRPC.

TLS protects the connection; it does not say who may do what. The public-bind rule
(`bind_rule.py`) still asks for `--auth-file` (or `--insecure-no-auth`) beyond loopback.

`ClientTls` is how `loraserve up` calls its own gateway (health checks, demo): it trusts exactly the
gateway's certificate (so a self-signed one works, and a CA-signed one needs no CA file), expects
the name `--tls-server-name` in it, and presents `--tls-client-cert` where the gateway asks for one.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError


@dataclass(frozen=True)
class TlsSettings:
    """The gateway's TLS files (flags of `loraserve gateway` and `loraserve up` alike)."""

    tls_cert: Path | None = setting(None, "PEM certificate (chain) of the public port; with --tls-key")
    tls_key: Path | None = setting(None, "PEM private key (unencrypted) of --tls-cert")
    tls_client_ca: Path | None = setting(
        None, "PEM CA certificate(s): clients must present a certificate it signed (mutual TLS)"
    )


@dataclass(frozen=True)
class ServerTls:
    """The public port's TLS material, checked."""

    cert_chain: bytes  # PEM: the server's certificate, then any intermediates
    private_key: bytes  # PEM, unencrypted
    client_ca: bytes | None = None  # PEM: whose client certificates are accepted; None: no client certificate asked

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca, require_client_auth=self.mutual
        )


@dataclass(frozen=True)
class ClientTls:
    """A client's side of the gateway's TLS, as `loraserve up` uses it for its own calls."""

    roots: bytes  # PEM certificates trusted for the server (up: the gateway's own certificate)
    server_name: str  # the name the server's certificate must carry
    cert_chain: bytes | None = None  # PEM: a client certificate, for a gateway that asks for one
    private_key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise InvalidConfigError("a client certificate needs its key, and a key its certificate")

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]

    def channel(self, address: str) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(self.roots, self.private_key, self.cert_chain)
        return grpc.secure_channel(address, credentials, options=self.channel_options())


def load_server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> ServerTls | None:
    """The gateway's TLS from its flags (None: plaintext); InvalidConfigError naming the flag at fault."""
    if cert is None and key is None:
        if client_ca is not None:
            raise InvalidConfigError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too")
        return None
    if cert is None or key is None:
        raise InvalidConfigError("--tls-cert and --tls-key go together: give both PEM files, or neither")
    cert_pem, key_pem = read_key_pair(("--tls-cert", cert), ("--tls-key", key))
    return ServerTls(cert_pem, key_pem, read_certificates("--tls-client-ca", client_ca) if client_ca else None)


def load_up_client_tls(server: ServerTls, server_name: str, cert: Path | None, key: Path | None) -> ClientTls:
    """How `up` reaches its TLS gateway: trusting that certificate, with a client certificate under mTLS."""
    if (cert is None) != (key is None):
        raise InvalidConfigError("--tls-client-cert and --tls-client-key go together: give both PEM files, or neither")
    if server.mutual and cert is None:
        raise InvalidConfigError(
            "--tls-client-ca: the gateway refuses clients without a certificate, and `up` calls it too (health, demo): "
            "give --tls-client-cert and --tls-client-key (a client certificate that CA signed)"
        )
    if cert is None or key is None:
        return ClientTls(server.cert_chain, server_name)
    cert_pem, key_pem = read_key_pair(("--tls-client-cert", cert), ("--tls-client-key", key))
    return ClientTls(server.cert_chain, server_name, cert_pem, key_pem)


def read_certificates(flag: str, path: Path) -> bytes:
    """The PEM certificate(s) in `path`; InvalidConfigError naming `flag` if there are none."""
    data = _read(flag, path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii"))
    except (ssl.SSLError, ValueError):  # ValueError: empty, or not ASCII (a DER file)
        raise InvalidConfigError(f"{flag} {path}: not a PEM certificate (-----BEGIN CERTIFICATE-----)") from None
    return data


def read_key_pair(cert: tuple[str, Path], key: tuple[str, Path]) -> tuple[bytes, bytes]:
    """(certificate chain, private key) PEM bytes, checked to be valid PEM and to belong together."""
    (cert_flag, cert_path), (key_flag, key_path) = cert, key
    cert_pem = read_certificates(cert_flag, cert_path)
    key_pem = _read(key_flag, key_path)

    def encrypted() -> bytes:  # OpenSSL asks for a password only for an encrypted key
        raise InvalidConfigError(f"{key_flag} {key_path}: the key is encrypted; give it unencrypted (gRPC reads PEM)")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=encrypted)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise InvalidConfigError(f"{key_flag} {key_path} is not the key of {cert_flag} {cert_path}") from None
        raise InvalidConfigError(f"{key_flag} {key_path}: not a PEM private key") from None
    return cert_pem, key_pem


def _read(flag: str, path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
