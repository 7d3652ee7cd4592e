"""The KV hand-off parameters a caller gives a request (a decode instance continuing what a
prefill instance computed), as one typed value instead of a dict of hints."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BLOCK_KEYS = 65536  # a 1M-token prompt at block size 16; a peer cannot make us hold more
MAX_KEY_BYTES = 64


@dataclass(frozen=True)
class KVTransferParams:
    """`block_keys`: the store keys of the prompt's leading blocks that the producer saved, in
    order. The consumer's connector trusts this list instead of asking the store how many of
    the prompt's blocks exist (it still falls back to recomputation when a load fails)."""

    block_keys: tuple[bytes, ...] = ()
    # False opts the request out of decode's finish-time save of its blocks (KV reuse,
    # docs/kv-reuse.md); a prefill instance may still save its prompt.
    store_output: bool = True

    def __post_init__(self):
        keys = tuple(self.block_keys)
        if len(keys) > MAX_BLOCK_KEYS:
            raise ValueError(f"block_keys has {len(keys)} keys; at most {MAX_BLOCK_KEYS}")
        for k in keys:
            if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY_BYTES:
                raise ValueError(f"block_keys must be bytes of 1..{MAX_KEY_BYTES} bytes")
        object.__setattr__(self, "block_keys", keys)


NO_KV_TRANSFER = KVTransferParams()
