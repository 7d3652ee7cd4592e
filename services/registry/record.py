"""One instance's registry entry (JSON under `<prefix><address>`), typed both ways.

`cached` names blocks in the instance's local prefix cache by their first 8 bytes (the
router matches its prompt keys' prefixes against it); at 2,048 blocks that is 16 KiB.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

PREFIX_BYTES = 8
ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True)
class InstanceRecord:
    address: str  # host:port the router dials
    role: str
    model: str = ""
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    kv_usage: float = 0.0
    cached: frozenset = frozenset()  # PREFIX_BYTES-long block key prefixes

    def __post_init__(self):
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_json(self) -> str:
        return json.dumps({
            "address": self.address, "role": self.role, "model": self.model,
            "running": self.running, "waiting": self.waiting,
            "waiting_tokens": self.waiting_tokens, "kv_usage": self.kv_usage,
            "cached": base64.b64encode(b"".join(sorted(self.cached))).decode()})

    @classmethod
    def from_json(cls, text) -> "InstanceRecord":
        d = json.loads(text)
        raw = base64.b64decode(d.get("cached", ""))
        cached = frozenset(raw[i:i + PREFIX_BYTES] for i in range(0, len(raw), PREFIX_BYTES))
        return cls(d["address"], d["role"], d.get("model", ""), int(d.get("running", 0)),
                   int(d.get("waiting", 0)), int(d.get("waiting_tokens", 0)),
                   float(d.get("kv_usage", 0.0)), cached)
