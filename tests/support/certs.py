"""Throw-away X.509 material for TLS tests: a self-signed CA and the certificates it issues (PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path  # PEM certificate
    key: Path  # PEM private key, unencrypted

    def pem(self) -> tuple[bytes, bytes]:
        """(certificate, key) as bytes, as grpc's credentials take them."""
        return self.cert.read_bytes(), self.key.read_bytes()


class CertificateAuthority:
    """A self-signed CA in `directory` (`NAME-ca.pem`) that issues server and client certificates."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._subject = _name(f"{name} test CA")
        builder = _builder(self._subject, self._subject, self._key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))

    def server(self, label: str, names: tuple[str, ...] = ("localhost",)) -> Issued:
        """A server certificate for `names` (DNS names) and 127.0.0.1."""
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        return self._issue(label, names[0], x509.SubjectAlternativeName(sans), ExtendedKeyUsageOID.SERVER_AUTH)

    def client(self, label: str) -> Issued:
        return self._issue(label, label, None, ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(
        self, label: str, common_name: str, sans: x509.SubjectAlternativeName | None, usage: x509.ObjectIdentifier
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(_name(common_name), self._subject, key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans is not None:
            builder = builder.add_extension(sans, critical=False)
        issued = Issued(self.directory / f"{self.name}-{label}.pem", self.directory / f"{self.name}-{label}.key")
        issued.cert.write_bytes(builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return issued


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
