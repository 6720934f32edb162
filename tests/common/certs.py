"""Test certificates made on the spot: a CA, a server certificate for 127.0.0.1 and
localhost, and client certificates (one from the CA, one from a stranger CA)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: str
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> CertFiles:
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return CertFiles(str(cert_path), str(key_path))


def _builder(subject: str, issuer: str, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(folder: Path, name: str) -> tuple[CertFiles, object]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(folder, name, cert, key), key


def make_leaf(folder: Path, name: str, ca_name: str, ca_key) -> CertFiles:
    """A certificate for 127.0.0.1 / localhost signed by the CA (server and client use)."""
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        _builder(name, ca_name, key.public_key())
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _write(folder, name, cert, key)


@dataclass(frozen=True)
class Pki:
    ca: str  # the CA certificate file
    server: CertFiles
    client: CertFiles
    stranger: CertFiles  # signed by another CA


def make_pki(folder: Path) -> Pki:
    ca, ca_key = make_ca(folder, "test-ca")
    _, other_key = make_ca(folder, "other-ca")
    return Pki(
        ca=ca.cert,
        server=make_leaf(folder, "server", "test-ca", ca_key),
        client=make_leaf(folder, "client", "test-ca", ca_key),
        stranger=make_leaf(folder, "stranger", "other-ca", other_key),
    )
