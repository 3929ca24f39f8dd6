"""Grammars per request (engine/grammar.py): matchers follow the tokens actually kept,
padded vocabulary columns are never allowed, and constrained requests stay valid through
integrity recovery and preemption."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore, RequestRejected
from pagewarden.engine.grammar import GrammarTable, XGrammarBackend, unenforced_keywords
from pagewarden.faults.injector import FaultInjector
from pagewarden.models.tokenizer import Tokenizer
from pagewarden.sampling_params import SamplingParams, SamplingParamsError
from pagewarden.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SPEC = StructuredOutputsParams.from_schema(SCHEMA)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return Tokenizer.from_hf_dir(tiny_llama_dir)


def _table(tok, vocab_size: int) -> GrammarTable:
    eos = tok.eos_token_ids
    return GrammarTable(lambda: XGrammarBackend(tok, vocab_size, sorted(eos)), vocab_size, eos)


def _req(rid: str, out: list[int]):
    return SimpleNamespace(
        req_id=rid,
        sampling_params=SamplingParams(structured_outputs=SPEC),
        output_token_ids=out,
    )


def _allowed(bits: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bits[t // 32]) >> (t % 32)) & 1}


def test_matcher_follows_rollback_and_divergence(tok):
    vocab = 512
    table = _table(tok, vocab)
    good = tok.encode('{"a": "x", "b": true}', add_special_tokens=False)
    fresh = {}
    for k in range(len(good)):  # the mask after each prefix, from a fresh matcher
        fresh[k] = _allowed(_table(tok, vocab).bitmask([_req("f", good[:k])]).bits[0], vocab)
    out = list(good[:-1])
    assert _allowed(table.bitmask([_req("r", out)]).bits[0], vocab) == fresh[len(out)]
    # integrity recovery keeps output tokens, but a scheduler that dropped some (or a
    # replaced tail) must roll the matcher back to the tokens actually kept
    for k in (3, 1, 0, len(good) - 2):
        assert _allowed(table.bitmask([_req("r", good[:k])]).bits[0], vocab) == fresh[k]
    # preemption drops the matcher; it is rebuilt by replaying the output tokens
    table.forget(["r"])
    assert table.num_matchers == 0
    assert _allowed(table.bitmask([_req("r", good[:4])]).bits[0], vocab) == fresh[4]


def test_padded_vocabulary_columns_are_never_allowed(tok):
    """The model's logits are wider than the tokenizer's vocabulary: the mask covers the
    model's width and never allows a column the tokenizer cannot decode."""
    real = tok.vocab_size
    padded = real + 70
    table = _table(tok, padded)
    mask = table.bitmask([_req("r", [])])
    assert mask is not None and mask.bits.shape == (1, (padded + 31) // 32)
    allowed = _allowed(mask.bits[0], padded)
    assert allowed and max(allowed) < real
    # once complete, only the stop token may follow
    done = tok.encode('{"a": "y", "b": false}', add_special_tokens=False)
    assert _allowed(table.bitmask([_req("r", done)]).bits[0], padded) == set(tok.eos_token_ids)


def test_unconstrained_rows_are_not_in_the_mask(tok):
    table = _table(tok, 512)
    plain = SimpleNamespace(req_id="p", sampling_params=SamplingParams(), output_token_ids=[])
    mask = table.bitmask([plain, _req("c", []), plain])
    assert mask is not None and mask.rows == [1]
    assert table.bitmask([plain]) is None


def test_unenforced_keywords_are_found_everywhere():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "l": {"type": "array", "uniqueItems": True}},
        "$defs": {"d": {"if": {"type": "string"}}},
        "enum": [{"not": 1}],
    }
    assert unenforced_keywords(schema) == ["$.properties.l: uniqueItems", "$.$defs.d: if"]


def test_settings_that_forbid_a_stop_token_are_refused():
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(structured_outputs=SPEC, ignore_eos=True)
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(structured_outputs=SPEC, min_tokens=2, max_tokens=8)


def _run(engine: EngineCore, injector: FaultInjector | None) -> dict[str, list]:
    outputs: dict[str, list] = {}
    step = 0
    while engine.has_unfinished():
        if injector is not None and step % 4 == 2 and engine.scheduler.running:
            injector.inject(("tag_corruption", "open_bitflip", "table_redirect")[step % 3])
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs
        step += 1
    return outputs


@pytest.mark.parametrize("faults", [False, True])
def test_outputs_validate_through_recovery_and_preemption(tiny_llama_dir, faults):
    """Random weights at temperature 1 with top-k/top-p and penalties, n = 2, a pool small
    enough to preempt, and (second run) KV faults every few steps (tag corruption, bit flips, redirected
    table entries) that roll requests
    back: every output is valid JSON for the schema."""
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=24,
            block_size=4,
            max_model_len=256,
            integrity="strict",
        )
    )
    injector = FaultInjector(engine, seed=1) if faults else None
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
    with pytest.raises(RequestRejected, match="regex"):  # failed alone, at admission
        engine.add_request("bad", [5, 6], bad)
    prompt = list(range(5, 25))
    for i in range(8):
        params = SamplingParams(
            temperature=1.0,
            top_p=0.95,
            top_k=200,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            seed=i,
            n=2,
            max_tokens=60,
            logprobs=2,
            structured_outputs=SPEC,
        )
        engine.add_request(f"r{i}", prompt[i:], params)
    outputs = _run(engine, injector)
    assert len(outputs) == 8
    for outs in outputs.values():
        for c in outs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    if faults:
        assert stats.integrity.rolled_back_requests > 0
        assert injector is not None and injector.corrupted_tokens == 0
    # Requests that finished are forgotten with the next step's finished list.
    engine.add_request("plain", prompt, SamplingParams(max_tokens=2))
    _run(engine, None)
    assert engine.grammars.num_matchers == 0
