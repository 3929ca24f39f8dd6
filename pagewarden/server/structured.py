"""Structured outputs at the front door: which constraint a body asks for, and a 400 that
names what is wrong with it, decided off the event loop.

The sources, at most one per request: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) and its deprecated ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. Tool calling (``tools.py``) adds its own
constraint for ``tool_choice`` ``required`` and named functions.
"""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from typing import Any

from pagewarden.engine.grammar import GrammarError, check_spec
from pagewarden.server.errors import APIError
from pagewarden.structured_outputs import StructuredOutputsError, StructuredOutputsParams


def _schema_spec(schema: Any, param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_schema(schema)
    except StructuredOutputsError as exc:
        raise APIError(400, str(exc), param) from None


def requested_spec(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a body asks for and the field it came from; (None, None) if none."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutputsParams(json_object=True), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema",
                "response_format.json_schema",
            )
        param = "response_format.json_schema.schema"
        found.append((_schema_spec(rf.json_schema.schema_, param), param))
    so = req.structured_outputs
    if so is not None:
        found.append(
            (
                _from_fields(so.json_, so.regex, so.choice, so.grammar, so.json_object),
                "structured_outputs",
            )
        )
    guided = [
        (name, getattr(req, name))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if getattr(req, name) is not None
    ]
    for name, value in guided:
        kind = name.removeprefix("guided_")
        found.append((_from_fields(**{"json_" if kind == "json" else kind: value}), name))
    backend = req.guided_decoding_backend
    if backend not in (None, "auto", "xgrammar"):
        raise APIError(
            400,
            f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
            "guided_decoding_backend",
        )
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise APIError(
            400, f"at most one structured-outputs constraint per request, got {names}", found[1][1]
        )
    return found[0] if found else (None, None)


def _from_fields(
    json_: Any = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    json_object: bool | None = None,
) -> StructuredOutputsParams:
    param = "structured_outputs"
    if json_ is not None:
        spec = _schema_spec(json_, param)
        if regex or choice is not None or grammar or json_object:
            raise APIError(400, "structured_outputs takes exactly one constraint", param)
        return spec
    try:
        return StructuredOutputsParams(
            regex=regex,
            choice=tuple(choice) if choice is not None else None,
            grammar=grammar,
            json_object=bool(json_object),
        )
    except StructuredOutputsError as exc:
        raise APIError(400, str(exc), param) from None


@lru_cache(maxsize=512)
def _problem(spec: StructuredOutputsParams) -> str | None:
    """What is wrong with ``spec`` (None: nothing); cached per spec."""
    if spec.json is not None:
        from jsonschema import SchemaError
        from jsonschema.validators import validator_for

        schema = json.loads(spec.json)
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "(root)"
            return f"invalid JSON schema at {where}: {exc.message}"
    try:
        check_spec(spec)
    except GrammarError as exc:
        return str(exc)
    return None


async def check(spec: StructuredOutputsParams | None, param: str | None) -> None:
    """400 naming the problem unless ``spec`` is compilable and enforceable; the work runs
    in a worker thread, never on the event loop."""
    if spec is None:
        return
    problem = await asyncio.to_thread(_problem, spec)
    if problem is not None:
        raise APIError(400, problem, param)
