"""The producer's staging buffers: encoded objects (header space, then payload) that the
layer-by-layer copies fill and the puts send, one buffer per layer segment (segments.py).

A buffer of n objects of one segment is n * codec.nbytes bytes; `stage` gives, over each
buffer's payload regions, a tensor view [n, segment layers, 2, bs, kvh, d] to copy layers
into; `staged_blocks` cuts the buffers back into per-block object views for the puts (the
headers, with their MACs, are written just before each put).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.segments import LayerSegments

Block = tuple[bytes, list[memoryview]]  # a block's key, one encoded object per segment


@dataclass
class StagedStep:
    """The producer's staging for one forward: the blocks that become full in it."""
    staged: list  # (request id, key, block id)
    ids: torch.Tensor  # [n] their block ids
    views: list[torch.Tensor]  # per segment [n, segment layers, 2, bs, kvh, d] over bufs
    bufs: list[bytearray]  # per segment: n encoded objects
    earlier: list = field(default_factory=list)  # puts of segments done during the forward
    reserved: int = 0  # bytes of the connector's save budget these take (decode's saves)


def payload_view(codec: BlockCodec, buf: bytearray, n: int) -> torch.Tensor:
    """[n, layers, 2, bs, kvh, d] over the payload regions of n encoded blocks in buf."""
    size = torch.empty((), dtype=codec.dtype).element_size()
    flat = torch.frombuffer(buf, dtype=codec.dtype)
    inner = torch.empty(codec.payload_shape).stride()
    return flat.as_strided((n,) + codec.payload_shape, (codec.nbytes // size,) + inner,
                           HEADER_SIZE // size)


def stage(segments: LayerSegments, n: int) -> tuple[list[torch.Tensor], list[bytearray]]:
    """One buffer of n encoded objects per layer segment, and a payload view over each."""
    bufs = [bytearray(n * c.nbytes) for c in segments.codecs]
    return [payload_view(c, b, n) for c, b in zip(segments.codecs, bufs)], bufs


def staged_blocks(segments: LayerSegments, keys: list[bytes],
                  bufs: list[bytearray]) -> list[Block]:
    """Block j of staging buffers bufs, as (keys[j], one object view per segment)."""
    sizes = [c.nbytes for c in segments.codecs]
    whole = [memoryview(b) for b in bufs]
    return [(key, [w[j * n:(j + 1) * n] for w, n in zip(whole, sizes)])
            for j, key in enumerate(keys)]
