"""Tokenizers equal transformers' for the same files: GGUF vocabularies of every kind we
support (made here as vocab-only GGUFs from tokenizers trained in-test, plus the real
SmolLM2 and Gemma 3 files) and HF directories; chat templates render as transformers'."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from gguf_vocab import (
    CORPUS,
    GEMMA_SPECIALS,
    TEXTS,
    byte_level_gguf,
    train_sentencepiece,
    write_vocab_gguf,
)
from transformers import AutoTokenizer

from pagewarden.engine.detokenizer import IncrementalDetokenizer
from pagewarden.models.chat_template import ChatTemplateError, read_chat_template
from pagewarden.models.gguf_metadata import read_gguf_metadata
from pagewarden.models.gguf_tokenizer import BYTE_LEVEL_PRE_TOKENIZERS
from pagewarden.models.loader import default_model_path
from pagewarden.models.tokenizer import Tokenizer, TokenizerLoadError, load_tokenizer
from pagewarden.sampling_params import SamplingParams

GEMMA_TEMPLATE = (Path(__file__).parent / "data" / "gemma3_chat_template.jinja").read_text()
ALL_TEXTS = TEXTS + sorted(set(CORPUS))


def reference(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same(ours: Tokenizer, ref, texts: list[str] = ALL_TEXTS) -> None:
    """Encode (with and without special tokens) and decode (skipping them or not) agree."""
    for text in texts:
        for add in (True, False):
            ids = ref(text, add_special_tokens=add).input_ids
            assert ours.encode(text, add_special_tokens=add) == ids, (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)


# --- byte-level BPE GGUFs ------------------------------------------------------------


@pytest.mark.parametrize(
    "pre,arch,add_bos",
    [
        ("gpt2", "gpt2", None),
        ("gpt-2", "gpt2", None),
        ("smollm", "llama", False),
        ("llama-bpe", "llama", True),  # Llama 3.x: adds <|begin_of_text|>
        ("qwen2", "qwen2", False),
        ("deepseek-r1-qwen", "qwen2", None),
    ],
)
def test_byte_level_gguf_matches_transformers(tmp_path, pre, arch, add_bos):
    train_pre = {"gpt-2": "gpt2", "deepseek-r1-qwen": "qwen2"}.get(pre, pre)
    path, _ = byte_level_gguf(tmp_path / "v.gguf", train_pre, arch=arch, add_bos=add_bos)
    if train_pre != pre:  # same vocabulary, the alias written as the file's pre name
        fields = read_gguf_metadata(path)
        write_vocab_gguf(
            path,
            arch,
            "gpt2",
            fields["tokenizer.ggml.tokens"],
            fields["tokenizer.ggml.token_type"],
            pre=pre,
            merges=fields["tokenizer.ggml.merges"],
            bos=fields["tokenizer.ggml.bos_token_id"],
            eos=fields["tokenizer.ggml.eos_token_id"],
        )
    ours = load_tokenizer(path)
    assert_same(ours, reference(path))
    assert (ours.encode("hi")[0] == ours.bos_token_id) == bool(add_bos)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_gguf_splits_as_the_models_own_tokenizer(tmp_path, pre):
    """The pre-tokenizer is the one the vocabulary was trained with (Qwen2's regex for
    a qwen2 GGUF, not GPT-2's): token ids equal the original tokenizer.json's."""
    path, trained = byte_level_gguf(tmp_path / "v.gguf", pre, arch="qwen2")
    ours = load_tokenizer(path)
    for text in ALL_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == trained.encode(text).ids, text


def test_qwen2_regex_is_not_gpt2s(tmp_path):
    """The same Qwen2 vocabulary split by GPT-2's regex tokenizes differently: a GGUF's
    pre name decides, so it must map to the right regex."""
    path, _ = byte_level_gguf(tmp_path / "q.gguf", "qwen2", arch="qwen2")
    fields = read_gguf_metadata(path)
    as_gpt2 = dict(fields, **{"tokenizer.ggml.pre": "gpt2"})
    qwen, gpt2 = Tokenizer.from_gguf_fields(fields), Tokenizer.from_gguf_fields(as_gpt2)
    differ = [t for t in ALL_TEXTS if qwen.encode(t) != gpt2.encode(t)]
    assert differ  # e.g. contractions and digit runs


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    path, _ = byte_level_gguf(tmp_path / "v.gguf", "gpt2")
    fields = read_gguf_metadata(path)
    for pre in ("tekken", None):
        f = dict(fields, **{"tokenizer.ggml.pre": pre})
        with pytest.raises(TokenizerLoadError, match="tokenizer.ggml.pre") as e:
            Tokenizer.from_gguf_fields(f)
        assert "qwen2" in str(e.value) and "smollm" in str(e.value)  # names what is supported
    with pytest.raises(TokenizerLoadError, match="'rwkv'"):
        Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.model": "rwkv"}))


def test_pre_tokenizer_table_names_the_models_we_serve():
    assert {"gpt2", "smollm", "llama-bpe", "qwen2"} <= set(BYTE_LEVEL_PRE_TOKENIZERS)


# --- SentencePiece GGUFs (tokenizer.ggml.model = llama) ----------------------------------


def spm_gguf(tmp_path: Path, arch: str, **kw) -> Path:
    gemma = arch.startswith("gemma")
    tokens, scores, types = train_sentencepiece(GEMMA_SPECIALS) if gemma else train_sentencepiece()
    ids = {"bos": 2, "eos": 1, "unk": 3} if gemma else {"bos": 1, "eos": 2, "unk": 0}
    kw.setdefault("add_space_prefix", not gemma)
    return write_vocab_gguf(
        tmp_path / f"{arch}.gguf", arch, "llama", tokens, types, scores=scores, **ids, **kw
    )


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma", "gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("add_bos", [None, True, False])
def test_sentencepiece_gguf_matches_transformers(tmp_path, arch, add_bos):
    path = spm_gguf(tmp_path, arch, add_bos=add_bos)
    same_as = {"mistral": "llama", "gemma": "gemma3"}.get(arch)
    if same_as:  # transformers cannot read these GGUFs' configs; they share a style
        ours, twin = (
            load_tokenizer(path),
            load_tokenizer(spm_gguf(tmp_path, same_as, add_bos=add_bos)),
        )
        assert all(ours.encode(t) == twin.encode(t) for t in ALL_TEXTS)
        return
    ours = load_tokenizer(path)
    assert_same(ours, reference(path))
    assert (ours.encode("hi")[0] == ours.bos_token_id) == (add_bos is not False)


def test_sentencepiece_byte_fallback_and_space_handling(tmp_path):
    ours = load_tokenizer(spm_gguf(tmp_path, "llama", add_bos=False))
    ids = ours.encode("ẞ", add_special_tokens=False)  # not in the vocabulary: UTF-8 bytes
    assert [ours.id_to_token(i) for i in ids] == ["\u2581", "<0xE1>", "<0xBA>", "<0x9E>"]
    assert ours.decode(ids) == "ẞ"
    assert ours.id_to_token(ours.encode("Hello", add_special_tokens=False)[0]).startswith("\u2581")
    gemma = load_tokenizer(spm_gguf(tmp_path, "gemma3", add_bos=False))
    assert not gemma.id_to_token(gemma.encode("Hello", add_special_tokens=False)[0]).startswith(
        "\u2581"
    )


@pytest.mark.parametrize("arch,flag", [("llama", False), ("phi3", False), ("gemma3", True)])
def test_contradicting_add_space_prefix_is_refused(tmp_path, arch, flag):
    path = spm_gguf(tmp_path, arch, add_space_prefix=flag)
    with pytest.raises(TokenizerLoadError, match="add_space_prefix"):
        load_tokenizer(path)


def test_sentencepiece_for_unknown_architecture_is_refused(tmp_path):
    path = spm_gguf(tmp_path, "rwkv6")
    with pytest.raises(TokenizerLoadError, match="'rwkv6'.*supported"):
        load_tokenizer(path)


def test_sentencepiece_incremental_decode_equals_full_decode(tmp_path):
    """Streaming detokenization over `▁` pieces and byte-fallback tokens (a character
    split across several `<0xNN>` tokens) ends with the full decode's text."""
    rng = random.Random(0)
    for arch in ("llama", "gemma3"):
        tok = load_tokenizer(spm_gguf(tmp_path, arch, add_bos=False))
        # Prompts ending in byte tokens, outputs starting with them.
        for prompt_text in ("Once upon a time", "ends in bytes ẞ☃", "ẞ𝔘𝔫𝔦"):
            prompt = tok.encode(prompt_text, add_special_tokens=False)
            starts = ["𝔠𝔬𝔡𝔢 and more", "☃ snow "]
            for start in starts + [""] * 10:
                text = start + "".join(rng.sample(ALL_TEXTS, 3)).lstrip()
                ids = tok.encode(text, add_special_tokens=False)
                det = IncrementalDetokenizer(tok, prompt, SamplingParams())
                streamed = "".join(det.add_tokens([i]).text for i in ids) + det.flush()
                full = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
                assert streamed == det.text == full, (prompt_text, text)


# --- HF directories ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,cls",
    [
        ("llama-bpe", "PreTrainedTokenizerFast"),
        ("spm-llama", "LlamaTokenizer"),
        ("spm-gemma3", "GemmaTokenizer"),
    ],
)
@pytest.mark.parametrize("add_bos", [None, True, False])
def test_hf_dir_matches_transformers(tmp_path, kind, cls, add_bos):
    """tokenizer.json + tokenizer_config.json load as transformers loads them (whose
    add_bos_token does not override tokenizer.json's post-processor)."""
    if kind.startswith("spm-"):
        gguf = spm_gguf(tmp_path, kind[4:])
    else:
        gguf, _ = byte_level_gguf(tmp_path / "v.gguf", kind)
    src = load_tokenizer(gguf)
    d = tmp_path / "hf"
    d.mkdir()
    src.backend.save(str(d / "tokenizer.json"))
    cfg: dict = {"tokenizer_class": cls, "bos_token": src.bos_token, "eos_token": src.eos_token}
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, ref = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert_same(ours, ref)
    assert (ours.encode("hi")[0] == ours.bos_token_id) == kind.startswith("spm-")


def test_hf_dir_clean_up_tokenization_spaces(tmp_path):
    """transformers skips the " ." -> "." clean-up for BPE, so a BPE tokenizer with the
    flag set decodes as it is; any other model with it set is refused."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    gguf, _ = byte_level_gguf(tmp_path / "v.gguf", "gpt2")
    d = tmp_path / "hf"
    d.mkdir()
    load_tokenizer(gguf).backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True}))
    assert_same(load_tokenizer(d), AutoTokenizer.from_pretrained(str(d)), ["Hi , you . ok ?"])
    HFTokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0)).save(str(d / "tokenizer.json"))
    with pytest.raises(TokenizerLoadError, match="clean_up_tokenization_spaces.*Unigram"):
        load_tokenizer(d)


def test_malformed_tokenizer_model_is_refused(tmp_path):
    """A tokenizer.model alone is loaded (test_sentencepiece_dir.py); a broken one is not."""
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05ab")
    with pytest.raises(TokenizerLoadError, match="tokenizer.model: truncated"):
        load_tokenizer(tmp_path)


def test_metadata_reader_equals_gguf_reader(tmp_path):
    from gguf import GGUFReader

    path = spm_gguf(tmp_path, "gemma3", chat_template="{{ 1 }}")
    want = {k: f.contents() for k, f in GGUFReader(str(path)).fields.items()}
    got = read_gguf_metadata(path)
    assert got.keys() == {k for k in want if not k.startswith("GGUF.")}
    for k, v in got.items():
        assert v == pytest.approx(want[k]) if k.endswith("scores") else v == want[k], k
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenizerLoadError, match="truncated|out of bounds|past the file"):
        load_tokenizer(tmp_path / "cut.gguf")


def test_load_tokenizer_rejects_other_paths(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(TokenizerLoadError, match="HF model directory or a .gguf"):
        load_tokenizer(tmp_path / "x.bin")
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(TokenizerLoadError, match="not a GGUF"):
        load_tokenizer(tmp_path / "bad.gguf")


# --- chat templates ------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "  Hello  "},
        {"role": "assistant", "content": "Arr!"},
        {"role": "user", "content": '日本語 🙂 and "quotes" <b>tags</b>'},
    ],
]


def assert_same_chat(ours: Tokenizer, ref, template: str | None = None) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, chat_template=template
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
            assert (
                ours.encode(want, add_special_tokens=False)
                == ref(want, add_special_tokens=False).input_ids
            )


def test_template_helpers_have_transformers_semantics(tmp_path):
    template = (
        "{{ messages | tojson }}|{{ tools | tojson(indent=1) }}|{{ flag }}|{{ bos_token }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.content }}{% endfor %}|{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% set ns.n = 3 %}{{ ns.n }}{{ dict(a=1) }}"
        "{% generation %}G{% endgeneration %}"
    )
    path, _ = byte_level_gguf(tmp_path / "v.gguf", "gpt2", chat_template=template)
    ours, ref = load_tokenizer(path), reference(path)
    messages = [
        {"role": "user", "content": "<b>é</b>", "name": None},
        {"role": "assistant", "content": "x", "reasoning_content": "why"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "ü & <x>"}}]
    got = ours.apply_chat_template(messages, tools=tools, flag="on")
    assert got == ref.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, flag="on"
    )
    assert '"<b>é</b>"' in got and "null" not in got and "|on|" in got


def test_template_errors_and_sandbox(tmp_path):
    path, _ = byte_level_gguf(
        tmp_path / "v.gguf", "gpt2", chat_template="{{ raise_exception('no') }}"
    )
    tok = load_tokenizer(path)
    with pytest.raises(ChatTemplateError, match="no"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    for escape in ("{{ ''.__class__.__mro__ }}", "{% set x = messages.append(1) %}"):
        with pytest.raises(ChatTemplateError):
            tok.with_chat_template(escape).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.with_chat_template("{% if %}").apply_chat_template([{"role": "user", "content": "x"}])
    untemplated = Tokenizer(tok.backend, None, None)
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        untemplated.apply_chat_template([{"role": "user", "content": "x"}])


def test_read_chat_template_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(f)) == "{{ messages[0].content }}"
    assert read_chat_template("{{ 1 }}") == "{{ 1 }}"
    with pytest.raises(ChatTemplateError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_hf_dir_chat_template_sources(tmp_path):
    gguf, _ = byte_level_gguf(tmp_path / "v.gguf", "gpt2")
    d = tmp_path / "hf"
    d.mkdir()
    load_tokenizer(gguf).backend.save(str(d / "tokenizer.json"))
    named = [{"name": "default", "template": "D{{ messages[0].content }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    msgs = [{"role": "user", "content": "x"}]
    assert load_tokenizer(d).apply_chat_template(msgs) == "Dx"
    (d / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_tokenizer(d).apply_chat_template(msgs) == "Jx"


# --- the real models -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    p = default_model_path()
    return load_tokenizer(p), reference(p)


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    return load_tokenizer(gemma3_gguf), reference(gemma3_gguf)


EXTRA = [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>x <unused0> <mask> [multimodal]",
    "a  b   c    d\n\n\n\n\n\n    indented\n        more",
    "\u2581leading metaspace x\u2581y ĠHello",
    "<|im_start|>system\nYou are SmolLM<|im_end|>\n",
]


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2):
    ours, ref = smollm2
    assert_same(ours, ref, ALL_TEXTS + EXTRA)
    assert ours.vocab_size == len(ref) == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2) and 2 in ours.eos_token_ids
    assert_same_chat(ours, ref)


@pytest.mark.slow
def test_gemma3_gguf_matches_transformers(gemma3):
    ours, ref = gemma3
    assert_same(ours, ref, ALL_TEXTS + EXTRA)
    assert ours.vocab_size == len(ref) == 262144
    assert ours.encode("Hi")[0] == ours.bos_token_id == 2
    assert (
        ours.eos_token_id == 1 and ours.backend.token_to_id("<end_of_turn>") in ours.eos_token_ids
    )
    # The GGUF of the base model has no template: the instruction-tuned Gemma 3 one,
    # with its system message folded into the first user turn.
    ours = ours.with_chat_template(GEMMA_TEMPLATE)
    assert_same_chat(ours, ref, GEMMA_TEMPLATE)
    text = ours.apply_chat_template(CONVERSATIONS[1])
    assert (
        text
        == "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}])


@pytest.mark.slow
def test_gemma3_incremental_decode_equals_full_decode(gemma3):
    ours, _ = gemma3
    for text in ALL_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        det = IncrementalDetokenizer(ours, [], SamplingParams())
        streamed = "".join(det.add_tokens([i]).text for i in ids) + det.flush()
        assert streamed == ours.decode(ids), text


def test_long_texts_encode_the_same_without_the_gil():
    """Past a few thousand characters ``encode`` goes through ``encode_batch`` (which
    releases the GIL, so a server's event loop keeps running): the same ids."""
    tok = load_tokenizer(default_model_path())
    text = " ".join(ALL_TEXTS) * 40 + " ünïcödé 日本語 🙂\n\n   x"
    assert len(text) > 4096
    for special in (True, False):
        want = tok.backend.encode(text, add_special_tokens=special).ids
        assert tok.encode(text, add_special_tokens=special) == want
