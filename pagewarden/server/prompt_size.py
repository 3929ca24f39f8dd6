"""Refuse a prompt by its size before any tokenizing or template rendering.

A prompt that cannot fit the context is refused from what the parsed request already
says, in time proportional to the number of messages or prompts, never to their length:

- a string prompt (completions, /tokenize) or the text of chat messages (chat, the
  Responses API, /tokenize's messages) by its character count;
- a token-id prompt by its length.

The character limit is derived from ``max_model_len`` so that it never refuses a prompt
that would fit::

    chars(prompt) <= COMPOSE x sum(chars(piece) for each token)   (every char reaches a token)
                  <= COMPOSE x n_tokens x longest_piece
    so  n_tokens <= max_model_len  =>  chars <= COMPOSE x max_model_len x longest_piece

``longest_piece`` is the longest vocabulary entry (added tokens included) in characters,
read once at start-up. A byte-level BPE piece has one character per byte of text it
stands for, a SentencePiece piece one per character (``<0xNN>`` byte pieces overcount),
so the inequality holds for both. ``COMPOSE`` is 4 when the tokenizer normalizes with
Unicode composition (NFC/NFKC join at most four code points into one: a canonical
decomposition is at most four long), 1 otherwise. A normalizer or pre-tokenizer that
deletes characters outright (``Strip``, BERT's whitespace split; no family pagewarden
serves uses one) would break the first line; for such a tokenizer the limit can refuse a
prompt made mostly of characters the model would never see.

A chat template adds text around the messages, so counting only the messages' text
undercounts what is rendered: the check stays on the safe side. The token-exact check
(``max_model_len`` against the rendered, tokenized prompt) still runs in the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from pagewarden.server.errors import APIError

#: The ``code`` of the 400 (OpenAI's name for the error).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: Code points a Unicode composition (NFC, NFKC) can join into one character.
_MAX_COMPOSED = 4
_COMPOSING = frozenset({"NFC", "NFKC"})


@dataclass(frozen=True)
class PromptSizeLimit:
    """The largest prompt that may fit: ``max_chars`` characters, ``max_model_len`` ids."""

    max_model_len: int
    longest_piece: int  # characters of the longest vocabulary entry
    compose: int  # 4 when the normalizer composes (NFC/NFKC), else 1

    def __post_init__(self) -> None:
        assert self.max_model_len > 0 and self.longest_piece > 0 and self.compose >= 1

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.longest_piece * self.compose

    def _explain(self) -> str:
        why = f"{self.max_model_len} tokens x {self.longest_piece} characters, its longest token"
        if self.compose > 1:
            why += f", x {self.compose} for Unicode composition"
        return f"at most {self.max_chars} characters can fit max_model_len={self.max_model_len} ({why})"

    def check_text(self, chars: int, param: str, what: str = "the prompt") -> None:
        """400 when ``chars`` characters cannot fit the context."""
        if chars > self.max_chars:
            raise APIError(
                400,
                f"{what} has {chars} characters; {self._explain()}; shorten it",
                param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def check_ids(self, n_ids: int, param: str) -> None:
        """400 when a token-id prompt of ``n_ids`` ids leaves no room to generate."""
        if n_ids >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {n_ids} tokens; the context length max_model_len="
                f"{self.max_model_len} leaves no room to generate; shorten the prompt",
                param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def check_prompts(self, prompts: Iterable[str | list[int]], param: str = "prompt") -> None:
        """Each completions prompt: a string by characters, a token-id list by length."""
        for p in prompts:
            if isinstance(p, str):
                self.check_text(len(p), param)
            else:
                self.check_ids(len(p), param)

    def check_messages(self, messages: Iterable, param: str = "messages") -> None:
        """Chat messages (``protocol.ChatMessage``) by their text's characters, together."""
        chars = sum(m.text_length() for m in messages)
        self.check_text(chars, param, "the messages' text")


def prompt_size_limit(tokenizer, max_model_len: int) -> PromptSizeLimit:
    """The limit for ``tokenizer`` (``models.tokenizer.Tokenizer``, or anything with a
    ``tokenizers.Tokenizer`` as ``backend``) and ``max_model_len``."""
    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max((len(piece) for piece in vocab), default=1)
    return PromptSizeLimit(max_model_len, max(longest, 1), _compose_factor(backend))


def _compose_factor(backend) -> int:
    normalizer = json.loads(backend.to_str()).get("normalizer")
    return _MAX_COMPOSED if _COMPOSING & set(_types(normalizer)) else 1


def _types(node) -> list[str]:
    """Every ``type`` in a tokenizer.json normalizer tree (sequences included)."""
    if isinstance(node, dict):
        found = [node["type"]] if isinstance(node.get("type"), str) else []
        return found + [t for v in node.values() for t in _types(v)]
    if isinstance(node, list):
        return [t for v in node for t in _types(v)]
    return []
