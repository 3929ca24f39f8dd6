"""Validation errors: every problem reported, in the request's own order, never a repr."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from pagewarden.server.context import parse_body
from pagewarden.server.errors import MAX_REPORTED_ERRORS, APIError, validation_error


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = 1
    kind: Literal["a", "b"] = "a"
    stop: list[str] = []


def _refusal(body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(_Req, json.dumps(body).encode())
    return info.value


def test_errors_follow_the_bodys_field_order_then_missing_fields() -> None:
    err = _refusal({"kind": "c", "extra": 1, "n": "x", "stop": ["ok", 3]})
    paths = [part.split(": ")[0] for part in err.message.split("; ")]
    assert paths == ["kind", "extra", "n", "stop.1", "model"]
    assert err.param == "kind" and err.status == 400
    err = _refusal({"n": "x", "extra": 1, "kind": "c"})
    assert [p.split(": ")[0] for p in err.message.split("; ")] == ["n", "extra", "kind", "model"]


def test_the_order_the_validator_lists_errors_in_does_not_matter() -> None:
    errors = [
        {"type": "missing", "loc": ("profile",), "msg": "Field required"},
        {"type": "extra_forbidden", "loc": ("mode",), "msg": "Extra inputs are not permitted"},
        {"type": "int_parsing", "loc": ("stop", 1), "msg": "Input should be a valid integer"},
        {"type": "int_parsing", "loc": ("stop", 0), "msg": "Input should be a valid integer"},
    ]
    order = ["mode", "stop", "profile"]
    first = validation_error(errors, order)
    assert validation_error(list(reversed(errors)), order).message == first.message
    assert first.message.startswith("mode: Extra inputs are not permitted; stop.0: ")
    assert first.param == "mode"


def test_at_most_the_cap_is_listed_and_the_rest_counted() -> None:
    errors = [{"loc": (f"f{i}",), "msg": "bad"} for i in range(MAX_REPORTED_ERRORS + 3)]
    err = validation_error(errors, [f"f{i}" for i in range(MAX_REPORTED_ERRORS + 3)])
    assert err.message.count("; ") == MAX_REPORTED_ERRORS - 1
    assert err.message.endswith("(and 3 more)")


def test_no_python_reprs_reach_the_client() -> None:
    err = _refusal({"model": "m", "n": {"deep": [1]}, "stop": "x"})
    assert "{" not in err.message and "'loc'" not in err.message and "'input'" not in err.message
    assert err.message.startswith("n: ")


def test_invalid_json_is_one_clear_message() -> None:
    with pytest.raises(APIError) as info:
        parse_body(_Req, b'{"model": ')
    assert info.value.message.startswith("the request body is not valid JSON")
