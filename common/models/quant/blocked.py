"""Large-M packed GEMMs on a weight expanded straight into oneDNN's blocked layout.

Why: handed a plain fp32 [N, K] weight, oneDNN's inner product reorders it into its blocked
layout on every call and multiplies more slowly than on a prepacked weight, the more so the
more rows (30 SmolLM2 layers on a Zen 5: 8% slower at M = 2048). So from quant/gemm.py's
BLOCKED_M rows on, the large-M path expands a packed weight into that layout itself (the
native `dequantize_blocked`, each fp32 weight written once at its place) and runs oneDNN on
it as on a prepacked weight: the fp32 path's GEMM, for an expansion ~3x a plain one's cost.
Measured in docs/packed-weights.md ("The Zen 5, session 21").

How: `probe_layout(n, k)` asks oneDNN which layout it gives an [n, k] fp32 weight: it reorders
an index matrix (each weight's flat index + 1, exact in fp32) and reads it back through
`torch.ops.mkldnn.data_ptr`. Where that layout is `BlockedLayout`'s (blocks of ob rows stored
column by column: "AB16b64a" on the Zen 5's AVX-512, the same order as "Ab64a") the probe
returns it and its reordered tensor, which becomes the shape's buffer; any other layout, or a
torch without those ops, gives None, and the caller expands plainly as before.

Lifecycle: one `BlockedWeights` per model, handed to every packed layer
(models/linear.py's `use_blocked_weights`). A shape's buffer is made by the first GEMM of that
shape past BLOCKED_M (the start-up profiling forward at the step budget, 2048 rows by default,
makes every one, so the memory plan counts them; the probe's own transient is one more
tensor of the weight's size) and lives as long as the model. Only one forward runs at a
time (the engine's one thread), so every layer of a shape shares one buffer: a GEMM finishes
before the next layer expands into it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.common.models.quant.packed import PackedWeight

# Largest buffer made (fp32 bytes): every SmolLM2-135M matrix but the LM head (113 MB), which
# keeps the plain path's bounded tiles, as do larger models' biggest matrices.
MAX_BYTES = 32 << 20


@dataclass(frozen=True)
class BlockedLayout:
    """oneDNN's "Ab{ob}a" layout of an [n, k] fp32 weight: blocks of ob rows, each block
    column by column (weight (r, c) at (r / ob) * ob * k + c * ob + r % ob; rows padded to a
    multiple of ob). Its "AB{ib}b{ob}a" is the same order for every ib."""

    n: int
    k: int
    ob: int  # weight rows per block (the innermost dimension)

    def __post_init__(self):
        if min(self.n, self.k) <= 0 or not 0 < self.ob <= 1024:
            raise ValueError(f"no blocked layout of [{self.n}, {self.k}] in blocks of "
                             f"{self.ob} rows")

    @property
    def numel(self) -> int:
        return -(-self.n // self.ob) * self.ob * self.k

    def offsets(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """[r1 - r0, k] int64: where the weights of rows r0 .. r1 (default: all) sit in the
        blocked buffer."""
        r = torch.arange(r0, self.n if r1 is None else r1).unsqueeze(1)
        c = torch.arange(self.k).unsqueeze(0)
        return (r // self.ob) * self.ob * self.k + c * self.ob + r % self.ob


def onednn_buffer(packed: torch.Tensor) -> torch.Tensor:
    """The memory of a oneDNN (mkldnn-layout) tensor as a flat fp32 tensor that shares it;
    valid while `packed` lives."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(raw, dtype=torch.float32)


def probe_layout(n: int, k: int) -> tuple[BlockedLayout, torch.Tensor] | None:
    """(layout, a oneDNN weight in it) for an [n, k] fp32 weight, or None where oneDNN's
    layout is not a `BlockedLayout` or this torch cannot show it. oneDNN reorders one index
    matrix (weight (r, c) = r * k + c + 1, exact in fp32 below 2^24 weights), which then
    serves as the shape's buffer: the probe's only transient is that plain matrix."""
    if not 0 < n * k < 1 << 24:
        return None
    try:
        index = torch.arange(1, n * k + 1, dtype=torch.float32).view(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(index)
        del index
        flat = onednn_buffer(packed)
    except (AttributeError, RuntimeError):  # an older torch, or no oneDNN
        return None
    layout = _match(n, k, flat)
    return None if layout is None else (layout, packed)


def _match(n: int, k: int, flat: torch.Tensor) -> BlockedLayout | None:
    """The layout that puts each weight's index r * k + c + 1 where oneDNN's reorder did (its
    padding holds zeros): ob is where weight (0, 1) landed."""
    second = (flat[:1025] == 2).nonzero()  # a block holds at most 1024 rows
    if k < 2 or second.numel() == 0:
        return None
    try:
        layout = BlockedLayout(n, k, int(second[0, 0]))
    except ValueError:
        return None
    if layout.numel != flat.numel():
        return None
    step = max(1, (1 << 18) // k)  # rows checked at a time: bounded transient memory
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        want = torch.arange(r0 * k + 1, r1 * k + 1, dtype=torch.float32)
        if not torch.equal(flat[layout.offsets(r0, r1).reshape(-1)], want):
            return None
    return layout


class BlockedWeights:
    """One oneDNN weight buffer per weight shape, shared by a model's packed layers."""

    def __init__(self, native, max_bytes: int = MAX_BYTES):
        """native: the packed-kernel module (`dequantize_blocked`); max_bytes: the largest
        buffer made (larger weights get None from `expand`)."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._native = native
        self._max_bytes = max_bytes
        # (n, k) -> (layout, oneDNN tensor, flat view of its memory); None: plain path
        self._buffers: dict[tuple[int, int], tuple[BlockedLayout, torch.Tensor,
                                                   torch.Tensor] | None] = {}

    def expand(self, w: PackedWeight) -> torch.Tensor | None:
        """w expanded into its shape's buffer: a oneDNN weight for `_linear_pointwise`, valid
        until the next `expand` of that shape; None where the shape has no buffer."""
        buf = self._buffer(w.out_features, w.in_features)
        if buf is None:
            return None
        layout, packed, flat = buf
        self._native.dequantize_blocked(w.data, int(w.qtype), w.in_features, flat, layout.ob)
        return packed

    @property
    def nbytes(self) -> int:
        """Bytes the buffers made so far hold."""
        return sum(b[2].numel() * 4 for b in self._buffers.values() if b is not None)

    def _buffer(self, n: int, k: int):
        if (n, k) not in self._buffers:
            probed = probe_layout(n, k) if 4 * n * k <= self._max_bytes else None
            self._buffers[(n, k)] = (None if probed is None
                                     else (*probed, onednn_buffer(probed[1])))
        return self._buffers[(n, k)]
