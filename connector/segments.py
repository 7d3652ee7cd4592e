"""Layer segments: one KV block stored as S objects, each a contiguous run of its layers, so a
producer can put the first layers' objects while the later layers still compute (layer-wise
streaming; docs/kv-reuse.md).

Segment s of a block holds layers [bounds[s], bounds[s + 1]) in the codec's layout, under its
own codec (num_layers = the run's length; every other field the block's). The last segment is
stored under the block's own key, and only after every earlier segment of that block was
stored: so "the block's key exists" (the router's and the connector's prefix lookups) still
means the whole block was written, and eviction of an earlier segment only makes a load stop
there (recompute). Earlier segments live under sha256(key || label || S || s): 32 bytes like
a block key, bound to S and s, and covered by the segment's MAC with its header, so a segment
is never read as another segment, as a block of another S, or as a whole block.

S = 1 is the whole-block object of the codec, byte for byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Optional

from pdserve.connector.codec import BlockCodec

MAX_SEGMENTS = 64
_LABEL = b"pdkv-layer-segment\0"


@dataclass(frozen=True)
class LayerSegments:
    codec: BlockCodec  # the whole block's
    count: int = 1
    bounds: tuple[int, ...] = field(init=False)  # count + 1 layer indices, 0 .. num_layers
    codecs: tuple[BlockCodec, ...] = field(init=False)  # one per segment

    def __post_init__(self):
        layers = self.codec.num_layers
        if not 1 <= self.count <= min(layers, MAX_SEGMENTS):
            raise ValueError(f"layer segments must be 1..{min(layers, MAX_SEGMENTS)} for a "
                             f"{layers}-layer model, got {self.count}")
        bounds = tuple(round(s * layers / self.count) for s in range(self.count + 1))
        object.__setattr__(self, "bounds", bounds)
        object.__setattr__(self, "codecs", (self.codec,) if self.count == 1 else tuple(
            dataclasses.replace(self.codec, num_layers=bounds[s + 1] - bounds[s])
            for s in range(self.count)))

    @property
    def nbytes(self) -> int:
        """Encoded bytes of one block, every segment's header included."""
        return sum(c.nbytes for c in self.codecs)

    def key(self, block_key: bytes, s: int) -> bytes:
        if s == self.count - 1:
            return block_key
        return hashlib.sha256(block_key + _LABEL + bytes([self.count, s])).digest()

    def of_layer(self, layer: int) -> int:
        """The segment holding `layer`."""
        for s in range(self.count):
            if layer < self.bounds[s + 1]:
                return s
        raise ValueError(f"layer {layer} is past the model's {self.codec.num_layers}")

    def ends_at(self, layer: int) -> Optional[int]:
        """The segment whose last layer is `layer`, or None."""
        s = self.of_layer(layer)
        return s if layer == self.bounds[s + 1] - 1 else None
