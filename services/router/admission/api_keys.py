"""API keys from a file, checked against `Authorization: Bearer KEY`. The file is read at
start; no file means no keys are needed (and no tenants exist).

The file, one key per line (blank lines and # comments ignored):

    KEY [tenant=NAME] [max_priority=N]

`tenant` groups keys that may share the prefix cache (default: the key is its own tenant);
`max_priority` caps the request's `x-priority` header for this key (default 0: a client may
lower its priority, never raise it). Keys should be ASCII; any other byte never matches and
never errors (the comparison is over bytes, in constant time per key).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Optional

from pdserve.services.router.api.errors import unauthorized
from pdserve.services.router.api.request_meta import PRIORITY_RANGE, bearer  # noqa: F401


@dataclass(frozen=True)
class ApiKey:
    secret: bytes  # the key itself
    tenant: str
    max_priority: int = 0

    def __post_init__(self):
        if not self.secret:
            raise ValueError("an API key must not be empty")
        if not self.tenant:
            raise ValueError("tenant must be a non-empty name")
        lo, hi = PRIORITY_RANGE
        if not lo <= self.max_priority <= hi:
            raise ValueError(f"max_priority must be in [{lo}, {hi}], got {self.max_priority}")

    @property
    def key_id(self) -> str:
        """A name for the key that does not reveal it (rate limit buckets, logs)."""
        return hashlib.sha256(self.secret).hexdigest()[:16]


def parse_key_line(line: str) -> ApiKey:
    key, *fields = line.split()
    secret = key.encode("utf-8")
    options = {}
    for f in fields:
        name, sep, value = f.partition("=")
        if not sep or name not in ("tenant", "max_priority") or not value:
            raise ValueError(f"bad field {f!r}: expected tenant=NAME or max_priority=N")
        options[name] = value
    try:
        max_priority = int(options.get("max_priority", 0))
    except ValueError:
        raise ValueError(f"max_priority must be an integer, got "
                         f"{options['max_priority']!r}") from None
    tenant = options.get("tenant") or "key-" + hashlib.sha256(secret).hexdigest()[:16]
    return ApiKey(secret, tenant, max_priority)


class KeyRing:
    """The keys the router accepts (empty: open, no keys needed)."""

    def __init__(self, keys: tuple[ApiKey, ...] = ()):
        self.keys = keys

    @classmethod
    def load(cls, path: str) -> "KeyRing":
        if not path:
            return cls()
        keys = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                try:
                    keys.append(parse_key_line(line))
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: {exc}") from None
        if not keys:
            raise ValueError(f"api key file {path} holds no keys")
        return cls(tuple(keys))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, presented: str) -> Optional[ApiKey]:
        """The key `presented` names; None when it names none. Every key is compared (no
        early exit), as bytes: a non-ASCII header never raises."""
        given = _as_bytes(presented)
        found = None
        for k in self.keys:
            if hmac.compare_digest(given, k.secret) and found is None:
                found = k
        return found

    def check(self, presented: str) -> Optional[ApiKey]:
        """The matching key; 401 when keys are set and none matches; None when open."""
        if not self.keys:
            return None
        key = self.match(presented)
        if key is None:
            raise unauthorized()
        return key


def load_api_keys(path: str) -> frozenset[str]:
    """The keys alone (text), for callers that need no tenants."""
    return frozenset(k.secret.decode("utf-8") for k in KeyRing.load(path).keys)


def check_key(keys: frozenset[str], key: str) -> None:
    """Raises 401 unless `key` is one of `keys` (when any are set)."""
    KeyRing(tuple(ApiKey(k.encode("utf-8"), "t") for k in keys)).check(key)


def _as_bytes(text: str) -> bytes:
    """HTTP header values reach us latin-1 decoded (each char one byte of the wire): encode
    them back to the bytes sent. gRPC metadata may carry other characters: UTF-8 then."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")
