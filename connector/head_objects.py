"""Head objects: one KV block stored as K objects, one per KV head (every layer of that head),
so a tensor-parallel rank moves only its own heads' bytes, and a block written by any layout
is readable by any other (docs/parallelism.md, "Per-rank transfers").

Why per-head objects and not per-rank ones or byte ranges of one object: the shard has to be
a unit no layout owns. A rank of any T holds a contiguous run of whole KV heads
(common/distributed/layout.py), so it reads and writes exactly the objects of its heads,
whoever wrote them; and each object is an ordinary store object: its own MAC (a BlockCodec of
one head), its own capability from the master, its own lease, no range support in the store.

Object h of a block with key k holds [layers, 2, block_size, 1, head_dim] of head h (the
codec's payload with kv_heads = 1). The last head's object is stored under k itself, so the
block-lookup keys (the router's, the connector's prefix lookup) stay the layout-independent
chained hashes; the others live under sha256(k || label || K || h): 32 bytes like a block key,
bound to the head count and the head, and covered by the object's MAC with its header, so a
head object is never read as another head, as a head of a model with another K, or as a whole
block. A reader that misses any of a block's head objects (evicted, or a rank's put not in yet)
treats the block as missing: the load stops there and the engine recomputes from it.

`RankHeads` is one rank's side: its caches and its run of heads, encoding and installing only
those heads' objects (rank_transfers.py moves them through a store, a worker process runs
them: rank_kv_factory.py). Not used by an engine yet: the connector still stores whole
blocks, copied by rank 0 through shared memory; what is left (rank 0's engine side and a
connector mode) is listed in docs/parallelism.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import dataclass, field

import torch

from pdserve.connector.codec import BlockCodec

_LABEL = b"pdkv-head-object\0"
_HEAD = struct.Struct("<HH")  # K, h


@dataclass(frozen=True)
class HeadObjects:
    codec: BlockCodec  # the whole block's
    head_codec: BlockCodec = field(init=False)  # every head object's (kv_heads = 1)

    def __post_init__(self):
        if not 1 <= self.codec.num_kv_heads <= 0xFFFF:
            raise ValueError(f"num_kv_heads must be 1..65535, got {self.codec.num_kv_heads}")
        object.__setattr__(self, "head_codec",
                           dataclasses.replace(self.codec, num_kv_heads=1))

    @property
    def count(self) -> int:
        return self.codec.num_kv_heads

    def key(self, block_key: bytes, head: int) -> bytes:
        """The store key of head `head`'s object of the block stored under block_key."""
        if not 0 <= head < self.count:
            raise ValueError(f"head must be in [0, {self.count}), got {head}")
        if head == self.count - 1:
            return block_key
        return hashlib.sha256(block_key + _LABEL + _HEAD.pack(self.count, head)).digest()


class RankHeads:
    """One rank's side of head objects: heads [offset, offset + h) of every layer."""

    def __init__(self, objects: HeadObjects, caches: list[torch.Tensor], offset: int):
        """caches[l]: this rank's cache of layer l, [2, blocks, block_size, h, head_dim]."""
        c = objects.codec
        if len(caches) != c.num_layers:
            raise ValueError(f"{len(caches)} layer caches for a {c.num_layers}-layer block")
        heads = caches[0].shape[3]
        if offset < 0 or offset + heads > c.num_kv_heads:
            raise ValueError(f"heads [{offset}, {offset + heads}) are not in the block's "
                             f"{c.num_kv_heads}")
        self.objects, self.caches, self.offset, self.num_heads = objects, caches, offset, heads

    @property
    def heads(self) -> range:
        return range(self.offset, self.offset + self.num_heads)

    def keys(self, block_key: bytes) -> list[bytes]:
        """The store keys of this rank's objects of a block, in head order."""
        return [self.objects.key(block_key, h) for h in self.heads]

    def encode(self, block_key: bytes, block_id: int) -> list[tuple[bytes, memoryview]]:
        """This rank's heads of block block_id as encoded objects (header, MAC, payload)."""
        codec = self.objects.head_codec
        block = torch.stack([cache[:, block_id] for cache in self.caches])  # [L, 2, bs, h, d]
        out = []
        for j, key in enumerate(self.keys(block_key)):
            buf = bytearray(codec.nbytes)
            out.append((key, codec.encode_into(key, block[..., j:j + 1, :], buf)))
        return out

    def install(self, block_key: bytes, block_id: int, objs: list[memoryview]) -> None:
        """Validate this rank's head objects of a block (raises BlockCodecError on any that
        fails its MAC or header) and only then write them into block block_id."""
        keys = self.keys(block_key)
        if len(objs) != len(keys):
            raise ValueError(f"{len(objs)} objects for {len(keys)} heads")
        codec = self.objects.head_codec
        heads = [codec.decode(k, o) for k, o in zip(keys, objs)]  # each [L, 2, bs, 1, d]
        block = torch.cat(heads, dim=3)  # [L, 2, bs, h, d]
        for layer, cache in enumerate(self.caches):
            cache[:, block_id].copy_(block[layer])
