"""An HF directory with only a SentencePiece tokenizer.model (no tokenizer.json): the
tokenizer rebuilt from the proto equals the SentencePiece library itself and
transformers' tokenizer for the same directory, token for token, on a varied corpus."""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
import transformers

from pagewarden.models.sentencepiece_model import SentencePieceModel
from pagewarden.models.tokenizer import TokenizerLoadError, load_tokenizer

TRAIN = [
    "Hello world! This is a tiny corpus, with numbers 12345 and ümlauts café.",
    "  leading spaces and\ttabs\nnewlines   trailing   ",
    "日本語のテキスト。한국어 텍스트. Ελληνικά κείμενα.",
    "emoji 🙂 and code: def f(x): return x**2 # comment",
    "The quick brown fox jumps over the lazy dog; don't we'll they're",
]
CORPUS = [
    "Hello world!",
    " leading space",
    "   three spaces then text",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n",
    "numbers 0 7 42 1234567 3.14159",
    "unseen characters: ∑ ∫ √ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "emoji 🙂🙃👍🏽 mixed",
    "日本語とEnglishの混在",
    "Ελληνικά and кириллица",
    "don't can't won't y'all",
    "a",
    " ",
    "",
    "x" * 40,
]


def _train(tmp_path, **kw) -> tuple[str, str]:
    (tmp_path / "corpus.txt").write_text("\n".join(TRAIN * 40))
    args = dict(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        allow_whitespace_only_pieces=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    spm.SentencePieceTrainer.train(**{**args, **kw})
    return str(tmp_path / "sp.model"), str(tmp_path / "sp.vocab")


def _hf_dir(tmp_path, legacy: bool | None, **kw):
    model, _ = _train(tmp_path, **kw)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(open(model, "rb").read())
    cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
    cfg |= {"unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    if legacy is not None:
        cfg["legacy"] = legacy
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d, model


def test_proto_parse_matches_the_library(tmp_path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    model, _ = _train(tmp_path)
    data = open(model, "rb").read()
    proto = pb.ModelProto()
    proto.ParseFromString(data)
    ours = SentencePieceModel.parse(data)
    assert ours.pieces == [p.piece for p in proto.pieces]
    assert ours.scores == [p.score for p in proto.pieces]
    assert ours.types == [p.type for p in proto.pieces]
    assert (ours.model_type, ours.byte_fallback, ours.split_digits) == (2, True, True)
    assert (ours.pad_id, ours.normalizer, ours.add_dummy_prefix) == (-1, "identity", True)


@pytest.mark.parametrize("legacy", [True, None])
def test_tokenizer_model_dir_matches_references(tmp_path, legacy):
    """Equal to the SentencePiece library on every text (what the slow legacy
    LlamaTokenizer runs) and to transformers' tokenizer for the directory where that one
    agrees with the library: its Metaspace adds no prefix to text that starts with a
    space (" x": library "▁▁x", transformers "▁x")."""
    d, model = _hf_dir(tmp_path, legacy)
    ours = load_tokenizer(d)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    sp = spm.SentencePieceProcessor(model_file=model)
    checked = 0
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == [sp.bos_id(), *sp.encode(text)], text
        if not text[:1].isspace():
            assert ids == ref.encode(text), text
            checked += 1
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert checked >= len(CORPUS) - 4
    assert ours.encode(" x") != ref.encode(" x")  # the documented difference
    # Special tokens in text split it; each stretch is encoded by the library.
    a, b = "a ", " b"
    want = [1, *sp.encode(a), sp.bos_id(), *sp.encode(b)]
    assert ours.encode("a <s> b") == want
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2


SPECIAL_TEXTS = ["a <s> b", "<s>x", "hi</s> there", "x</s>", " <s> y", "<unk>z"]


def test_non_legacy_matches_transformers(tmp_path):
    """legacy: false (transformers' LlamaConverter: Metaspace, prepend "first"): equal to
    transformers' tokenizer for the directory on every text, text that starts with
    whitespace and text after special tokens included, and decoding alike."""
    d, model = _hf_dir(tmp_path, False)
    ours = load_tokenizer(d)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    for text in CORPUS + SPECIAL_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), text
    # Where legacy differs: no prefix space on the stretch after a special token.
    (tmp_path / "legacy").mkdir()
    legacy = load_tokenizer(_hf_dir(tmp_path / "legacy", True)[0])
    assert ours.encode("a <s> b") != legacy.encode("a <s> b")


def test_unigram_differs_between_library_and_transformers(tmp_path):
    """Why a unigram tokenizer.model is refused: transformers 5 loads it as BPE merges,
    and those split text differently from the SentencePiece model itself."""
    d, model = _hf_dir(tmp_path, None, model_type="unigram")
    ref = transformers.AutoTokenizer.from_pretrained(d)
    sp = spm.SentencePieceProcessor(model_file=model)
    differ = [t for t in CORPUS if [sp.bos_id(), *sp.encode(t)] != ref.encode(t)]
    assert "don't can't won't y'all" in differ


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(model_type="unigram"), "a unigram model"),
        (dict(byte_fallback=False), "byte_fallback"),
        (dict(normalization_rule_name="nmt_nfkc"), "text normalization"),
        (dict(remove_extra_whitespaces=True), "text normalization"),
    ],
)
def test_unsupported_models_are_refused(tmp_path, kw, match):
    d, _ = _hf_dir(tmp_path, None, **kw)
    with pytest.raises(TokenizerLoadError, match=match):
        load_tokenizer(d)
