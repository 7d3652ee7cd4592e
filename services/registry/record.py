"""One instance's registry entry (JSON under `<prefix><address>`), typed both ways.

`cached` names blocks in the instance's local prefix cache by their first 8 bytes (the
router matches its prompt keys' prefixes against it); at 2,048 blocks that is 16 KiB.
Anyone who can write to the registry controls what `from_json` reads, so it checks every
field's type and range and the entry's size, and raises ValueError on anything else: the
watcher skips such an entry with a warning and goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

PREFIX_BYTES = 8
ROLES = ("unified", "prefill", "decode")
MAX_ENTRY_BYTES = 64 * 1024  # a 2,048-block summary is ~22 KB of base64
MAX_SUMMARY_BLOCKS = 4096
_MAX_COUNT = 1 << 31
_MAX_TEXT = 512  # address, model, fingerprint


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
    fingerprint: str = ""  # the model fingerprint its block keys are seeded with
    block_size: int = 0

    def __post_init__(self):
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("address", "model", "fingerprint"):
            if len(getattr(self, name)) > _MAX_TEXT:
                raise ValueError(f"{name} is longer than {_MAX_TEXT} characters")
        for name in ("running", "waiting", "waiting_tokens", "block_size"):
            if not 0 <= getattr(self, name) < _MAX_COUNT:
                raise ValueError(f"{name} must be in [0, 2^31)")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if len(self.cached) > MAX_SUMMARY_BLOCKS:
            raise ValueError(f"cache summary over {MAX_SUMMARY_BLOCKS} blocks")

    def to_json(self) -> str:
        return json.dumps({
            "address": self.address, "role": self.role, "model": self.model,
            "fingerprint": self.fingerprint, "block_size": self.block_size,
            "running": self.running, "waiting": self.waiting,
            "waiting_tokens": self.waiting_tokens, "kv_usage": self.kv_usage,
            "cached": base64.b64encode(b"".join(sorted(self.cached))).decode()})

    @classmethod
    def from_json(cls, text) -> "InstanceRecord":
        """Raises ValueError for anything but a well-formed, bounded entry."""
        if len(text) > MAX_ENTRY_BYTES:
            raise ValueError(f"entry of {len(text)} bytes is over {MAX_ENTRY_BYTES}")
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("entry is not a JSON object")
        try:
            raw = base64.b64decode(_typed(d, "cached", str, ""), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"cached is not base64: {exc}") from None
        if len(raw) % PREFIX_BYTES:
            raise ValueError("cached is not a whole number of key prefixes")
        cached = frozenset(raw[i:i + PREFIX_BYTES] for i in range(0, len(raw), PREFIX_BYTES))
        return cls(_typed(d, "address", str), _typed(d, "role", str),
                   _typed(d, "model", str, ""), _typed(d, "running", int, 0),
                   _typed(d, "waiting", int, 0), _typed(d, "waiting_tokens", int, 0),
                   float(_typed(d, "kv_usage", (int, float), 0.0)), cached,
                   _typed(d, "fingerprint", str, ""), _typed(d, "block_size", int, 0))


_MISSING = object()


def _typed(d: dict, name: str, kind, default=_MISSING):
    value = d.get(name, default)
    if value is _MISSING:
        raise ValueError(f"entry has no {name}")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} has the wrong type ({type(value).__name__})")
    return value
