"""KvEventsAccess: which peers may watch an engine core's KV events (WatchKvEvents).

The events carry the block hashes of every client's prompts as they are cached, so a
peer that watches them learns which prefixes other tenants sent. Frontends need them to
route by cache (data parallelism); nobody else does. There is no internal token: mutual
TLS is how internal gRPC authenticates its clients.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import unquote

KV_EVENTS_MODES = ("authenticated", "any", "off")
DEFAULT_KV_EVENTS = "authenticated"


@dataclass(frozen=True)
class KvEventsAccess:
    """Who may watch, by `--kv-events`:

    - `authenticated` (the default): peers on the same host (a loopback address or a unix
      socket, as `pagestream serve` and its split layouts connect) and peers that presented a
      client certificate the port verified against `--tls-ca` (mutual TLS). A remote peer on
      a plaintext or server-only TLS port is refused.
    - `any`: every peer that reaches the port, for a network that admits only the frontends
      (deploy/kubernetes/common/network-policy.yaml) without mutual TLS.
    - `off`: nobody; a data-parallel frontend then routes by its own predictions and load.
    """

    mode: str = DEFAULT_KV_EVENTS
    # The port demands client certificates signed by --tls-ca: a peer's certificate
    # identities (grpc's peer_identities) then prove it was verified.
    mutual_tls: bool = False

    def __post_init__(self) -> None:
        if self.mode not in KV_EVENTS_MODES:
            raise ValueError(
                f"kv_events must be one of {', '.join(KV_EVENTS_MODES)}, got {self.mode!r}."
            )

    def refusal(self, peer: str, identities: object | None) -> str | None:
        """None when `peer` (grpc's context.peer(): "ipv4:1.2.3.4:5", "ipv6:[::1]:5",
        "unix:/path") may watch; otherwise the reason it is told."""
        if self.mode == "any":
            return None
        if self.mode == "off":
            return "this scheduler sends no KV events (--kv-events off)."
        if is_local_peer(peer) or (self.mutual_tls and identities is not None):
            return None
        return (
            "KV events go only to authenticated peers: on this host, or with a client "
            "certificate from the scheduler's --tls-ca (run the scheduler with --tls-cert, "
            "--tls-key and --tls-ca, and the frontend with a certificate from that CA), or "
            "the scheduler run with --kv-events any where a network policy admits only "
            "frontends."
        )


def is_local_peer(peer: str) -> bool:
    """A unix socket, or a loopback address (IPv4-mapped ones included); grpc may
    percent-encode the brackets of an IPv6 peer."""
    kind, _, address = unquote(peer).partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = address.rpartition(":")[0]
    elif kind == "ipv6":
        host = address.rpartition(":")[0].strip("[]")
    else:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%")[0])  # a zone id (fe80::1%eth0) dropped
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
