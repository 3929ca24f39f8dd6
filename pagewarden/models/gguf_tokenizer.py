"""A `tokenizers.Tokenizer` built from a GGUF file's vocabulary.

A GGUF carries no tokenizer.json: it stores the vocabulary, merges or scores, token types
and special token ids under llama.cpp's `tokenizer.ggml.*` keys. Two kinds exist:

- `tokenizer.ggml.model = gpt2`: byte-level BPE with merges. How text is split before
  BPE depends on `tokenizer.ggml.pre`; `BYTE_LEVEL_PRE_TOKENIZERS` maps each name we
  support to its pre-tokenizer, and any other name is refused.
- `tokenizer.ggml.model = llama`: SentencePiece BPE with byte fallback (`<0xNN>` tokens).
  The merges are rebuilt from the scores (a merge ranks as its merged piece's score).
  How spaces become `▁` differs by family; `SENTENCEPIECE_STYLES` maps
  `general.architecture` to that family's normalizer, pre-tokenizer and decoder.

The reference is transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
(what vLLM serves a GGUF with); every setting below reproduces it, and the tests compare
the two token for token. Where a file asks for something that reference does not do (a
`tokenizer.ggml.add_space_prefix` that contradicts the family's fixed behaviour), the
file is refused rather than tokenized approximately.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer


class TokenizerLoadError(ValueError):
    """The tokenizer files are missing, malformed, or ask for something unsupported."""


# llama.cpp's token types (gguf.TokenType).
CONTROL = 3
USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is _GPT2_SPLIT.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _split_then_bytes(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=True, use_regex=False
                ),
            ]
        )

    return build


#: `tokenizer.ggml.pre` -> the pre-tokenizer of a byte-level BPE vocabulary. The names
#: are llama.cpp's (convert_hf_to_gguf.py writes them); aliases share one entry.
BYTE_LEVEL_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt2": _gpt2,
    "gpt-2": _gpt2,
    # SmolLM's own tokenizer.json and llama.cpp also split off every \p{N} character
    # first; transformers' GGUF loader does not. On SmolLM2's vocabulary (no token holds
    # two digits) the two differ only on a space before a non-ASCII number such as " ⅓".
    "smollm": _gpt2,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),  # Llama 3.x
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),  # Qwen 1.5 / 2 / 2.5 / 3
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}


@dataclass(frozen=True)
class SentencePieceStyle:
    """How one model family's SentencePiece vocabulary turns text into pieces.

    `space_prefix` is what the family's reference tokenizer does with a leading space
    (fixed, whatever the file says). `merge_order` ranks the rebuilt merges by the score
    the file gives each piece, or by the piece's position in the file (Gemma's scores do
    not follow its merge order). `respell_spaces` renames tokens made only of spaces
    ("  ") to their `▁` spelling, as the merges look them up.
    """

    space_prefix: bool
    merge_order: Literal["score", "position"]
    respell_spaces: bool
    unk_in_model: bool  # the BPE model names the unknown token (Gemma) or leaves it unset
    normalizer: Callable[[], normalizers.Normalizer | None]
    pre_tokenizer: Callable[[], pre_tokenizers.PreTokenizer | None]
    decoder: Callable[[], decoders.Decoder]


def _spm_decoder(strip_prefix: bool) -> Callable[[], decoders.Decoder]:
    def build() -> decoders.Decoder:
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if strip_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        return decoders.Sequence(steps)

    return build


_LLAMA_STYLE = SentencePieceStyle(
    space_prefix=True,
    merge_order="score",
    respell_spaces=False,
    unk_in_model=False,
    normalizer=lambda: None,
    pre_tokenizer=lambda: pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    ),
    decoder=_spm_decoder(strip_prefix=True),
)
_GEMMA_STYLE = SentencePieceStyle(
    space_prefix=False,
    merge_order="position",
    respell_spaces=True,
    unk_in_model=True,
    normalizer=lambda: normalizers.Replace(" ", "\u2581"),
    pre_tokenizer=lambda: pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False),
    decoder=_spm_decoder(strip_prefix=False),
)
# Phi-3 puts the prefix space in with a normalizer, so it also lands after special tokens
# and on text that starts with a space ("  hi" -> "▁▁▁hi").
_PHI3_STYLE = SentencePieceStyle(
    space_prefix=True,
    merge_order="score",
    respell_spaces=False,
    unk_in_model=False,
    normalizer=lambda: normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    ),
    pre_tokenizer=lambda: None,
    decoder=_spm_decoder(strip_prefix=True),
)

#: `general.architecture` -> how its SentencePiece (`tokenizer.ggml.model = llama`)
#: vocabulary is applied. Mistral and TinyLlama GGUFs say `llama`.
SENTENCEPIECE_STYLES: dict[str, SentencePieceStyle] = {
    "llama": _LLAMA_STYLE,
    "mistral": _LLAMA_STYLE,
    "gemma": _GEMMA_STYLE,
    "gemma2": _GEMMA_STYLE,
    "gemma3": _GEMMA_STYLE,
    "phi3": _PHI3_STYLE,
}


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF, parsed and checked once."""

    architecture: str
    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool | None
    add_eos_token: bool | None
    add_space_prefix: bool | None
    chat_template: str | None

    @staticmethod
    def from_fields(fields: Mapping[str, Any]) -> GGUFVocab:
        """Parse GGUF metadata (key -> value, as `GGUFReader` fields' `contents()`)."""
        tokens = fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerLoadError("GGUF has no tokenizer.ggml.tokens vocabulary")
        n = len(tokens)
        types = fields.get("tokenizer.ggml.token_type") or [1] * n
        scores = fields.get("tokenizer.ggml.scores")
        for key, seq in (("token_type", types), ("scores", scores)):
            if seq is not None and len(seq) != n:
                raise TokenizerLoadError(
                    f"tokenizer.ggml.{key} has {len(seq)} entries for {n} tokens"
                )

        def token_id(key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < n:
                raise TokenizerLoadError(f"tokenizer.ggml.{key}={value} is outside the vocabulary")
            return int(value)

        def flag(key: str) -> bool | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            return None if value is None else bool(value)

        template = fields.get("tokenizer.chat_template")
        return GGUFVocab(
            architecture=str(fields.get("general.architecture", "")),
            model=str(fields.get("tokenizer.ggml.model", "")),
            pre=fields.get("tokenizer.ggml.pre"),
            tokens=list(tokens),
            token_types=[int(t) for t in types],
            scores=None if scores is None else [float(s) for s in scores],
            merges=fields.get("tokenizer.ggml.merges"),
            bos_token_id=token_id("bos_token_id"),
            eos_token_id=token_id("eos_token_id"),
            unk_token_id=token_id("unknown_token_id"),
            pad_token_id=token_id("padding_token_id"),
            add_bos_token=flag("add_bos_token"),
            add_eos_token=flag("add_eos_token"),
            add_space_prefix=flag("add_space_prefix"),
            chat_template=template if isinstance(template, str) else None,
        )

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_gguf_tokenizer(vocab: GGUFVocab) -> tuple[HFTokenizer, bool, bool]:
    """The tokenizer `vocab` describes, and whether it adds BOS / EOS to each text."""
    builder = _MODEL_BUILDERS.get(vocab.model)
    if builder is None:
        raise TokenizerLoadError(
            f"unsupported GGUF tokenizer.ggml.model {vocab.model!r}; "
            f"supported: {sorted(_MODEL_BUILDERS)}"
        )
    tok, add_bos = builder(vocab)
    add_eos = bool(vocab.add_eos_token)
    _add_vocab_tokens(tok, vocab)
    set_bos_eos_post_processor(
        tok,
        vocab.token(vocab.bos_token_id) if add_bos else None,
        vocab.token(vocab.eos_token_id) if add_eos else None,
    )
    bos_added = add_bos and vocab.bos_token_id is not None
    eos_added = add_eos and vocab.eos_token_id is not None
    return tok, bos_added, eos_added


def _byte_level(vocab: GGUFVocab) -> tuple[HFTokenizer, bool]:
    pre = BYTE_LEVEL_PRE_TOKENIZERS.get(vocab.pre or "")
    if pre is None:
        raise TokenizerLoadError(
            f"unsupported GGUF tokenizer.ggml.pre {vocab.pre!r} for a byte-level BPE vocabulary; "
            f"supported: {sorted(BYTE_LEVEL_PRE_TOKENIZERS)}"
        )
    if vocab.merges is None:
        raise TokenizerLoadError("byte-level GGUF vocabulary has no tokenizer.ggml.merges")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    # A token outside the byte alphabet (rare: some control tokens) is looked up by its
    # byte-level spelling, as transformers does.
    table = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(vocab.tokens)
    }
    merges = [_merge_pair(m) for m in vocab.merges]
    tok = HFTokenizer(models.BPE(table, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre()
    tok.decoder = decoders.ByteLevel()
    return tok, bool(vocab.add_bos_token)


def _merge_pair(merge: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise TokenizerLoadError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return parts[0], parts[1]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelled, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _sentencepiece(vocab: GGUFVocab) -> tuple[HFTokenizer, bool]:
    style = SENTENCEPIECE_STYLES.get(vocab.architecture)
    if style is None:
        raise TokenizerLoadError(
            f"unsupported SentencePiece GGUF vocabulary for architecture {vocab.architecture!r}; "
            f"supported: {sorted(SENTENCEPIECE_STYLES)}"
        )
    if vocab.add_space_prefix is not None and vocab.add_space_prefix != style.space_prefix:
        raise TokenizerLoadError(
            f"tokenizer.ggml.add_space_prefix={vocab.add_space_prefix} is unsupported for "
            f"{vocab.architecture!r}: its tokenizer always "
            f"{'adds' if style.space_prefix else 'omits'} the prefix space"
        )
    tokens = vocab.tokens
    if style.respell_spaces:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    table = {t: i for i, t in enumerate(tokens)}
    if vocab.merges is not None:
        merges = [_merge_pair(m) for m in vocab.merges]
    elif style.merge_order == "position":
        merges = _merges_from_ranks(table, {t: -float(i) for i, t in enumerate(tokens)})
    elif vocab.scores is not None:
        merges = _merges_from_ranks(table, dict(zip(tokens, vocab.scores)))
    else:
        raise TokenizerLoadError("SentencePiece GGUF vocabulary has neither merges nor scores")
    unk = (vocab.token(vocab.unk_token_id) or "<unk>") if style.unk_in_model else None
    tok = HFTokenizer(models.BPE(table, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    normalizer = style.normalizer()
    if normalizer is not None:
        tok.normalizer = normalizer
    pre = style.pre_tokenizer()
    if pre is not None:
        tok.pre_tokenizer = pre
    tok.decoder = style.decoder()
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    return tok, vocab.add_bos_token is not False


def _merges_from_ranks(table: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two vocabulary pieces is a merge, ranked by the merged
    piece's `rank` (highest first), then by the shorter left and right parts."""
    found: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in table and piece[i:] in table
        ]
        local.sort(key=lambda m: (table[m[0]], table[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_vocab_tokens(tok: HFTokenizer, vocab: GGUFVocab) -> None:
    """Control tokens become special added tokens and user-defined ones plain added
    tokens, so both are matched whole in text. A byte-level control token spelled outside
    the byte alphabet is a llama.cpp mislabel and stays an ordinary token."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if vocab.model == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(vocab.tokens, vocab.token_types)
        if ty == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    known = tok.get_vocab(with_added_tokens=True)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(vocab.tokens, vocab.token_types)
        if ty == USER_DEFINED and t in known
    ]
    if user:
        tok.add_tokens(user)


def set_bos_eos_post_processor(tok: HFTokenizer, bos: str | None, eos: str | None) -> None:
    """Add `bos` before and `eos` after each text (None: not that one), as transformers'
    `update_post_processor` writes it."""
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join(
        [single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])]
    )
    specials = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, i) for t, i in specials if i is not None]
    )


_MODEL_BUILDERS: dict[str, Callable[[GGUFVocab], tuple[HFTokenizer, bool]]] = {
    "gpt2": _byte_level,
    "llama": _sentencepiece,
}
