"""Tokenizer over `tokenizers`, built from an HF directory or GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}


class TokenizerLoadError(ValueError):
    """The tokenizer files are missing or malformed."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Encode/decode text and render chat templates."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        extra_eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            {i for i in (eos_token_id,) if i is not None} | set(extra_eos_ids)
        )
        self.chat_template = chat_template
        self.all_special_ids: list[int] = sorted(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (as transformers names it)."""
        return self._tok

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does."""
        if not self.chat_template:
            raise TokenizerLoadError("this tokenizer has no chat_template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(self.chat_template).render(
            **template_kwargs,
            tools=tools,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    @staticmethod
    def from_hf_dir(path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerLoadError(f"{path}: expected tokenizer.json")
        tok = HFTokenizer.from_file(str(tj))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def tid(key: str) -> int | None:
            s = _token_str(cfg.get(key))
            return None if s is None else tok.token_to_id(s)

        extra: set[int] = set()
        gen = path / "generation_config.json"
        if gen.is_file():
            e = json.loads(gen.read_text()).get("eos_token_id")
            extra |= set(e) if isinstance(e, list) else ({e} if e is not None else set())
        return Tokenizer(tok, tid("bos_token"), tid("eos_token"), template, frozenset(extra))

    @staticmethod
    def from_gguf_fields(fields: dict[str, Any]) -> Tokenizer:
        """Build from GGUF `tokenizer.*` metadata (byte-level BPE, tokenizer.ggml.model == "gpt2")."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerLoadError(
                f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2'"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        split = _SPLITS.get(fields.get("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types)
                if ty == 3 and set(t) <= alphabet
            ]
        )
        tok.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types)
                if ty == 4
            ]
        )
        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        if fields.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            b = tokens[bos]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, bos)]
            )
        return Tokenizer(tok, bos, eos, fields.get("tokenizer.chat_template"))
