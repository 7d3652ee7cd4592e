"""A request's structured-output constraint, as the engine receives it: a typed, validated
value (no grammar library here; common/engine/grammar.py compiles it).

The constraint is a property of the request alone, so a grammar state can always be rebuilt
from it plus the tokens generated so far (store hit, migration, preemption, prefill -> decode).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

MAX_SPEC_CHARS = 64 * 1024  # a schema / regex / grammar a client sends is bounded
MAX_CHOICES = 256


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec unused
    REGEX = "regex"  # spec: the pattern
    CHOICE = "choice"  # choices: one of these strings exactly
    GRAMMAR = "grammar"  # spec: an EBNF grammar (GBNF-style, root rule "root")


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.kind, StructuredKind):
            raise ValueError(f"structured_output kind must be one of "
                             f"{[k.value for k in StructuredKind]}, got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_output spec must be a string of at most "
                             f"{MAX_SPEC_CHARS} characters")
        k = self.kind
        if k in (StructuredKind.REGEX, StructuredKind.GRAMMAR, StructuredKind.JSON_SCHEMA) \
                and not self.spec:
            raise ValueError(f"structured_output {k.value} needs a non-empty spec")
        if k == StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except (ValueError, RecursionError):
                raise ValueError("structured_output json_schema must be valid JSON") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_output json_schema must be a JSON object")
        if k == StructuredKind.CHOICE:
            if not 0 < len(self.choices) <= MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in self.choices):
                raise ValueError(f"structured_output choice needs 1..{MAX_CHOICES} non-empty "
                                 f"strings")
            if sum(len(c) for c in self.choices) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_output choices exceed {MAX_SPEC_CHARS} characters")
