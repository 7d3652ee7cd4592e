"""Which instance the router last sent each prompt block to: a bounded LRU of block key ->
instances, the router's own guess of the instances' local prefix caches (a guess: the engine
may have evicted a block since; instances that report their caches in the registry correct
it). Leading blocks only count: a block is reusable only after every block before it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

_MAX_HOLDERS = 4  # a hot prefix sent everywhere needs no more to be found


class PrefixMemory:
    def __init__(self, capacity_blocks: int):
        self._capacity = capacity_blocks
        self._holders: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, keys: Sequence[bytes], address: str) -> None:
        if not self._capacity:
            return
        for k in keys:
            held = self._holders.pop(k, ())
            if address not in held:
                held = (held + (address,))[-_MAX_HOLDERS:]
            self._holders[k] = held
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)

    def forget(self, address: str) -> None:
        """An instance left (its cache with it)."""
        for k in [k for k, held in self._holders.items() if address in held]:
            rest = tuple(a for a in self._holders[k] if a != address)
            if rest:
                self._holders[k] = rest
            else:
                del self._holders[k]

    def leading(self, keys: Sequence[bytes]) -> dict[str, int]:
        """address -> how many leading `keys` the router sent there (absent: none)."""
        out: dict[str, int] = {}
        alive: set[str] = set()
        for i, k in enumerate(keys):
            held = set(self._holders.get(k, ()))
            alive = held if i == 0 else alive & held
            for a in alive:
                out[a] = i + 1
            if not alive:
                break
        return out
