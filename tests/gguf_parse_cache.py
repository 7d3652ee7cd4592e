"""transformers' GGUF loader without its repeated parsing, for the tests' reference models.

transformers reads a GGUF file once for the config, once for the tokenizer and once for the
weights, and each time gguf-py parses every metadata field in Python, the 49k-entry vocabulary
included (~11 s each on a Zen 1); mapping the weights' names then rebuilds gguf-py's tensor-name
table once per module (397 times for SmolLM2, ~11 s). Inside `active()` each file is parsed once
and each table built once per (architecture, layers). What transformers reads is unchanged:
the same gguf-py objects, built by the same code, shared instead of rebuilt. Our own loader
never runs inside `active()`, so it keeps its own reader.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

import gguf


class GgufParseCache:
    """One parse per (file, mode) and one name table per (architecture, layers), for the life
    of the cache (a session fixture owns one)."""

    def __init__(self) -> None:
        self._new_reader = gguf.GGUFReader
        self._readers: dict[tuple[str, str], gguf.GGUFReader] = {}
        self._name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)

    def _reader(self, path, mode: str = "r") -> gguf.GGUFReader:
        key = (str(path), mode)
        if key not in self._readers:
            self._readers[key] = self._new_reader(path, mode)
        return self._readers[key]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """transformers imports both names from `gguf` when it loads, so patching the module's
        attributes for the duration of a `from_pretrained` is enough."""
        with mock.patch.object(gguf, "GGUFReader", self._reader), \
                mock.patch.object(gguf, "get_tensor_name_map", self._name_map):
            yield
