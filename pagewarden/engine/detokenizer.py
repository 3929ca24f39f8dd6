"""Incremental detokenization with stop strings.

Decoding all output ids after every token is O(n) per token. Instead, like vLLM, we
keep two offsets into ``all_ids = prompt_ids + output_ids`` and decode only a small
window::

    all_ids:  ... p p p p | o o o | o o
                  ^prefix_offset  ^read_offset   ^len(all_ids)

    prefix_text = decode(all_ids[prefix_offset:read_offset])   already emitted
    new_text    = decode(all_ids[prefix_offset:])              window + pending tokens
    delta       = new_text[len(prefix_text):]

Decoding a few tokens of context before ``read_offset`` keeps tokenizers that
strip or merge spaces at the start of a decode honest (SentencePiece drops the ``▁`` of
the first piece). The context starts on a whole character: byte-fallback tokens
(``<0xE6><0x97><0xA5>``) decode as one run, all U+FFFD if the run starts mid-character. If ``new_text`` ends with
U+FFFD, the pending tokens end inside a multi-byte UTF-8 character: nothing is read and
the offsets stay until a later token completes it. Otherwise the window slides:
``prefix_offset, read_offset = read_offset, len(all_ids)``.

Stop strings are matched in the decoded output text. While streaming, the trailing
characters that could be the start of a stop string are held back (at most
``len(longest stop string) - 1``), so a stop string is never partly emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagewarden.sampling_params import SamplingParams

#: Tokens of prompt context decoded before the first output token.
_INITIAL_CONTEXT_TOKENS = 5
#: How much further back the context may start to begin on a whole character.
_MAX_EXTRA_CONTEXT_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The only tokenizer method the detokenizer needs."""

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


@dataclass(frozen=True)
class DetokenizerDelta:
    """Text released by one ``add_tokens`` call.

    ``stopped`` is True once a stop string has matched; ``stop_string`` names it.
    """

    text: str
    stopped: bool
    stop_string: str | None


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for one sequence.

    Invariants: ``0 <= prefix_offset <= read_offset <= len(all_ids)``; the emitted text
    is always a prefix of ``text``; once stopped, ``text`` ends at the stop string (or
    just after it with ``include_stop_str_in_output``) and never changes again.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stop_strings = list(params.stop_strings)
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        self._all_ids = list(prompt_token_ids)
        self._read_offset = len(self._all_ids)
        self._prefix_offset = self._context_start()
        self._output_text = ""  # decoded output text, truncated at a stop string
        self._num_emitted = 0  # chars of _output_text already returned
        self._stop_string: str | None = None

    @property
    def text(self) -> str:
        """The output text decoded so far, including text held back from streaming."""
        return self._output_text

    @property
    def stopped(self) -> bool:
        return self._stop_string is not None

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    def add_tokens(self, new_ids: list[int]) -> DetokenizerDelta:
        """Append output token ids; return the text that is now safe to stream.

        Tokens added after a stop string matched are ignored.
        """
        if self.stopped:
            return DetokenizerDelta("", True, self._stop_string)
        for token_id in new_ids:
            self._all_ids.append(token_id)
            decoded = self._decode_pending(final=False)
            if decoded and self._append_and_check_stop(decoded):
                break
        return DetokenizerDelta(self._release(), self.stopped, self._stop_string)

    def flush(self) -> str:
        """Release everything still held back; call once when the sequence finishes.

        Pending tokens that end inside a UTF-8 character are decoded as they are (with
        U+FFFD), as ``tokenizer.decode`` of all ids would.
        """
        if not self.stopped:
            decoded = self._decode_pending(final=True)
            if decoded:
                self._append_and_check_stop(decoded)
        text = self._output_text[self._num_emitted :]
        self._num_emitted = len(self._output_text)
        return text

    def _context_start(self) -> int:
        """Where the prompt context starts: a few tokens back, and further back while
        that window decodes to a leading U+FFFD, i.e. starts inside a character spelled by
        byte tokens (SentencePiece byte fallback), whose broken run would swallow the
        output's first bytes."""
        start = max(self._read_offset - _INITIAL_CONTEXT_TOKENS, 0)
        floor = max(start - _MAX_EXTRA_CONTEXT_TOKENS, 0)
        while start > floor and self._decode(self._all_ids[start : self._read_offset]).startswith(
            _REPLACEMENT_CHAR
        ):
            start -= 1
        return start

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_pending(self, final: bool) -> str:
        """Decode tokens after ``read_offset``; "" while they end mid-character."""
        if self._read_offset == len(self._all_ids):
            return ""
        prefix_text = self._decode(self._all_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._all_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            # Nothing printable yet (e.g. a special token that decodes to "").
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._all_ids)
        return new_text[len(prefix_text) :]

    def _append_and_check_stop(self, decoded: str) -> bool:
        """Append decoded text; on a stop string, truncate there and return True."""
        old_len = len(self._output_text)
        self._output_text += decoded
        if not self._stop_strings:
            return False
        # A match must end inside the new text, so it starts at most
        # max_stop_len - 1 characters before it.
        search_from = max(old_len - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            index = self._output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if self._include_stop else index
        self._output_text = self._output_text[:end]
        self._num_emitted = min(self._num_emitted, end)
        self._stop_string = stop
        return True

    def _release(self) -> str:
        """Return the not-yet-emitted text, minus a tail that may start a stop string."""
        end = len(self._output_text)
        if not self.stopped and not self._include_stop:
            end -= self._stop_prefix_len()
        assert end >= self._num_emitted, "held-back text was already emitted"
        text = self._output_text[self._num_emitted : end]
        self._num_emitted = end
        return text

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the output that is a proper prefix of a stop."""
        text = self._output_text
        longest = 0
        for stop in self._stop_strings:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
