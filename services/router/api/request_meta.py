"""What a request says about itself outside its body: API key, priority, TTFT target,
session key. The same headers work as HTTP headers and as gRPC metadata:

    authorization: Bearer KEY
    x-priority: INT          higher is more important; the lowest is shed first (default 0)
    x-ttft-slo-ms: FLOAT     reject at once if the first token cannot come this soon
    <affinity header>: KEY   session affinity (RoutingConfig.affinity_header), else `user`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.services.router.api.errors import bad_request

PRIORITY_RANGE = (-1000, 1000)


@dataclass(frozen=True)
class RequestMeta:
    api_key: str = ""
    priority: int = 0  # as asked; the Gate caps it (per key, or for keyless clients)
    ttft_slo_s: Optional[float] = None  # None: the router's default
    affinity: Optional[str] = None
    client: str = ""  # the peer's address (rate limits when there are no API keys)
    # Set by the Gate once the key is checked:
    tenant: Optional[str] = None  # the key's tenant; None without API keys
    limit_key: str = ""  # whose rate limit this request counts against


def meta_from_headers(get, affinity_header: str, user: Optional[str] = None,
                      client: str = "") -> RequestMeta:
    """`get(name)`: a header's value or None (names lower-case)."""
    return RequestMeta(api_key=bearer(get("authorization")),
                       priority=_priority(get("x-priority")),
                       ttft_slo_s=_slo(get("x-ttft-slo-ms")),
                       affinity=get(affinity_header) or user or None,
                       client=client)


def grpc_peer_host(peer: str) -> str:
    """grpc's context.peer() ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678", "unix:...") without
    the port: one client, however many connections it opens."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return kind + ":" + rest.rpartition(":")[0]
    return peer


def bearer(authorization: Optional[str]) -> str:
    if not authorization:
        return ""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def metadata_getter(metadata):
    """A `get` over gRPC invocation metadata ((key, value) pairs)."""
    found = {}
    for key, value in metadata or ():
        found.setdefault(key.lower(), value)
    return found.get


def _priority(text: Optional[str]) -> int:
    if text is None:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise bad_request(f"x-priority must be an integer, got {text!r}") from None
    lo, hi = PRIORITY_RANGE
    if not lo <= value <= hi:
        raise bad_request(f"x-priority must be in [{lo}, {hi}], got {value}")
    return value


def _slo(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        ms = float(text)
    except ValueError:
        raise bad_request(f"x-ttft-slo-ms must be a number, got {text!r}") from None
    if not ms > 0:
        raise bad_request(f"x-ttft-slo-ms must be > 0, got {text}")
    return ms / 1000.0
