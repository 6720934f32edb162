"""TLS for pagestream's gRPC servers and channels (`--tls-cert`, `--tls-key`, `--tls-ca`).

A server with a certificate and key speaks TLS; an internal server (Worker, EngineCore)
given a CA as well demands client certificates signed by it (mutual TLS). A client given
a CA verifies the server against it and, with a certificate and key of its own, presents
them (the scheduler to its workers, the frontend to its scheduler). Certificates must name
the address clients dial (a SAN such as IP:127.0.0.1 or DNS:worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.flags import flag


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc}).") from exc


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

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials | None:
        """None: plaintext. Client certificates are required when asked and a CA is set."""
        if self.cert_file is None:
            return None
        pair = (_read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert"))
        ca = _read(self.ca_file, "--tls-ca")
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=require_client_auth and ca is not None
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
