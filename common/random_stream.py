"""Counter-based random numbers for sampling: the uniform that draws a request's k-th output
token is a function of (seed, k) and nothing else.

So the same seeded request gives the same text on every path: sampled on a prefill instance
and continued on a decode instance, after a store hit, unified, preempted and recomputed,
migrated, in any batch and at any row of it. There is no generator state to carry or
advance; a decode instance that takes over at output position k computes position k's number.

The generator is SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014): a request's stream is the SplitMix64 sequence whose state starts at
`stream_key(seed)`, and the k-th number is its (k+1)-th output, mix(key + (k+1) * golden), so
position k is reached in O(1). Pure Python on purpose: exact 64-bit arithmetic, identical on
every machine and device, and importable without torch (the router derives choice seeds).
"""

from __future__ import annotations

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio, odd)
_CHOICE = 0xD1B54A32D192ED03  # an odd constant that separates choice seeds from positions
_TO_UNIT = 2.0 ** -53


def _mix64(z: int) -> int:
    """SplitMix64's output function (a bijection on 64-bit ints)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """The generator state a request's stream starts from; any int seed (negatives too)."""
    return _mix64((seed + _GOLDEN) & _M64)


def uniform(key: int, position: int) -> float:
    """The number in [0, 1) (53 random bits) for output position `position` (0 = first)."""
    return (_mix64((key + (position + 1) * _GOLDEN) & _M64) >> 11) * _TO_UNIT


def derive_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `n` choices: choice 0 keeps the request's
    seed (n=1 and the first of n agree); the others get hashed seeds in [0, 2**63), which do
    not collide with a neighbouring request's seed as seed + index would."""
    if index == 0:
        return seed
    return _mix64((stream_key(seed) ^ ((index * _CHOICE) & _M64)) & _M64) >> 1
