"""What a serving role refuses before it loads anything, each with an error naming the flag:
TLS flags that would not give it a TLS server (services/common/tls.py), and a public role
(serve, frontend) listening beyond loopback with no API key, unless the operator passes
--allow-unauthenticated on purpose."""

from __future__ import annotations

import argparse
import ipaddress

from pagestream.roles import _api_key
from services.common.flags import from_flags
from services.common.tls import TlsConfig

SERVING_ROLES = ("serve", "worker", "scheduler", "frontend")
PUBLIC_ROLES = ("serve", "frontend")


def check_start(ns: argparse.Namespace) -> None:
    """Raises ValueError naming the flag at fault; the other commands pass."""
    if ns.command not in SERVING_ROLES:
        return
    from_flags(TlsConfig, ns).check_server()
    if ns.command in PUBLIC_ROLES:
        check_api_key(ns)


def is_loopback(host: str) -> bool:
    """Only this machine can reach it. A name other than localhost counts as public: what
    it resolves to is not known here."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_api_key(ns: argparse.Namespace) -> None:
    if _api_key(ns) or ns.allow_unauthenticated or is_loopback(ns.host):
        return
    raise ValueError(
        f"--host {ns.host} serves beyond this machine with no API key: give --api-key or "
        "$PAGESTREAM_API_KEY, or --allow-unauthenticated to serve without one on purpose."
    )
