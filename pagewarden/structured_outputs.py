"""What a request's output must match: a JSON schema, any JSON object, a regex, one of
a list of strings, or an EBNF/GBNF grammar (vLLM's ``StructuredOutputsParams``).

Pure Python (no torch, no grammar engine): it rides inside ``SamplingParams`` to the
engine core, which compiles it (``engine/grammar.py``) and masks the sampler with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Bounds on what one request may ask the grammar engine to compile.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024


class StructuredOutputsError(ValueError):
    """A structured-outputs spec is malformed; the message names what to fix."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint. Invariant (checked on construction): one field is set,
    each within ``MAX_SPEC_CHARS``; ``json`` is a JSON schema as JSON text, properties in their order (so
    the spec hashes, pickles and caches by value)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF / GBNF, root rule ``root``

    def __post_init__(self) -> None:
        set_ = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(set_) != 1:
            raise StructuredOutputsError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(set_) or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise StructuredOutputsError(f"choice must list 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) for c in self.choice):
                raise StructuredOutputsError("choice must list strings")
        if len(self.text) > MAX_SPEC_CHARS:
            raise StructuredOutputsError(
                f"the {self.kind} spec is {len(self.text)} characters; at most {MAX_SPEC_CHARS}"
            )

    @staticmethod
    def from_schema(schema: dict[str, Any] | str) -> StructuredOutputsParams:
        """A JSON-schema constraint from a schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputsError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputsError("a JSON schema must be a JSON object")
        return StructuredOutputsParams(json=json.dumps(schema))

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def text(self) -> str:
        """The spec as one string (the choices as a JSON list)."""
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return self.json or self.regex or self.grammar or ""

    @property
    def key(self) -> tuple[str, str]:
        """The compile-cache key."""
        return (self.kind, self.text)
