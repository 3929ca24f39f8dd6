"""A body's JSON values counted from its raw bytes (server/json_budget.py), before parsing.

The counts are compared with what ``json.loads`` builds, on random documents whose
strings are full of quotes, backslashes, brackets and commas, cut into pieces of random
sizes (an escape must never be split between two pieces).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagewarden.server.errors import APIError
from pagewarden.server.json_budget import (
    COSTLY_FLOOR,
    SCAN_MIN_BYTES,
    VALUES_FLOOR,
    JsonBudget,
    json_shape,
)

_TRICKY = st.text(alphabet=st.sampled_from(list('ab"\\,:[]{}\n\u00e9\U0001f642 ')), max_size=12)
_NUMBERS = st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False)
_SCALARS = st.none() | st.booleans() | _NUMBERS | _TRICKY
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_TRICKY, inner, max_size=5),
    max_leaves=40,
)


def _census(doc) -> tuple[int, int, int]:
    """(values and keys, costly ones (arrays, objects, strings with keys, and each . e E
    of floats and booleans), empty arrays and objects)."""
    if isinstance(doc, list):
        parts = [_census(x) for x in doc]
        own = (1, 1, int(not doc))
    elif isinstance(doc, dict):
        parts = [_census(v) for v in doc.values()] + [(1, 1, 0)] * len(doc)
        own = (1, 1, int(not doc))
    else:
        marks = sum(c in ".eE" for c in json.dumps(doc))
        parts, own = [], (1, 1 if isinstance(doc, str) else marks, 0)
    return tuple(sum(c) for c in zip(own, *parts))  # type: ignore[return-value]


@settings(max_examples=300, deadline=None)
@given(_DOCS, st.booleans(), st.sampled_from([None, 2]), st.integers(1, 64))
def test_the_shape_counts_what_the_parser_builds(doc, ascii_only, indent, piece):
    body = json.dumps(doc, ensure_ascii=ascii_only, indent=indent).encode()
    values, costly, empty = _census(doc)
    shape = json_shape(body, piece_bytes=piece)
    assert shape.costly == costly
    # one per separator or opening bracket, and the top level: exact but for empty ones
    assert shape.values == values + empty


def test_escapes_at_piece_boundaries_are_not_split():
    body = json.dumps({"a": '\\"' * 100 + '"\\' * 100, "b": [1, 2]}).encode()
    for piece in range(1, 40):
        assert json_shape(body, piece_bytes=piece).costly == 5  # dict, 2 keys, str, list


def test_the_budget_derives_from_max_model_len_and_the_prompt_count():
    b = JsonBudget.for_server(max_model_len=8192, max_prompts_per_request=32)
    assert b.max_values == 32 * 8192 + VALUES_FLOOR
    assert b.max_costly == max(COSTLY_FLOOR, 2 * 8192)
    assert JsonBudget.for_server(65536, 1).max_costly == 2 * 65536


def _check(budget: JsonBudget, body: bytes) -> None:
    asyncio.run(budget.check(body))


def test_what_fits_the_context_passes_and_a_long_id_list_is_refused():
    budget = JsonBudget.for_server(max_model_len=256, max_prompts_per_request=4)
    # every prompt at its longest, and a long conversation: accepted
    _check(budget, json.dumps({"prompt": [[7] * 255] * 4, "max_tokens": 1}).encode())
    chat = [{"role": "user", "content": 'a, [b]: {c} \\ " ' * 50}] * 200
    _check(budget, json.dumps({"messages": chat}).encode())
    # a 9 MB string is one value
    _check(budget, json.dumps({"prompt": "x, [y]: " * 1_000_000}).encode())
    with pytest.raises(APIError) as err:
        _check(budget, json.dumps({"prompt": [1] * (budget.max_values + 1)}).encode())
    assert err.value.status == 413
    assert f"more than {budget.max_values} JSON values" in err.value.message
    assert "--max-model-len" in err.value.message
    assert "--max-prompts-per-request" in err.value.message
    n = COSTLY_FLOOR + 1
    for junk in ([[]] * n, [""] * n, [{}] * n, [1.5] * n, [True] * n):
        with pytest.raises(APIError) as err:
            _check(budget, json.dumps({"prompt": "hi", "junk": junk}).encode())
        assert err.value.status == 413 and "arrays, objects, strings" in err.value.message


def test_small_bodies_are_not_scanned():
    budget = JsonBudget(max_values=10, max_costly=10)
    small = json.dumps({"prompt": [1] * 100}).encode()
    assert len(small) < SCAN_MIN_BYTES
    _check(budget, small)  # below the scan size: the parser's own cost is small
