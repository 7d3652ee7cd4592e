"""The KV store's two secrets, made once per stack (docs/kvstore-security.md):

- `store-secret`: shared by the master and its storage nodes (node registration, admin calls,
  and the capabilities the master signs for every READ/WRITE a node serves);
- `block-secret`: shared by the engines and the router (the store's keys of blocks and the MAC
  every stored block carries).

Two secrets, so the store's side never holds what forges blocks, and an engine never holds
what registers nodes. `pdserve up` makes them in its private run folder, compose's `secrets`
step in its volume (`pdserve certs --kv-secrets-out`); the chart keeps them in a Secret. Files
are 0600 (0640 with `group_readable`, for a container user in the volume's group); existing
files are kept so restarts and replicas agree.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

STORE_SECRET = "store-secret"
BLOCK_SECRET = "block-secret"


@dataclass(frozen=True)
class KVSecretFiles:
    store: str  # path of the store secret
    block: str  # path of the block secret


def make_kv_secrets(out_dir: str | os.PathLike, group_readable: bool = False) -> KVSecretFiles:
    """Both secrets in `out_dir` (created 0700/0750), each 32 random bytes as hex."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o750 if group_readable else 0o700)
    for name in (STORE_SECRET, BLOCK_SECRET):
        path = out / name
        if path.exists():
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640 if group_readable
                     else 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return KVSecretFiles(str(out / STORE_SECRET), str(out / BLOCK_SECRET))
