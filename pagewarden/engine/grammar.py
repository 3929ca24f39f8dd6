"""Grammars per request: structured outputs by constrained decoding.

A request's ``SamplingParams.structured_outputs`` (``structured_outputs.py``) is compiled
once per spec by a grammar back end (a table, ``GRAMMAR_BACKENDS``; xgrammar is the one
entry, as in vLLM and SGLang) and each constrained request gets a matcher. Before every
sampling step ``GrammarTable.bitmask`` fills one token bitmask for the batch's constrained
rows (one xgrammar call for them all, on its own threads), which the sampler applies
(``worker/sampler.py``, ``apply_token_bitmask``).

Where the work runs:

- ``check_spec`` (the server, in a worker thread): the spec parses and uses no feature the
  back end cannot enforce; no tokenizer needed, so a bad spec is a 400 before it is sent.
- ``GrammarTable.prepare`` (whichever thread adds the request): starts the compile on the
  table's own thread; a cached spec costs a dict lookup.
- ``GrammarTable.bitmask`` (the engine-core thread): waits for a compile only if it is
  still running when the request first samples (it ran beside the prefill).

Invariant: a matcher has accepted exactly a prefix of its request's output tokens, and
``bitmask`` brings it to all of them first. Output tokens are the truth: integrity
recovery rolls KV back but keeps output tokens, preemption recomputes KV for the same
tokens, and a matcher dropped on preemption is rebuilt by replaying them. So the grammar
always follows the tokens actually kept, never a token the scheduler discarded.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import torch

from pagewarden.structured_outputs import StructuredOutputsParams
from pagewarden.worker.sampler import TokenBitmask

logger = logging.getLogger("pagewarden.engine.grammar")

#: Compiled specs kept by the table (the back end keeps its own cache behind this).
COMPILED_CACHE_SIZE = 512

# JSON-schema keywords the grammar cannot enforce: refused, never silently ignored.
_UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "uniqueItems",
        "multipleOf",
        "$dynamicRef",
    }
)
# Keywords whose value is a map of names to schemas (the names are not keywords).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_ENGINE_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A structured-outputs spec that cannot be compiled or enforced; the message says
    what and where (``param``: the request field it came from, set by the server)."""


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    """A grammar engine: checks specs, compiles them, fills bitmasks."""

    def compile(self, spec: StructuredOutputsParams) -> Any: ...
    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Matcher: ...
    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` (S, W) with ``matchers[i]``'s next tokens."""
        ...


def _engine_message(exc: BaseException) -> str:
    """The grammar engine's message without its source-file prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _ENGINE_LOG_PREFIX.sub("", text)


def _choice_ebnf(choices: Iterable[str]) -> str:
    # JSON string escapes are EBNF string escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def unenforced_keywords(schema: Any, path: str = "$") -> list[str]:
    """``path: keyword`` for each keyword of ``schema`` the grammar cannot enforce, and
    for each ``$ref`` outside the document."""
    found: list[str] = []
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found += unenforced_keywords(item, f"{path}[{i}]")
    elif isinstance(schema, dict):
        for key, value in schema.items():
            where = f"{path}.{key}"
            if key in _UNENFORCED_KEYWORDS:
                found.append(f"{path}: {key}")
            elif key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                found.append(f"{path}: $ref to another document ({value})")
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    found += unenforced_keywords(sub, f"{where}.{name}")
            elif key not in ("enum", "const", "default", "examples"):
                found += unenforced_keywords(value, where)
    return found


class XGrammarBackend:
    """xgrammar: JSON schema, regex, EBNF; compiled per spec against the vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        # Vocabulary type and prefix-space handling come from the tokenizer's own
        # description; ``vocab_size`` is the model's (logit columns past the tokenizer's
        # vocabulary are padding that the mask never allows).
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._xgr = xgr
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    @staticmethod
    def check(spec: StructuredOutputsParams) -> None:
        """Raise ``GrammarError`` unless ``spec`` parses and is enforceable."""
        import xgrammar as xgr

        try:
            if spec.json is not None:
                bad = unenforced_keywords(json.loads(spec.json))
                if bad:
                    raise GrammarError(
                        "the JSON schema uses keywords structured outputs cannot enforce: "
                        + "; ".join(bad[:5])
                    )
                xgr.Grammar.from_json_schema(spec.json, any_whitespace=False, strict_mode=True)
            elif spec.regex is not None:
                xgr.Grammar.from_regex(spec.regex)
            elif spec.grammar is not None:
                xgr.Grammar.from_ebnf(spec.grammar)
            elif spec.choice is not None:
                xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine raises RuntimeError for any bad spec
            raise GrammarError(f"invalid {spec.kind}: {_engine_message(exc)}") from None

    def compile(self, spec: StructuredOutputsParams) -> Any:
        c = self.compiler
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.json, any_whitespace=False, strict_mode=True)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            assert spec.grammar is not None or spec.choice is not None
            return c.compile_grammar(spec.grammar or _choice_ebnf(spec.choice or ()))
        except Exception as exc:  # noqa: BLE001 - see check()
            raise GrammarError(f"invalid {spec.kind}: {_engine_message(exc)}") from None

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Matcher:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


#: Grammar back ends by name: (constructor, spec check without a tokenizer).
GRAMMAR_BACKENDS: dict[str, tuple[Callable[..., GrammarBackend], Callable[..., None]]] = {
    "xgrammar": (XGrammarBackend, XGrammarBackend.check),
}
DEFAULT_BACKEND = "xgrammar"


def check_spec(spec: StructuredOutputsParams, backend: str = DEFAULT_BACKEND) -> None:
    """Raise ``GrammarError`` unless ``spec`` compiles and is enforceable (no tokenizer:
    cheap enough for the server, which runs it off its event loop). Cached per spec."""
    problem = _check_cached(spec, backend)
    if problem is not None:
        raise GrammarError(problem)


@lru_cache(maxsize=COMPILED_CACHE_SIZE)
def _check_cached(spec: StructuredOutputsParams, backend: str) -> str | None:
    try:
        GRAMMAR_BACKENDS[backend][1](spec)
    except GrammarError as exc:
        return str(exc)
    return None


@dataclass
class _RequestGrammar:
    matcher: Matcher
    accepted: list[int]  # the output tokens the matcher has accepted, in order


class GrammarStateError(RuntimeError):
    """A request's output left its grammar (a bug, not the client's input)."""


class GrammarTable:
    """Compiled specs (cached per spec) and one matcher per constrained request.

    ``prepare`` may be called from any thread; everything else is the engine-core
    thread's. The back end is built on first use (the vocabulary pass takes about a
    second), on the compile thread.
    """

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        vocab_size: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagewarden-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._requests: dict[str, _RequestGrammar] = {}

    # ---- any thread ---------------------------------------------------------
    def prepare(self, spec: StructuredOutputsParams) -> Future:
        """Start compiling ``spec`` unless it is cached; returns its future."""
        with self._lock:
            fut = self._compiled.get(spec.key)
            if fut is not None:
                self._compiled.move_to_end(spec.key)
                return fut
            fut = self._executor.submit(self._compile, spec)
            self._compiled[spec.key] = fut
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        return self.backend().compile(spec)

    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    # ---- engine-core thread ---------------------------------------------------
    def bitmask(self, requests: list) -> TokenBitmask | None:
        """The token bitmask of the constrained rows among ``requests`` (the step's
        sampling ``ScheduledRequest``s, in row order), each matcher first brought to its
        request's output tokens; None when no row is constrained."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs]
        if not rows:
            return None
        matchers = [self._sync(requests[i]) for i in rows]
        width = (self.vocab_size + 31) // 32
        # (S, W): the rows of unconstrained requests are never read, so never written.
        bits = torch.empty((len(requests), width), dtype=torch.int32)
        live = [j for j, m in enumerate(matchers) if not m.is_terminated()]
        if live:
            self.backend().fill([matchers[j] for j in live], bits, [rows[j] for j in live])
        for j, m in enumerate(matchers):
            if m.is_terminated():  # only a stop token may follow an accepted stop token
                bits[rows[j]] = _only(self._stop_ids(requests[rows[j]]), width)
        return TokenBitmask(rows=rows, bits=bits)

    def _stop_ids(self, request) -> list[int]:
        params = request.sampling_params
        return sorted(set(params.stop_token_ids or ()) | set(self.eos_token_ids))

    def _sync(self, request) -> Matcher:
        state = self._requests.get(request.req_id)
        if state is None:
            spec = request.sampling_params.structured_outputs
            compiled = self.prepare(spec).result()
            state = _RequestGrammar(self.backend().matcher(compiled, self._stop_ids(request)), [])
            self._requests[request.req_id] = state
        out, acc = request.output_token_ids, state.accepted
        if len(acc) > len(out) or (acc and acc[-1] != out[len(acc) - 1]):
            keep = 0
            while keep < min(len(acc), len(out)) and acc[keep] == out[keep]:
                keep += 1
            state.matcher.rollback(len(acc) - keep)
            del acc[keep:]
        for token in out[len(acc) :]:
            if not state.matcher.accept_token(token):
                raise GrammarStateError(
                    f"request {request.req_id}: output token {token} is outside its grammar"
                )
            acc.append(token)
        return state.matcher

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the matchers of requests that finished, were aborted or preempted (a
        preempted request's matcher is rebuilt from its tokens when it runs again)."""
        for rid in req_ids:
            self._requests.pop(rid, None)

    @property
    def num_matchers(self) -> int:
        return len(self._requests)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _only(token_ids: list[int], width: int) -> torch.Tensor:
    """A bitmask row (W,) int32 allowing exactly ``token_ids``."""
    words = [0] * width
    for t in token_ids:
        if t // 32 < width:
            words[t // 32] |= 1 << (t % 32)
    # int32 two's complement for bit 31
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
