"""IncrementalDetokenizer against a real byte-level BPE tokenizer trained in-test."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagewarden.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from pagewarden.sampling_params import SamplingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "日本語のテキストも正しく扱う必要があります。",
    "你好，世界！这是一个测试。",
    "Emoji are four bytes: 🦊🚀🎉 and sometimes more 👩‍💻.",
    "Ünïcödé àccents çà et là, naïve café.",
    "stop strings like STOP or <END> must be cut cleanly",
]

# Characters for random text, many of them multi-byte in UTF-8 and unseen in training.
ALPHABET = list("abcdefgh xyz .,!") + list("éüçñ") + list("日本語你好世界") + list("🦊🚀🎉🧠💾")


class _Adapter:
    """A tokenizer with only ``decode(ids, skip_special_tokens)``, as the engine has."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.calls: list[int] = []  # length of each decoded window

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.calls.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 3, trainer=trainer)
    return tokenizer


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> list[DetokenizerDelta]:
    """Feed ids in chunks (1 at a time, or random sizes with rng)."""
    deltas, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add_tokens(ids[i : i + size]))
        i += size
        if deltas[-1].stopped:
            break
    return deltas


def test_tokenizer_splits_multibyte_characters(tok: Tokenizer) -> None:
    """Guard: the fixture must actually produce tokens that end mid-character."""
    ids = encode(tok, "🧠💾 日本")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_random_texts_roundtrip(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for trial in range(200):
        prompt = encode(tok, random_text(rng, rng.randint(0, 12)))
        output = encode(tok, random_text(rng, rng.randint(1, 40)))
        adapter = _Adapter(tok)
        detok = IncrementalDetokenizer(adapter, prompt, SamplingParams())
        deltas = stream(detok, output, rng if trial % 2 else None)
        tail = detok.flush()
        streamed = "".join(d.text for d in deltas) + tail
        expected = tok.decode(output, skip_special_tokens=True)
        assert streamed == expected
        assert detok.text == expected
        for d in deltas:
            assert "\ufffd" not in d.text
            assert not d.stopped
        assert "\ufffd" not in tail


def test_decode_windows_stay_small(tok: Tokenizer) -> None:
    """Cost per token is O(1): no decode call sees the whole output."""
    text = "abc 日本語 🦊 " * 40
    output = encode(tok, text)
    adapter = _Adapter(tok)
    detok = IncrementalDetokenizer(adapter, [], SamplingParams())
    streamed = "".join(d.text for d in stream(detok, output)) + detok.flush()
    assert streamed == detok.text
    assert detok.text == tok.decode(output, skip_special_tokens=True)
    assert len(output) > 100
    assert max(adapter.calls) <= 12


def test_split_mid_character_holds_back(tok: Tokenizer) -> None:
    output = encode(tok, "🧠")
    assert len(output) > 1, "fixture should split this emoji into byte tokens"
    detok = IncrementalDetokenizer(_Adapter(tok), [], SamplingParams())
    for token_id in output[:-1]:
        assert detok.add_tokens([token_id]).text == ""
    assert detok.add_tokens([output[-1]]).text == "🧠"


def test_flush_releases_incomplete_tail(tok: Tokenizer) -> None:
    output = encode(tok, "ab🧠")[:-1]  # ends mid-character
    detok = IncrementalDetokenizer(_Adapter(tok), [], SamplingParams())
    streamed = "".join(d.text for d in stream(detok, output))
    assert streamed == "ab"
    assert streamed + detok.flush() == tok.decode(output)


def test_special_tokens_skipped(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<eos>")
    output = encode(tok, "hi ") + [eos]
    detok = IncrementalDetokenizer(_Adapter(tok), [], SamplingParams())
    streamed = "".join(d.text for d in stream(detok, output)) + detok.flush()
    assert streamed == "hi "


def stop_case(tok: Tokenizer, text: str, params: SamplingParams) -> tuple[str, DetokenizerDelta]:
    detok = IncrementalDetokenizer(_Adapter(tok), encode(tok, "prompt "), params)
    deltas = stream(detok, encode(tok, text))
    streamed = "".join(d.text for d in deltas)
    last = deltas[-1]
    if last.stopped:
        assert detok.text == streamed, "nothing may stay held back after a stop"
    return streamed + detok.flush(), last


def test_stop_string_spanning_tokens_is_cut(tok: Tokenizer) -> None:
    text = "hello world STOP and more"
    ids = encode(tok, text)
    # Guard: the stop string really spans several tokens.
    pieces = [tok.decode([i]) for i in ids]
    assert not any("STOP" in p for p in pieces)
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(_Adapter(tok), [], params)
    deltas = stream(detok, ids)
    streamed = "".join(d.text for d in deltas)
    assert deltas[-1].stopped and deltas[-1].stop_string == "STOP"
    assert streamed == "hello world "
    assert detok.text == "hello world "
    assert all("S" not in d.text for d in deltas), "no part of the stop string is emitted"
    assert detok.flush() == ""
    assert detok.add_tokens(encode(tok, "x")) == DetokenizerDelta("", True, "STOP")


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    text, last = stop_case(tok, "hello world STOP and more", params)
    assert last.stopped and text == "hello world STOP"


def test_stop_string_with_multibyte_chars(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["🦊🚀"])
    text, last = stop_case(tok, "abc 日本🦊🚀 tail", params)
    assert last.stopped and text == "abc 日本"


def test_partial_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["<END>"])
    detok = IncrementalDetokenizer(_Adapter(tok), [], params)
    streamed = "".join(d.text for d in stream(detok, encode(tok, "a <EN")))
    assert streamed == "a ", "'<EN' could start the stop string"
    delta = detok.add_tokens(encode(tok, "D!"))
    assert not delta.stopped
    # "<END!" does not contain "<END>", so everything is released by the end.
    assert streamed + delta.text + detok.flush() == "a <END!"


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["world", "lo w"])
    text, last = stop_case(tok, "hello world", params)
    assert last.stopped and last.stop_string == "lo w" and text == "hel"


def test_random_stop_positions(tok: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(100):
        before = random_text(rng, rng.randint(0, 20)).replace("|", "")
        after = random_text(rng, rng.randint(0, 20))
        stop = "|#|"
        include = rng.random() < 0.5
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(_Adapter(tok), [], params)
        deltas = stream(detok, encode(tok, before + stop + after), rng)
        streamed = "".join(d.text for d in deltas) + detok.flush()
        assert deltas[-1].stopped
        assert streamed == before + (stop if include else "")
