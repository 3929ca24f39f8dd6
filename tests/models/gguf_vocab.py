"""Tiny tokenizers trained in-test and written into vocab-only GGUF files, the way
llama.cpp's convert_hf_to_gguf.py writes a real model's vocabulary."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

# Text for training and for the comparisons: English, code, numbers (long digit runs),
# contractions, whitespace runs and newlines, CJK, emoji, accented, Cyrillic, Arabic.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what we'd've done; they'll see.",
    "I'm sure you're right, but don't: WE'VE SEEN IT'S TRUE. She'd say 'yes'.",
    "def add(a, b):\n    return a + b  # sum\n\nclass Foo:\n\tpass\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }  // C++",
    "Numbers: 3.14159, 2718281828459045, 1,000,000 and 42nd; phone +1-555-0100.",
    "Paged attention keeps keys and values in blocks of 16 tokens.",
    "Naïve café, Ångström, façade, jalapeño, Zürich, résumé, ½ ⅓.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 🙂🚀🎉 and 👩‍💻 and 🇫🇷.",
    "   leading spaces, trailing spaces   \n\n\nthree newlines\r\nCRLF\ttab",
    "<tag> <|im_start|>user\nHello<|im_end|> </tag>",
] * 8

TEXTS = [
    "",
    " ",
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "Hello\n\nworld\n",
    "trailing   ",
    "tabs\tand\r\nCRLF\n\n\n\nruns",
    "don't I'll you're WE'VE it's 'quoted' she'd",
    "x = 1234567890123 + 3.14159 - 42,000,000",
    "0 00 000 0000 00000 123456789012345678901234567890",
    "def f(a, b):\n    return a**2 // b  # comment\n",
    "if (x != y) { return -1; } else { y++; }",
    "naïve café Ångström jalapeño",
    "e\u0301 (decomposed) vs \u00e9 (composed)",
    "Привет, мир! Съешь ещё этих булок.",
    "مرحبا بالعالم",
    "日本語のテキスト 中文文本 한국어",
    "🙂🚀 👩‍💻 🇫🇷 emoji",
    "unseen: ẞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ ∮ ⅞ ᚠᛇᚻ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more <|im_start|> spaced",
    "<s> bos inside </s> eos inside",
    "<tag> user-defined </tag>",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer each model's own tokenizer.json has (the training truth)."""
    if pre in ("llama-bpe", "qwen2"):
        split = LLAMA3_SPLIT if pre == "llama-bpe" else QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), level])
    return level


def train_byte_level(pre: str, vocab_size: int = 700) -> HFTokenizer:
    """A byte-level BPE trained with the pre-tokenizer of `pre` (a GGUF pre name)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = _byte_level_pre(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


LLAMA_SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
GEMMA_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3)]
GEMMA_SPECIALS += [("<start_of_turn>", 3), ("<end_of_turn>", 3), ("\n", 4), ("\n\n", 4)]


def train_sentencepiece(
    specials: list[tuple[str, int]] = LLAMA_SPECIALS, vocab_size: int = 700
) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style BPE vocabulary as llama.cpp writes it: the special tokens
    (with their llama.cpp token types), the 256 byte tokens `<0xNN>`, then pieces
    best-first with score -rank, plus two user-defined tokens. Returns (tokens, scores,
    token types)."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator([t.replace("<|im_start|>", "") for t in CORPUS], trainer)
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in specials] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    for extra in ("<tag>", "</tag>"):
        tokens.append(extra)
        types.append(4)
        scores.append(0.0)
    return tokens, scores, types


def write_vocab_gguf(
    path: Path,
    arch: str,
    model: str,
    tokens: list[str],
    types: list[int],
    *,
    pre: str | None = None,
    merges: list[str] | None = None,
    scores: list[float] | None = None,
    bos: int | None = None,
    eos: int | None = None,
    unk: int | None = None,
    add_bos: bool | None = None,
    add_space_prefix: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a vocab-only GGUF (no tensors) with the metadata transformers' GGUF config
    reader needs."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in (("bos", bos), ("eos", eos), ("unk", unk)):
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_gguf(path: Path, pre: str, arch: str = "llama", **kw) -> tuple[Path, HFTokenizer]:
    """Train a byte-level BPE for `pre` and write it as llama.cpp would; returns the GGUF
    and the trained tokenizer (the model's own tokenizer.json, the ground truth)."""
    tok = train_byte_level(pre)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    import json

    merges = [
        " ".join(m) if isinstance(m, list) else m
        for m in json.loads(tok.to_str())["model"]["merges"]
    ]
    kw.setdefault("bos", tokens.index("<|im_start|>"))
    kw.setdefault("eos", tokens.index("<|im_end|>"))
    write_vocab_gguf(path, arch, "gpt2", tokens, types, pre=pre, merges=merges, **kw)
    return path, tok
