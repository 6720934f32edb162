"""TLS for pagestream's gRPC servers and channels (`--tls-cert`, `--tls-key`, `--tls-ca`).

A server with a certificate and key speaks TLS; an internal server (Worker, EngineCore)
given a CA as well demands client certificates signed by it (mutual TLS). A client given
a CA verifies the server and presents its own certificate and key when it has them.
Certificates must name the address clients dial (a SAN such as IP:127.0.0.1 or
DNS:worker). Every flag is checked when the config is made, naming the flag.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.flags import flag

# A CA bundle of a few hundred certificates fits many times over; the bound keeps a flag
# naming a device or a huge file from being read into memory.
MAX_PEM_BYTES = 1 << 20


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    file = Path(path)
    if file.exists() and not file.is_file():  # a FIFO would block the open, a device not end
        raise ValueError(f"{flag} {path}: not a regular file.")
    try:
        with file.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc}).") from exc
    if len(data) > MAX_PEM_BYTES:
        raise ValueError(f"{flag} {path}: over {MAX_PEM_BYTES} bytes, not a PEM file.")
    return data


class _EncryptedKey(Exception):
    """Raised by the passphrase callback: gRPC takes no passphrase, so none is asked for."""


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def _check_certificates(path: str, flag: str) -> None:
    """The file holds at least one PEM certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"{flag} {path}: no PEM certificate in it ({exc.reason}).") from exc


def _check_key_pair(cert: str, key: str) -> None:
    """The key is the certificate's own private key, in PEM and unencrypted."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except _EncryptedKey:
        raise ValueError(
            f"--tls-key {key}: the key is encrypted; gRPC takes no passphrase, give it "
            "unencrypted (readable by this role's user only)."
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            problem = f"is not the private key of --tls-cert {cert}"
        else:
            problem = f"holds no PEM private key ({exc.reason})"
        raise ValueError(f"--tls-key {key} {problem}.") from exc


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str | None = flag(
        None, "PEM certificate: this role's gRPC server speaks TLS", name="tls-cert"
    )
    key_file: str | None = flag(None, "PEM private key of --tls-cert", name="tls-key")
    ca_file: str | None = flag(
        None,
        "PEM CA: verify the services this role connects to, and require client certificates "
        "signed by it on the internal Worker and EngineCore services (mTLS)",
        name="tls-ca",
    )

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither.")
        for name, path in (
            ("--tls-cert", self.cert_file),
            ("--tls-key", self.key_file),
            ("--tls-ca", self.ca_file),
        ):
            _read(path, name)  # fail at start, naming the flag
        if self.cert_file is not None:
            _check_certificates(self.cert_file, "--tls-cert")
            _check_key_pair(self.cert_file, self.key_file)
        if self.ca_file is not None:
            _check_certificates(self.ca_file, "--tls-ca")

    def check_server(self) -> None:
        """For a role that serves gRPC with these flags: a CA without a certificate and key
        would leave its server plaintext while the flags read as TLS."""
        if self.ca_file is not None and self.cert_file is None:
            raise ValueError(
                "--tls-ca needs --tls-cert and --tls-key: without them this role's gRPC "
                "server would speak plaintext."
            )

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None

    @property
    def verifies_clients(self) -> bool:
        """A server with these flags can require client certificates (mutual TLS)."""
        return self.cert_file is not None and self.ca_file is not None

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials | None:
        """None: plaintext. Client certificates are required when asked and a CA is set."""
        if self.cert_file is None:
            return None
        pair = (_read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert"))
        ca = _read(self.ca_file, "--tls-ca")
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=ca,
            require_client_auth=require_client_auth and self.verifies_clients,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: plaintext."""
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "--tls-ca"),
            private_key=_read(self.key_file, "--tls-key"),
            certificate_chain=_read(self.cert_file, "--tls-cert"),
        )


PLAINTEXT = TlsConfig()
