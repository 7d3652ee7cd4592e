"""Keys, capabilities and signed tokens of the store path (see docs/kvstore-security.md).

Two secrets, two trust domains, each read from a file (never argv, never logged):

- the *store secret*, shared by the master, the storage nodes and store administrators. It
  derives the grant key (the master signs capabilities, nodes check them), the register key
  (a node proves it may join) and the admin key (Remove and other admin calls).
- the *block secret*, shared by the engines and the router. It derives the block MAC key
  (every stored block carries an HMAC over header and payload, connector/codec.py) and the
  object-key salt (store keys are HMACs of block hashes, so nobody without the secret can
  predict, squat on or probe a key).

A storage node never holds the block secret, so a compromised node can drop or corrupt blocks
but cannot forge one that an engine accepts; the master holds neither the MAC key nor the salt.

A capability names op, node, offset, length and an absolute expiry (wall clock, ms); the node
checks it against its own id and clock without asking the master. It is a bearer token: the
master hands it out over its (mTLS) channel and it is good until it expires.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
CAPABILITY = struct.Struct("!Q32s")  # expiry (unix ms), HMAC-SHA256 tag
_CAP_BODY = struct.Struct("!cQQQ")  # op, offset, length, expiry ms
TOKEN = struct.Struct("!Q32s")  # issued at (unix ms), HMAC-SHA256 tag
_ENV_LINE = re.compile(rb"^[A-Za-z_][A-Za-z0-9_]*=(.*)$")


class AuthError(ValueError):
    """A capability or token that is missing, malformed, expired or not signed by our key."""


def read_secret(path: str) -> bytes:
    """The secret in `path`: the file's content, or the value of its one `NAME=value` line
    (an env file), surrounding whitespace stripped. At least MIN_SECRET_BYTES."""
    with open(path, "rb") as f:
        raw = f.read(MAX_SECRET_BYTES + 1)
    if len(raw) > MAX_SECRET_BYTES:
        raise ValueError(f"secret file {path} is larger than {MAX_SECRET_BYTES} bytes")
    raw = raw.strip()
    m = _ENV_LINE.match(raw)
    if m and b"\n" not in raw:
        raw = m.group(1).strip().strip(b"\"'")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"secret in {path} is shorter than {MIN_SECRET_BYTES} bytes")
    return raw


def secret_from(path: str, env: str) -> bytes | None:
    """The secret from `path`, else from the file named by $`env`; None when neither is set."""
    path = path or os.environ.get(env, "")
    return read_secret(path) if path else None


def derive(secret: bytes, label: bytes) -> bytes:
    """An independent 32-byte key per use, so one leaked derived key exposes no other."""
    return hmac.new(secret, b"pdserve-kv/" + label, hashlib.sha256).digest()


UNKEYED_MAC_KEY = b"pdserve-kv-unkeyed-block-mac"  # without a block secret: integrity only
STORE_SECRET_ENV = "PDSERVE_KV_STORE_SECRET_FILE"
BLOCK_SECRET_ENV = "PDSERVE_KV_BLOCK_SECRET_FILE"


@dataclass(frozen=True, repr=False)
class StoreKeys:
    """Keys derived from the store secret (master, nodes, admins). repr hides them."""
    grant: bytes
    register: bytes
    admin: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> "StoreKeys":
        return cls(derive(secret, b"grant"), derive(secret, b"register"), derive(secret, b"admin"))

    def __repr__(self) -> str:
        return "StoreKeys(<redacted>)"


def load_store_keys(path: str) -> "StoreKeys | None":
    """The store keys from `path` (or $PDSERVE_KV_STORE_SECRET_FILE); None, with a warning,
    when neither names a file: the store then runs unauthenticated."""
    secret = secret_from(path, STORE_SECRET_ENV)
    if secret is None:
        log.warning("kvstore: no store secret (--store-secret-file / $%s): storage nodes "
                    "serve any READ/WRITE and anyone may register nodes or remove objects",
                    STORE_SECRET_ENV)
        return None
    return StoreKeys.from_secret(secret)


def load_block_keys(path: str) -> "BlockKeys | None":
    """The block keys from `path` (or $PDSERVE_KV_BLOCK_SECRET_FILE); None, with a warning,
    when neither names a file: blocks then carry an unkeyed MAC and predictable keys."""
    secret = secret_from(path, BLOCK_SECRET_ENV)
    if secret is None:
        log.warning("kv connector: no block secret (--kv-block-secret-file / $%s): stored "
                    "blocks are not authenticated and their keys are predictable",
                    BLOCK_SECRET_ENV)
        return None
    return BlockKeys.from_secret(secret)


@dataclass(frozen=True, repr=False)
class BlockKeys:
    """Keys derived from the block secret (engines, router). repr hides them."""
    mac: bytes
    object_salt: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> "BlockKeys":
        return cls(derive(secret, b"block-mac"), derive(secret, b"object-key"))

    def object_key(self, block_hash: bytes) -> bytes:
        """The store key of a block: unpredictable without the secret, same in every process."""
        return hmac.new(self.object_salt, block_hash, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "BlockKeys(<redacted>)"


def _cap_tag(key: bytes, op: bytes, node_id: str, offset: int, length: int,
             expiry_ms: int) -> bytes:
    msg = b"cap1" + node_id.encode() + b"\0" + _CAP_BODY.pack(op, offset, length, expiry_ms)
    return hmac.new(key, msg, hashlib.sha256).digest()


def sign_capability(key: bytes, op: bytes, node_id: str, offset: int, length: int,
                    expiry_s: float) -> bytes:
    expiry_ms = int(expiry_s * 1000)
    return CAPABILITY.pack(expiry_ms, _cap_tag(key, op, node_id, offset, length, expiry_ms))


def check_capability(key: bytes, op: bytes, node_id: str, offset: int, length: int,
                     capability: bytes, now_s: float, skew_s: float) -> None:
    """Raises AuthError unless `capability` grants `op` on [offset, offset+length) of this
    node and has not expired (allowing `skew_s` of clock difference with the master)."""
    if len(capability) != CAPABILITY.size:
        raise AuthError("request carries no capability")
    expiry_ms, tag = CAPABILITY.unpack(capability)
    if not hmac.compare_digest(tag, _cap_tag(key, op, node_id, offset, length, expiry_ms)):
        raise AuthError("capability does not grant this range")
    if expiry_ms / 1000 + skew_s < now_s:
        raise AuthError("capability expired")


def sign_token(key: bytes, label: bytes, body: bytes, now_s: float) -> bytes:
    """A short-lived proof that the caller holds `key`, bound to `label` and `body`."""
    ms = int(now_s * 1000)
    return TOKEN.pack(ms, _token_tag(key, label, body, ms))


def _token_tag(key: bytes, label: bytes, body: bytes, ms: int) -> bytes:
    return hmac.new(key, label + b"\0" + ms.to_bytes(8, "big") + body, hashlib.sha256).digest()


def check_token(key: bytes, label: bytes, body: bytes, token: bytes, now_s: float,
                max_age_s: float) -> None:
    if len(token) != TOKEN.size:
        raise AuthError(f"{label.decode()} needs the store secret's token")
    ms, tag = TOKEN.unpack(token)
    if not hmac.compare_digest(tag, _token_tag(key, label, body, ms)):
        raise AuthError(f"{label.decode()} token is not signed by the store secret")
    if abs(now_s - ms / 1000) > max_age_s:
        raise AuthError(f"{label.decode()} token is too old (or the clocks differ)")


def register_body(node) -> bytes:
    """What a registration token binds: the whole registration (a NodeInfo)."""
    return "\0".join((node.node_id, node.address, str(node.capacity),
                      node.incarnation)).encode()


def remove_body(keys: list[bytes], force: bool) -> bytes:
    """What a Remove token binds: the keys and the force flag."""
    h = hashlib.sha256(b"force" if force else b"keep")
    for k in keys:
        h.update(len(k).to_bytes(2, "big") + k)
    return h.digest()
