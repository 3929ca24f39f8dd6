"""A SentencePiece ``tokenizer.model`` (an HF directory without ``tokenizer.json``) as an
HF ``tokenizers`` tokenizer, without the ``sentencepiece`` package.

The file is a ``ModelProto`` protobuf; the few fields read here are decoded straight from
the wire format:

    ModelProto      1: pieces (repeated SentencePiece)  2: trainer_spec  3: normalizer_spec
    SentencePiece   1: piece (string)  2: score (float)  3: type (enum, GGUF's numbering)
    TrainerSpec     3: model_type (1 unigram, 2 BPE)  25: split_digits  35: byte_fallback
                    40: unk_id  41: bos_id  42: eos_id  43: pad_id
    NormalizerSpec  1: name  2: precompiled_charsmap  3: add_dummy_prefix
                    4: remove_extra_whitespaces  5: escape_whitespaces

The pieces, scores and types are exactly what a llama.cpp GGUF stores for the same
vocabulary, so the tokenizer is built by ``gguf_tokenizer`` with the style of the
checkpoint's family. What the BPE rebuild would not reproduce is refused: a unigram
model, no byte fallback, a text normalization (nmt_nfkc and other charsmaps, collapsed
whitespace), digits split by the trainer while the vocabulary holds multi-digit pieces.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from pagewarden.models.gguf_tokenizer import GGUFVocab, TokenizerLoadError, build_gguf_tokenizer

UNIGRAM, BPE = 1, 2
NORMAL, USER_DEFINED = 1, 4  # piece types (GGUF's token types too)
MAX_MODEL_BYTES = 64 << 20  # real tokenizer.model files are under 5 MiB


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise TokenizerLoadError("tokenizer.model: truncated varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of one message: ints for varints, bytes otherwise."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield num, value
            continue
        if wire == 2:
            size, i = _varint(buf, i)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise TokenizerLoadError(f"tokenizer.model: unsupported protobuf wire type {wire}")
        if i + size > len(buf):
            raise TokenizerLoadError("tokenizer.model: truncated field")
        yield num, buf[i : i + size]
        i += size


def _int32(value: int) -> int:
    """A protobuf int32 (negative ones are 64-bit two's complement varints)."""
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class SentencePieceModel:
    """The parts of a ``ModelProto`` that decide how text becomes pieces."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = 1
    split_digits: bool = False
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    normalizer: str = "nmt_nfkc"
    charsmap: bool = False  # a precompiled normalization table is present
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True

    @staticmethod
    def parse(buf: bytes) -> SentencePieceModel:
        pieces: list[str] = []
        scores: list[float] = []
        types: list[int] = []
        kw: dict[str, Any] = {}
        trainer = {3: "model_type", 25: "split_digits", 35: "byte_fallback"}
        trainer |= {40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id"}
        norm = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
        for num, value in _fields(buf):
            if num == 1:
                piece = dict(_fields(value))
                pieces.append(bytes(piece.get(1, b"")).decode("utf-8"))
                scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
                types.append(int(piece.get(3, 1)))
            elif num == 2:
                for k, v in _fields(value):
                    if k in trainer and isinstance(v, int):
                        kw[trainer[k]] = _int32(v) if k >= 40 else v
            elif num == 3:
                for k, v in _fields(value):
                    if k == 1:
                        kw["normalizer"] = bytes(v).decode("utf-8")
                    elif k == 2:
                        kw["charsmap"] = len(v) > 0
                    elif k in norm:
                        kw[norm[k]] = bool(v)
        if not pieces:
            raise TokenizerLoadError("tokenizer.model holds no pieces")
        for key in ("split_digits", "byte_fallback"):
            if key in kw:
                kw[key] = bool(kw[key])
        return SentencePieceModel(pieces, scores, types, **kw)

    def check(self) -> None:
        """Raise ``TokenizerLoadError`` for what the BPE rebuild would compute otherwise."""
        problems = []
        if self.model_type == UNIGRAM:
            # transformers 5 loads it through LlamaTokenizer as a BPE extracted from the
            # pieces, which splits text differently from the unigram model itself: there
            # is no one reference to be exact against.
            problems.append(
                "a unigram model (model_type 1; transformers reads it as BPE merges that "
                "split text differently from SentencePiece, so only BPE, 2, is supported)"
            )
        elif self.model_type != BPE:
            problems.append(f"model_type {self.model_type} (only BPE, 2, is supported)")
        if not self.byte_fallback:
            problems.append("byte_fallback=false")
        if self.charsmap or self.remove_extra_whitespaces or not self.escape_whitespaces:
            problems.append(
                f"text normalization {self.normalizer!r} (only 'identity' without "
                "remove_extra_whitespaces)"
            )
        pieces = (p for p, t in zip(self.pieces, self.types) if t in (NORMAL, USER_DEFINED))
        if self.split_digits and any(re.search(r"\d\d", p) for p in pieces):
            problems.append("split_digits with multi-digit pieces")
        if problems:
            raise TokenizerLoadError(
                "unsupported SentencePiece tokenizer.model: " + "; ".join(problems)
            )


def sentencepiece_tokenizer(
    model_file: Path, tokenizer_config: dict[str, Any], model_type: str
) -> HFTokenizer:
    """The tokenizer of ``model_file`` for a checkpoint of ``model_type`` (config.json):
    Gemma's pieces and splitting for ``gemma*``; otherwise, with ``legacy`` (the default),
    the SentencePiece library's own encoding of every stretch of text between special
    tokens, each with its prefix space (transformers' slow ``LlamaTokenizer``); with
    ``legacy: false`` a prefix space before the text's first piece only, as
    transformers' ``LlamaConverter`` (``Metaspace``, prepend "first", no split): the GGUF
    ``llama`` style."""
    if model_file.stat().st_size > MAX_MODEL_BYTES:
        raise TokenizerLoadError(f"{model_file}: larger than {MAX_MODEL_BYTES} bytes")
    spm = SentencePieceModel.parse(model_file.read_bytes())
    spm.check()
    if model_type.startswith("gemma"):
        style = "gemma"
    elif tokenizer_config.get("legacy", True):
        style = "phi3"  # a prefix space on every stretch between special tokens
    else:
        style = "llama"  # a prefix space before the first piece of the text only
    n = len(spm.pieces)
    fields: dict[str, Any] = {
        "general.architecture": style,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": spm.pieces,
        "tokenizer.ggml.scores": spm.scores,
        "tokenizer.ggml.token_type": spm.types,
        "tokenizer.ggml.add_bos_token": bool(tokenizer_config.get("add_bos_token", True)),
        "tokenizer.ggml.add_eos_token": bool(tokenizer_config.get("add_eos_token", False)),
        "tokenizer.ggml.add_space_prefix": spm.add_dummy_prefix,
    }
    for key, value in (
        ("bos_token_id", spm.bos_id),
        ("eos_token_id", spm.eos_id),
        ("unknown_token_id", spm.unk_id),
        ("padding_token_id", spm.pad_id),
    ):
        if 0 <= value < n:
            fields[f"tokenizer.ggml.{key}"] = value
    for tid, added in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        content = added.get("content") if isinstance(added, dict) else None
        if not (0 <= int(tid) < n and spm.pieces[int(tid)] == content):
            raise TokenizerLoadError(
                f"{model_file}: added token {content!r} (id {tid}) is not that piece of "
                "tokenizer.model; write a tokenizer.json with transformers"
            )
    tok, _, _ = build_gguf_tokenizer(GGUFVocab.from_fields(fields))
    # transformers matches the named special tokens (<unk> too) whole in text.
    named = (tokenizer_config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token"))
    contents = [t.get("content") if isinstance(t, dict) else t for t in named]
    tok.add_special_tokens(
        [AddedToken(c, special=True, normalized=False) for c in contents if c in spm.pieces]
    )
    return tok
