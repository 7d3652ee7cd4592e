"""API keys from a file (one per line; blank lines and # comments ignored), checked against
`Authorization: Bearer KEY`. The file is read at start; an empty set means no keys needed."""

from __future__ import annotations

import hmac
from typing import Optional

from pdserve.services.router.api.errors import unauthorized


def load_api_keys(path: str) -> frozenset[str]:
    if not path:
        return frozenset()
    with open(path, encoding="utf-8") as f:
        keys = frozenset(line.strip() for line in f
                         if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"api key file {path} holds no keys")
    return keys


def bearer(authorization: Optional[str]) -> str:
    if not authorization:
        return ""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def check_key(keys: frozenset[str], key: str) -> None:
    """Raises 401 unless `key` is one of `keys` (when any are set)."""
    if not keys:
        return
    if not any(hmac.compare_digest(key, k) for k in keys):
        raise unauthorized()
