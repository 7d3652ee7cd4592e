"""Tenant isolation of the prefix cache: with API keys on, a request's cache salt is
HMAC-SHA256(router secret, tenant || 0 || client's cache_salt), so two tenants never share a
cached block (their block hashes differ from the first block on), and `cached_tokens` counts
only what the same tenant computed before. Keys never leave the router: the store and the
engines see only the keyed hash, and without the secret a salt cannot be guessed from a
tenant's name. Without API keys there are no tenants and the client's cache_salt goes through
as it is.

The secret comes from a file (`--tenant-secret-file`); routers that should share the cache
(several replicas) need the same one. Without a file each router makes a random secret at
start: isolation holds, but replicas and restarts do not share cached prefixes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
from typing import Optional

from pdserve.services.router.dispatch.job import Job

log = logging.getLogger(__name__)


def load_secret(path: str) -> bytes:
    """The secret in `path` (at least 16 bytes after stripping whitespace); a random one when
    `path` is empty."""
    if not path:
        return secrets.token_bytes(32)
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"tenant secret file {path} must hold at least 16 bytes")
    return secret


class TenantSalts:
    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("the tenant secret must be at least 16 bytes")
        self._secret = secret

    def salt(self, tenant: str, client_salt: Optional[str]) -> str:
        msg = tenant.encode("utf-8") + b"\x00" + (client_salt or "").encode("utf-8")
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def isolate(self, job: Job, tenant: Optional[str]) -> Job:
        """`job` with its salt made the tenant's (unchanged when there is no tenant)."""
        if tenant is None:
            return job
        salt = self.salt(tenant, job.cache_salt)
        choices = tuple(dataclasses.replace(c, params=dataclasses.replace(c.params,
                                                                         cache_salt=salt))
                        for c in job.choices)
        return dataclasses.replace(job, choices=choices, cache_salt=salt)
