"""TLS between services: a Worker with a certificate and a CA accepts only clients that
present a certificate from that CA (mutual TLS); plaintext and strangers are refused."""

import asyncio

import pytest

from services.common.tls import TlsConfig
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
