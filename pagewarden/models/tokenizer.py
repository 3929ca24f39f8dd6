"""The tokenizer: HF `tokenizers` built from an HF directory or a GGUF vocabulary.

`load_tokenizer(path)` is the one entry point: an HF model directory (tokenizer.json,
with tokenizer_config.json / chat_template.jinja / generation_config.json when present)
or a GGUF file (a full model or a vocab-only one; see `gguf_tokenizer.py`). Encoding and
decoding equal transformers' tokenizer for the same files; chat templates render as
transformers' `apply_chat_template` (see `chat_template.py`). A tokenizer that cannot be
reproduced exactly is refused with a `TokenizerLoadError` that says what is missing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pagewarden.models.chat_template import ChatTemplateError, render_chat_template
from pagewarden.models.gguf_metadata import GGUFMetadataError, read_gguf_metadata
from pagewarden.models.gguf_tokenizer import (
    GGUFVocab,
    TokenizerLoadError,
    build_gguf_tokenizer,
)
from pagewarden.models.sentencepiece_model import sentencepiece_tokenizer

__all__ = ["Tokenizer", "TokenizerLoadError", "load_tokenizer"]

# Control tokens llama.cpp also treats as end of generation (llama-vocab.cpp), besides
# `tokenizer.ggml.eos_token_id` / `eot_token_id` / `eom_token_id`.
_END_OF_GENERATION = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>"}
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
#: Texts longer than this are encoded without holding the GIL (`Tokenizer.encode`).
_GIL_FREE_CHARS = 4096


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Named special tokens as text (what chat templates see as `bos_token`, ...)."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def template_context(self) -> dict[str, str]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class Tokenizer:
    """Encode/decode text and render chat templates.

    `eos_token_ids` holds every id that ends generation: the EOS token, and the
    end-of-turn ids the model's generation config or GGUF metadata name.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        extra_eos_ids: frozenset[int] = frozenset(),
        special_tokens: SpecialTokens | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            {i for i in (eos_token_id,) if i is not None} | set(extra_eos_ids)
        )
        self.chat_template = chat_template
        self.special_tokens = special_tokens or SpecialTokens(
            bos_token=self._id_to_token(bos_token_id), eos_token=self._id_to_token(eos_token_id)
        )
        self.all_special_ids: list[int] = sorted(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def _id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    @property
    def backend_tokenizer(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (as transformers names it)."""
        return self._tok

    @property
    def bos_token(self) -> str | None:
        return self._id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._id_to_token(self.eos_token_id)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` underneath (read-only use)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # `tokenizers` releases the GIL in encode_batch, not in encode: a long prompt
            # tokenized on a worker thread must not stall the server's event loop.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """A copy of this tokenizer that renders with `chat_template` instead."""
        copy = object.__new__(Tokenizer)
        copy.__dict__.update(self.__dict__)
        copy.chat_template = chat_template
        return copy

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` does; `tools` and `template_kwargs`
        (e.g. a request's `chat_template_kwargs`) are passed into the template."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; give one with --chat-template FILE"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens.template_context(),
            tools=tools,
            **template_kwargs,
        )

    @staticmethod
    def from_hf_dir(path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        return _from_hf_dir(Path(path))

    @staticmethod
    def from_gguf_fields(fields: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> value) holding a `tokenizer.ggml.*` vocabulary."""
        vocab = GGUFVocab.from_fields(fields)
        tok, _, _ = build_gguf_tokenizer(vocab)
        extra = {
            int(i)
            for key in ("eot_token_id", "eom_token_id")
            if (i := fields.get(f"tokenizer.ggml.{key}")) is not None
        }
        extra |= {
            i
            for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.token_types))
            if ty == 3 and t in _END_OF_GENERATION
        }
        specials = SpecialTokens(
            bos_token=vocab.token(vocab.bos_token_id),
            eos_token=vocab.token(vocab.eos_token_id),
            unk_token=vocab.token(vocab.unk_token_id),
            pad_token=vocab.token(vocab.pad_token_id),
        )
        return Tokenizer(
            tok,
            vocab.bos_token_id,
            vocab.eos_token_id,
            vocab.chat_template,
            frozenset(extra),
            specials,
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an HF model directory or of a GGUF file (vocab-only too)."""
    p = Path(path)
    if p.is_dir():
        return _from_hf_dir(p)
    if p.is_file() and p.suffix == ".gguf":
        try:
            return Tokenizer.from_gguf_fields(read_gguf_metadata(p))
        except (TokenizerLoadError, GGUFMetadataError) as e:
            raise TokenizerLoadError(f"{p}: {e}") from e
    raise TokenizerLoadError(f"{p}: expected an HF model directory or a .gguf file")


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _from_hf_dir(path: Path) -> Tokenizer:
    # tokenizer.json is used as it is, post-processor (BOS/EOS) included: transformers 5
    # ignores tokenizer_config.json's add_bos_token / add_eos_token when it loads one.
    tj = path / "tokenizer.json"
    cfg: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    if tj.is_file():
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerLoadError(f"{tj}: not a readable tokenizer.json: {e}") from e
    elif (path / "tokenizer.model").is_file():
        model_type = ""
        if (path / "config.json").is_file():
            model_type = str(json.loads((path / "config.json").read_text()).get("model_type", ""))
        try:
            tok = sentencepiece_tokenizer(path / "tokenizer.model", cfg, model_type)
        except TokenizerLoadError as e:
            raise TokenizerLoadError(f"{path}: {e}") from e
    else:
        raise TokenizerLoadError(f"{path}: expected tokenizer.json or tokenizer.model")
    model_type = json.loads(tok.model.__getstate__()).get("type")
    if cfg.get("clean_up_tokenization_spaces") and model_type != "BPE":
        # transformers then rewrites decoded text (" ." -> "."); it skips that for BPE.
        raise TokenizerLoadError(
            f"{path}: clean_up_tokenization_spaces=true with a {model_type} tokenizer is "
            "unsupported (transformers would rewrite the decoded text)"
        )
    template = cfg.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    specials = SpecialTokens(**{k: _token_str(cfg.get(k)) for k in _SPECIAL_NAMES})

    def tid(token: str | None) -> int | None:
        return None if token is None else tok.token_to_id(token)

    extra: set[int] = set()
    gen = path / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
        extra |= set(ids) if isinstance(ids, list) else ({ids} if ids is not None else set())
    return Tokenizer(
        tok,
        tid(specials.bos_token),
        tid(specials.eos_token),
        template,
        frozenset(extra),
        specials,
    )
