"""TLS between services: a Worker with a certificate and a CA accepts only clients that
present a certificate from that CA (mutual TLS); plaintext and strangers are refused. Flags
that cannot make a TLS server are refused when the config is made, naming the flag."""

import asyncio
import os
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from services.common.tls import MAX_PEM_BYTES, TlsConfig
from services.scheduler.executor.worker_group import WorkerGroupExecutor
from services.worker.worker_service import start_worker_server
from tests.common.certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def worker_server(pki):
    tls = TlsConfig(pki.server.cert, pki.server.key, pki.ca)
    server = await start_worker_server("127.0.0.1", 0, tls)
    await server.set_serving()  # health only: no model needed to check the handshake
    yield server
    await server.stop(0)


def _health_check(address: str, tls: TlsConfig | None) -> None:
    executor = WorkerGroupExecutor([address], tls=tls)
    try:
        executor.wait_until_ready(3.0)
    finally:
        executor.close()


async def test_a_client_with_a_certificate_from_the_ca_is_served(worker_server, pki):
    tls = TlsConfig(pki.client.cert, pki.client.key, pki.ca)
    await asyncio.to_thread(_health_check, worker_server.address, tls)


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "stranger"])
async def test_other_clients_are_refused(worker_server, pki, who):
    tls = {
        "plaintext": None,
        "no client certificate": TlsConfig(ca_file=pki.ca),
        "stranger": TlsConfig(pki.stranger.cert, pki.stranger.key, pki.ca),
    }[who]
    with pytest.raises(TimeoutError, match="not SERVING"):
        await asyncio.to_thread(_health_check, worker_server.address, tls)


def test_flags_are_checked_at_start(tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TlsConfig(cert_file=str(tmp_path / "c.pem"))
    with pytest.raises(ValueError, match=r"--tls-ca .* cannot read it"):
        TlsConfig(ca_file=str(tmp_path / "missing.pem"))


def test_a_key_without_a_certificate_is_refused(pki):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TlsConfig(key_file=pki.server.key)


def test_a_key_that_is_not_the_certificates_is_refused(pki):
    with pytest.raises(ValueError, match=r"--tls-key .*client\.key is not the private key of"):
        TlsConfig(pki.server.cert, pki.client.key)


def test_swapped_certificate_and_key_are_refused(pki):
    with pytest.raises(ValueError, match=r"--tls-cert .*server\.key: no PEM certificate in it"):
        TlsConfig(pki.server.key, pki.server.cert)


def test_an_encrypted_key_is_refused_without_asking_for_a_passphrase(pki, tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(ValueError, match=r"--tls-key .*encrypted\.key: the key is encrypted"):
        TlsConfig(pki.server.cert, str(encrypted))


@pytest.mark.parametrize("content", [b"", b"not a certificate"], ids=["empty", "text"])
def test_a_ca_that_holds_no_certificate_is_refused(tmp_path, content):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(content)
    with pytest.raises(ValueError, match=f"--tls-ca {re.escape(str(ca))}: no PEM certificate"):
        TlsConfig(ca_file=str(ca))


def test_what_is_not_a_small_regular_file_is_refused(pki, tmp_path):
    folder = re.escape(str(tmp_path))
    with pytest.raises(ValueError, match=f"--tls-ca {folder}: not a regular file"):
        TlsConfig(ca_file=str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would wait for a writer
    with pytest.raises(ValueError, match=r"--tls-cert .*fifo: not a regular file"):
        TlsConfig(str(fifo), pki.server.key)
    huge = tmp_path / "huge.pem"
    huge.write_bytes(Path(pki.ca).read_bytes() * (MAX_PEM_BYTES // 400))
    assert huge.stat().st_size > MAX_PEM_BYTES
    too_big = f"--tls-ca {re.escape(str(huge))}: over {MAX_PEM_BYTES} bytes"
    with pytest.raises(ValueError, match=too_big):
        TlsConfig(ca_file=str(huge))


def test_a_ca_alone_cannot_make_a_server(pki):
    client_only = TlsConfig(ca_file=pki.ca)  # fine for a client: it verifies the server
    with pytest.raises(ValueError, match="--tls-ca needs --tls-cert and --tls-key"):
        client_only.check_server()
    TlsConfig(pki.server.cert, pki.server.key, pki.ca).check_server()
    TlsConfig(pki.server.cert, pki.server.key).check_server()
    TlsConfig().check_server()  # plaintext, and says so
