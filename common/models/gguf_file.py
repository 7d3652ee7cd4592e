"""Opening a GGUF file fast enough to do it at every engine start.

gguf's `GGUFReader` parses the metadata by slicing its `np.memmap` once per value: SmolLM2's
tokenizer arrays alone are ~300k slices, and each slice of a memmap runs
`memmap.__array_finalize__`, which made one opening take ~12 s of CPU (twice per start: the
weights and the tokenizer). The reader below keeps the same mapping but slices it as a plain
ndarray view, so every field and tensor is the same array over the file's pages, made at a
fraction of the cost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader


class _PlainViewReader(GGUFReader):
    """`GGUFReader` whose `data` (the whole file, mapped read-only) is an ndarray view of the
    memmap; the view keeps the mapping alive through `.base`."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._mapped = mapped.view(np.ndarray)


def open_gguf(path: str | Path) -> GGUFReader:
    return _PlainViewReader(str(path))
