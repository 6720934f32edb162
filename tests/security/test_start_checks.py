"""A serving role refuses at start, before it loads anything, what would leave it open
without the operator knowing: a public role (serve, frontend) on an address beyond
loopback with no API key (unless --allow-unauthenticated), and TLS flags that would not
make a TLS server (a CA alone, a key that is not the certificate's). The process exits 2
within seconds, its error naming the flag."""

from __future__ import annotations

import os
import subprocess

import pytest

from pagestream.cli import build_parser
from pagestream.start_checks import check_start, is_loopback
from tests.common.certs import make_pki
from tests.helpers.processes import cli

EXIT_S = 30  # the checks run before the model, the engine or any server


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def no_env_key(monkeypatch):
    monkeypatch.delenv("PAGESTREAM_API_KEY", raising=False)


def _refused(*argv: str) -> str:
    """Run `pagestream ARGV` with no API key in its environment; it must exit 2 quickly;
    its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PAGESTREAM_API_KEY"}
    result = subprocess.run(cli(*argv), env=env, capture_output=True, text=True, timeout=EXIT_S)
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr


def _parsed(role: str, *flags: str):
    """`pagestream ROLE m FLAGS...` parsed (a frontend given the scheduler it requires)."""
    required = ["--scheduler", "s:1"] if role == "frontend" else []
    return build_parser().parse_args([role, "m", *required, *flags])


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("frontend.example", False),
    ],
)
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("role", ["serve", "frontend"])
def test_a_public_bind_without_a_key_is_refused(role, no_env_key):
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 serves beyond this machine"):
        check_start(_parsed(role, "--host", "0.0.0.0"))


def test_a_key_or_an_explicit_opt_out_lets_it_start(monkeypatch, no_env_key):
    check_start(_parsed("serve"))  # 127.0.0.1: this machine only
    check_start(_parsed("frontend", "--host", "0.0.0.0", "--api-key", "k"))
    check_start(_parsed("serve", "--host", "0.0.0.0", "--allow-unauthenticated"))
    check_start(_parsed("worker", "--host", "0.0.0.0"))  # internal: mTLS and network policy
    monkeypatch.setenv("PAGESTREAM_API_KEY", "k")
    check_start(_parsed("serve", "--host", "0.0.0.0"))


@pytest.mark.parametrize("role", ["serve", "worker", "scheduler", "frontend"])
def test_every_serving_role_refuses_a_ca_alone(role, pki):
    with pytest.raises(ValueError, match="--tls-ca needs --tls-cert and --tls-key"):
        check_start(_parsed(role, "--tls-ca", pki.ca))


def test_the_process_exits_naming_the_missing_key():
    stderr = _refused("serve", "--host", "0.0.0.0", "--port", "-1")
    assert "--host 0.0.0.0 serves beyond this machine with no API key" in stderr
    assert "--allow-unauthenticated" in stderr


def test_the_process_exits_naming_the_tls_flag(pki):
    stderr = _refused("worker", "--tls-ca", pki.ca)
    assert "--tls-ca needs --tls-cert and --tls-key" in stderr
    stderr = _refused("scheduler", "--tls-cert", pki.server.cert, "--tls-key", pki.client.key)
    assert f"--tls-key {pki.client.key} is not the private key of --tls-cert" in stderr
