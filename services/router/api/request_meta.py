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

from pdserve.services.router.admission.api_keys import bearer
from pdserve.services.router.api.errors import bad_request

PRIORITY_RANGE = (-1000, 1000)


@dataclass(frozen=True)
class RequestMeta:
    api_key: str = ""
    priority: int = 0
    ttft_slo_s: Optional[float] = None  # None: the router's default
    affinity: Optional[str] = None


def meta_from_headers(get, affinity_header: str, user: Optional[str] = None) -> RequestMeta:
    """`get(name)`: a header's value or None (names lower-case)."""
    return RequestMeta(api_key=bearer(get("authorization")),
                       priority=_priority(get("x-priority")),
                       ttft_slo_s=_slo(get("x-ttft-slo-ms")),
                       affinity=get(affinity_header) or user or None)


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
